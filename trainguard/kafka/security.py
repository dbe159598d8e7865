"""Kafka client credentials: from the environment into every client trainguard builds.

A secured broker (`trainguard broker start --secure`, see trainguard/kafka/acl.py)
authenticates each client with SASL and authorizes it with ACLs. A process says who it
is with:

==============================  ===============================================================
TRAINGUARD_KAFKA_USER           the principal's user name (unset: no authentication, PLAINTEXT)
TRAINGUARD_KAFKA_PASSWORD       its password, or
TRAINGUARD_KAFKA_PASSWORD_FILE  a file holding it (the local broker writes one per principal,
                                mode 0600, under `<data dir>/credentials/`)
TRAINGUARD_KAFKA_MECHANISM      SCRAM-SHA-256 (default), SCRAM-SHA-512 or PLAIN
TRAINGUARD_KAFKA_PROTOCOL       SASL_PLAINTEXT (default) or SASL_SSL
TRAINGUARD_KAFKA_CA_FILE        the CA bundle that signed the brokers' certificates (SASL_SSL)
==============================  ===============================================================

Passwords never come from the command line or the repository. With nothing set every
client connects exactly as before (PLAINTEXT, no SASL). Each client takes an explicit
`credentials` argument too, so that one process can hold several principals (tests);
`None` there means "from the environment" (:func:`resolve`).

Secured mode has one more consequence, decided here so that every part agrees: commands
are delivered to ranks on per-run topics (topics.run_commands_topic), because an ACL
cannot restrict a reader to the records of one key of the shared commands topic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import faust

USER_ENV = "TRAINGUARD_KAFKA_USER"
PASSWORD_ENV = "TRAINGUARD_KAFKA_PASSWORD"
PASSWORD_FILE_ENV = "TRAINGUARD_KAFKA_PASSWORD_FILE"
MECHANISM_ENV = "TRAINGUARD_KAFKA_MECHANISM"
PROTOCOL_ENV = "TRAINGUARD_KAFKA_PROTOCOL"
CA_FILE_ENV = "TRAINGUARD_KAFKA_CA_FILE"

MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")


class CredentialsError(RuntimeError):
    """The Kafka credentials in the environment are incomplete or unreadable."""


@dataclass(frozen=True)
class KafkaCredentials:
    """One SASL principal. The password is kept out of repr (logs, tracebacks)."""

    username: str
    password: str = field(repr=False)
    mechanism: str = "SCRAM-SHA-256"
    protocol: str = "SASL_PLAINTEXT"
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if not self.username or not self.password:
            raise CredentialsError("a Kafka principal needs a user name and a password")
        if self.mechanism not in MECHANISMS:
            raise CredentialsError(f"SASL mechanism {self.mechanism!r} is not one of {', '.join(MECHANISMS)}")
        if self.protocol not in PROTOCOLS:
            raise CredentialsError(
                f"security protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS)}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KafkaCredentials | None:
        """The principal named by TRAINGUARD_KAFKA_*, or None when TRAINGUARD_KAFKA_USER is unset."""
        env = os.environ if env is None else env
        user = env.get(USER_ENV)
        if not user:
            return None
        if password := env.get(PASSWORD_ENV):
            pass
        elif path := env.get(PASSWORD_FILE_ENV):
            password = read_password_file(Path(path))
        else:
            raise CredentialsError(
                f"{USER_ENV}={user} but neither {PASSWORD_ENV} nor {PASSWORD_FILE_ENV} is set"
            )
        return cls(
            user,
            password,
            env.get(MECHANISM_ENV) or "SCRAM-SHA-256",
            env.get(PROTOCOL_ENV) or "SASL_PLAINTEXT",
            env.get(CA_FILE_ENV) or None,
        )

    @classmethod
    def from_file(cls, username: str, path: Path, mechanism: str = "SCRAM-SHA-256") -> KafkaCredentials:
        return cls(username, read_password_file(path), mechanism)

    def librdkafka(self) -> dict[str, str]:
        """confluent-kafka (librdkafka) settings for this principal."""
        config = {
            "security.protocol": self.protocol,
            "sasl.mechanism": self.mechanism,
            "sasl.username": self.username,
            "sasl.password": self.password,
        }
        if self.ca_file:
            config["ssl.ca.location"] = self.ca_file
        return config

    def faust(self) -> faust.SASLCredentials:
        """faust (aiokafka) credentials for this principal: `faust.App(broker_credentials=...)`."""
        import ssl

        import faust

        context = None
        if self.protocol == "SASL_SSL":
            context = ssl.create_default_context(cafile=self.ca_file)
        return faust.SASLCredentials(
            username=self.username, password=self.password, mechanism=self.mechanism, ssl_context=context
        )

    def env(self, password_file: Path | None = None) -> dict[str, str]:
        """Environment that makes a child process this principal (the password by file if given)."""
        env = {USER_ENV: self.username, MECHANISM_ENV: self.mechanism, PROTOCOL_ENV: self.protocol}
        if password_file is not None:  # a blank password variable: the file wins over an inherited one
            env[PASSWORD_FILE_ENV], env[PASSWORD_ENV] = str(password_file), ""
        else:
            env[PASSWORD_ENV] = self.password
        if self.ca_file:
            env[CA_FILE_ENV] = self.ca_file
        return env


def read_password_file(path: Path) -> str:
    try:
        password = path.read_text().strip()
    except OSError as exc:
        raise CredentialsError(f"{PASSWORD_FILE_ENV}={path}: cannot read the password file ({exc})") from exc
    if not password:
        raise CredentialsError(f"{path}: the password file is empty")
    return password


def resolve(credentials: KafkaCredentials | None) -> KafkaCredentials | None:
    """`credentials` if given, else the environment's (None: an unsecured broker)."""
    return credentials if credentials is not None else KafkaCredentials.from_env()


def client_config(config: Mapping[str, Any], credentials: KafkaCredentials | None = None) -> dict[str, Any]:
    """`config` plus the SASL settings of `credentials` (else the environment's); unchanged
    when there are none. The principal's settings win: a caller cannot drop them by accident."""
    resolved = resolve(credentials)
    return {**config, **(resolved.librdkafka() if resolved is not None else {})}
