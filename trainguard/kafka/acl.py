"""Who may do what on a secured broker: the principals of trainguard and their ACLs.

The local broker's secured mode (`LocalBroker(secure=True)`, `trainguard broker start
--secure`) authenticates every connection with SASL/SCRAM-SHA-256 and authorizes it with
Kafka's StandardAuthorizer, `allow.everyone.if.no.acl.found=false`: a principal may do
only what an ACL below grants. Principals (SCRAM users, stored salted in the metadata log):

==========  ==============================================================================
broker      the super user: the broker's own inter-broker and controller connections only
admin       the operator: creates topics, users and ACLs, reads anything (tools, tests);
            its ACLs are created once by the broker principal when the data dir is new
processor   reads and writes telemetry (ticks, forwards), events, commands, dead letters
            and snapshots (it reads its outputs back when it recovers a partition); creates
            and writes the per-run command topics; its groups `{prefix}trainguard-processor*`
            and `trainguard-recovery-*`
archive     reads every topic of its prefix; its group `{prefix}trainguard.archive`
rank-<run>  one per run (`trainguard broker grant-run`): writes telemetry and acks, reads
            ONLY its run's command topic, its actuators' groups `trainguard-actuator.<run>.*`
==========  ==============================================================================

Why a topic per run: an ACL names topics and groups, never record keys, and every run's
commands share `trainguard.commands` keyed by run_id, so any reader of that topic reads
every run's commands. Processors therefore deliver each command a second time on
`{prefix}trainguard.commands.run.<run>` (topics.run_commands_topic), the only commands
topic a rank principal can read; the shared topic stays the complete audit log that the
archive, the oracle and the API read. This happens in secured mode only (a client with
credentials): on a PLAINTEXT broker nobody could be kept from the shared topic anyway.

ACLs stop a principal from reading or writing what is not its own; they do not stop a
principal allowed to write commands (or its stolen password) from writing a forged one.
That is the HMAC's job: the rank actuator verifies each command with the run key and
refuses and counts what fails (producers/rank/actuator.py). Telemetry and acks are not
signed: a rank principal can write telemetry or acks naming another run (an ACL cannot
check a key), which costs that run detections, not commands.

No password is in the repository: the local broker generates them and keeps one file per
principal, mode 0600, in `<data dir>/credentials/` (mode 0700); clients read theirs from
TRAINGUARD_KAFKA_PASSWORD_FILE (trainguard/kafka/security.py).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)

from .errors import BrokerError
from .security import KafkaCredentials, client_config
from .topics import (
    TopicNames,
    actuator_group_prefix,
    delete_topics,
    ensure_run_commands_topic,
    run_token,
    topic_names,
)

BROKER_USER = "broker"
ADMIN_USER = "admin"
PROCESSOR_USER = "processor"
ARCHIVE_USER = "archive"
#: The processor's faust app id (its consumer group), without prefix.
PROCESSOR_APP = "trainguard-processor"
SCRAM_ITERATIONS = 8192
_CLUSTER = "kafka-cluster"

Op = AclOperation


def rank_user(run_id: str) -> str:
    """The principal of one run's ranks, launcher and actuators."""
    return f"rank-{run_token(run_id)}"


@dataclass(frozen=True)
class Grant:
    """ALLOW `operations` on one resource (or resource prefix) to `user`, from any host."""

    user: str
    resource: ResourceType
    name: str
    operations: tuple[AclOperation, ...]
    prefixed: bool = False

    def bindings(self) -> list[AclBinding]:
        pattern = ResourcePatternType.PREFIXED if self.prefixed else ResourcePatternType.LITERAL
        return [
            AclBinding(
                self.resource, self.name, pattern, f"User:{self.user}", "*", op, AclPermissionType.ALLOW
            )
            for op in self.operations
        ]


def _topic(user: str, name: str, *ops: AclOperation, prefixed: bool = False) -> Grant:
    return Grant(user, ResourceType.TOPIC, name, ops, prefixed)


def _group(user: str, name: str, *ops: AclOperation, prefixed: bool = False) -> Grant:
    return Grant(user, ResourceType.GROUP, name, ops, prefixed)


def admin_grants() -> list[Grant]:
    """The operator: topics, users (ALTER on the cluster) and ACLs; any topic or group."""
    cluster_ops = (Op.ALTER, Op.DESCRIBE, Op.CREATE, Op.DESCRIBE_CONFIGS, Op.ALTER_CONFIGS)
    return [
        Grant(ADMIN_USER, ResourceType.BROKER, _CLUSTER, cluster_ops),
        _topic(ADMIN_USER, "*", Op.ALL),
        _group(ADMIN_USER, "*", Op.ALL),
    ]


def service_grants(names: TopicNames) -> list[Grant]:
    """The processor's and the archive writer's ACLs for one topic prefix."""
    prefix = names.telemetry.removesuffix("trainguard.telemetry")
    processor_app = prefix + PROCESSOR_APP
    return [
        # Reads its outputs too: a worker taking a partition over recovers what was published
        # (processors/recovery.py), with a throwaway group that never commits.
        *(
            _topic(PROCESSOR_USER, t, Op.READ, Op.WRITE)
            for t in (names.telemetry, names.snapshots, names.events, names.commands, names.deadletter)
        ),
        _group(PROCESSOR_USER, "trainguard-recovery-", Op.READ, prefixed=True),
        _topic(PROCESSOR_USER, names.commands + ".run.", Op.WRITE, Op.CREATE, prefixed=True),
        # faust subscribes to its leader topic `<app id>-__assignor-__leader` (never created,
        # topic_allow_declare=False); without DESCRIBE the subscription fails authorization.
        _topic(PROCESSOR_USER, processor_app, Op.DESCRIBE, prefixed=True),
        _group(PROCESSOR_USER, processor_app, Op.READ, prefixed=True),
        # What the archive stores (sinks/archive.py archived_topics): not the run registry,
        # not the processors' snapshots.
        *(
            _topic(ARCHIVE_USER, t, Op.READ)
            for t in (names.telemetry, names.events, names.commands, names.acks, names.deadletter)
        ),
        _group(ARCHIVE_USER, prefix + "trainguard.archive", Op.READ),
    ]


def run_grants(names: TopicNames, run_id: str) -> list[Grant]:
    """One run's rank principal: telemetry and acks in, its own commands out."""
    user = rank_user(run_id)
    return [
        _topic(user, names.telemetry, Op.WRITE),
        _topic(user, names.acks, Op.WRITE),
        _topic(user, names.run_commands(run_id), Op.READ),
        _group(user, actuator_group_prefix(run_id), Op.READ, prefixed=True),
    ]


# --------------------------------------------------------------------------- admin calls


def _admin(bootstrap: str, credentials: KafkaCredentials) -> AdminClient:
    return AdminClient(client_config({"bootstrap.servers": bootstrap, "log_level": 4}, credentials))


def create_grants(
    bootstrap: str, credentials: KafkaCredentials, grants: list[Grant], timeout_s: float = 30
) -> None:
    """Create the ACLs of `grants` (idempotent: an existing ACL is left as it is)."""
    bindings = [b for grant in grants for b in grant.bindings()]
    if not bindings:
        return
    admin = _admin(bootstrap, credentials)  # held until the results: a destroyed client fails them
    futures = admin.create_acls(bindings, request_timeout=timeout_s)
    for binding, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            raise BrokerError(f"cannot create ACL {binding}: {exc}") from exc


def delete_grants(
    bootstrap: str, credentials: KafkaCredentials, grants: list[Grant], timeout_s: float = 30
) -> None:
    """Delete exactly the ACLs of `grants` (missing ones are ignored)."""
    filters = [
        AclBindingFilter(
            b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation, b.permission_type
        )
        for grant in grants
        for b in grant.bindings()
    ]
    if not filters:
        return
    admin = _admin(bootstrap, credentials)
    for acl_filter, future in admin.delete_acls(filters, request_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            raise BrokerError(f"cannot delete ACL {acl_filter}: {exc}") from exc


def upsert_user(
    bootstrap: str, credentials: KafkaCredentials, user: str, password: str, timeout_s: float = 30
) -> None:
    """Create the SCRAM-SHA-256 user `user`, or set its password."""
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, SCRAM_ITERATIONS)
    upsert = UserScramCredentialUpsertion(user, info, password.encode())
    admin = _admin(bootstrap, credentials)
    for name, future in admin.alter_user_scram_credentials([upsert]).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            raise BrokerError(f"cannot create SCRAM user {name}: {exc}") from exc


def disable_user(bootstrap: str, credentials: KafkaCredentials, user: str, timeout_s: float = 30) -> None:
    """Set `user`'s password to a random one that nobody keeps: its logins fail from then on.

    Preferred to delete_user: with Kafka 4.1.1 in KRaft combined mode, once the metadata log
    holds a credential deletion, a restarted broker refuses every SCRAM login, the super
    user's included (seen while building this; test_security_broker.py's restart test
    guards the workaround)."""
    upsert_user(bootstrap, credentials, user, new_password(), timeout_s)


def delete_user(bootstrap: str, credentials: KafkaCredentials, user: str, timeout_s: float = 30) -> None:
    """Remove the SCRAM-SHA-256 credential of `user`. Beware: see disable_user."""
    deletion = UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_256)
    admin = _admin(bootstrap, credentials)
    for name, future in admin.alter_user_scram_credentials([deletion]).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if "RESOURCE_NOT_FOUND" not in str(exc):
                raise BrokerError(f"cannot delete SCRAM user {name}: {exc}") from exc


def wait_login(bootstrap: str, credentials: KafkaCredentials, timeout_s: float = 30) -> None:
    """Return once `credentials` can log in: a broker learns new SCRAM credentials from the
    metadata log a moment after the controller accepted them."""
    deadline = time.monotonic() + timeout_s
    admin = _admin(bootstrap, credentials)
    while True:
        try:
            admin.list_topics(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except KafkaException as exc:
            if time.monotonic() >= deadline:
                raise BrokerError(f"{credentials.username} cannot log in to {bootstrap}: {exc}") from exc
            time.sleep(0.1)


# --------------------------------------------------------------------------- password files


def new_password() -> str:
    return secrets.token_urlsafe(32)


def password_file(credentials_dir: Path, user: str) -> Path:
    return credentials_dir / user


def write_password(credentials_dir: Path, user: str, password: str) -> Path:
    """Write `password` to `credentials_dir/user`, mode 0600 from its creation (dir 0700)."""
    credentials_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(credentials_dir, 0o700)
    path = password_file(credentials_dir, user)
    tmp = path.with_name(f".{user}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    os.replace(tmp, path)
    return path


def ensure_password(credentials_dir: Path, user: str) -> str:
    """The password in `credentials_dir/user`, generated (and written) if there is none."""
    path = password_file(credentials_dir, user)
    if path.is_file():
        return path.read_text().strip()
    password = new_password()
    write_password(credentials_dir, user, password)
    return password


# --------------------------------------------------------------------------- provisioning


def provision_services(
    bootstrap: str, admin: KafkaCredentials, credentials_dir: Path, prefix: str = ""
) -> dict[str, Path]:
    """Users `processor` and `archive` (passwords kept in their files) and their ACLs for
    `prefix`; returns each user's password file. Idempotent."""
    files = {}
    for user in (PROCESSOR_USER, ARCHIVE_USER):
        upsert_user(bootstrap, admin, user, ensure_password(credentials_dir, user))
        files[user] = password_file(credentials_dir, user)
    create_grants(bootstrap, admin, service_grants(topic_names(prefix)))
    for user, path in files.items():
        wait_login(bootstrap, KafkaCredentials.from_file(user, path))
    return files


def provision_run(
    bootstrap: str, admin: KafkaCredentials, credentials_dir: Path, run_id: str, prefix: str = ""
) -> tuple[str, Path]:
    """One run's rank principal (password in its file), its command topic and its ACLs.
    Call it before the run's actuators start: they begin at the topic's end. Idempotent."""
    names = topic_names(prefix)
    user = rank_user(run_id)
    upsert_user(bootstrap, admin, user, ensure_password(credentials_dir, user))
    ensure_run_commands_topic(bootstrap, names.run_commands(run_id), credentials=admin)
    create_grants(bootstrap, admin, run_grants(names, run_id))
    wait_login(bootstrap, KafkaCredentials.from_file(user, password_file(credentials_dir, user)))
    return user, password_file(credentials_dir, user)


def revoke_run(
    bootstrap: str,
    admin: KafkaCredentials,
    credentials_dir: Path,
    run_id: str,
    prefix: str = "",
    delete_topic: bool = True,
) -> None:
    """Undo provision_run: ACLs, password file and (by default) the topic; the SCRAM user is
    disabled (disable_user says why it is not deleted)."""
    names = topic_names(prefix)
    user = rank_user(run_id)
    delete_grants(bootstrap, admin, run_grants(names, run_id))
    disable_user(bootstrap, admin, user)
    password_file(credentials_dir, user).unlink(missing_ok=True)
    if delete_topic:
        delete_topics(bootstrap, [names.run_commands(run_id)], credentials=admin)
