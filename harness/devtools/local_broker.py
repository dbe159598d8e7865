"""A real single-node Apache Kafka 4.x broker, built only from jars on Maven Central.

No Docker and no tarball: `ensure_jars` (broker_jars.py) asks Maven to copy the runtime classpath of
`kafka_2.13` (see `pom.xml` next to this file) into a cache directory, once. `LocalBroker`
then runs `kafka.Kafka` from those jars in KRaft combined mode (one JVM is both broker and
controller) on two free localhost ports, with its data, logs and a small state file
(`broker.json`) in one data directory, so that another process can find, query and stop it.

Layout of a data directory::

    server.properties   written on every start (ports reused when still free)
    kafka-data/         log.dirs: formatted once with a fresh cluster id
    server.log          log4j2 output (see log4j2.xml)
    broker.out          the JVM's stdout and stderr (crashes before logging starts)
    broker.json         pid, bootstrap and start time of the running broker
    credentials/        secured mode only (mode 0700): one password file per principal, 0600

Secured mode (`LocalBroker(data_dir, secure=True)`, `trainguard broker start --secure`):
clients connect with SASL/SCRAM-SHA-256 over SASL_PLAINTEXT and Kafka's StandardAuthorizer
allows only what an ACL grants (`allow.everyone.if.no.acl.found=false`; the principals and
ACLs are in trainguard/kafka/acl.py). The controller listener uses SASL/PLAIN with the
broker principal alone (in its JAAS config): KRaft cannot use SCRAM there, since SCRAM
credentials live in the metadata log the controller serves. The `broker` (super user) and
`admin` SCRAM users are written into the log when the storage is formatted (`--add-scram`,
passed in a 0600 argument file so that no password shows in the process list); the other
users and all ACLs are created through the admin API. server.properties holds the broker's
password, so it is written 0600 in this mode. The mode is the data dir's: it is fixed when
the storage is first formatted.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

import psutil

from trainguard.home import broker_credentials_dir, broker_data_dir
from trainguard.kafka.errors import BrokerError
from trainguard.kafka.security import KafkaCredentials

from .broker_config import free_ports, port_free, port_open, read_ports, server_properties
from .broker_jars import KAFKA_VERSION, ensure_jars, find_java

_HERE = Path(__file__).resolve().parent
LOG4J_CONFIG = _HERE / "log4j2.xml"
STATE_FILE = "broker.json"
_MAIN_CLASS = "kafka.Kafka"


# --------------------------------------------------------------------------- helpers


def new_cluster_id() -> str:
    """A random Kafka cluster id: 16 bytes, URL-safe base64 without padding (22 chars)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # as Kafka's Uuid.randomUuid: no leading dash
            return text


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, from the file's creation on."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _tail(path: Path, lines: int) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _is_broker_process(pid: int, config: Path) -> bool:
    """Whether pid is a live (not zombie) kafka.Kafka JVM for `config`: guards against pid reuse."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and str(config) in proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


# --------------------------------------------------------------------------- broker


@dataclass(frozen=True)
class BrokerStatus:
    """What `LocalBroker.status()` reports."""

    running: bool
    data_dir: Path
    pid: int | None = None
    bootstrap: str | None = None
    started_at: str | None = None


class LocalBroker:
    """One Kafka 4.x JVM in KRaft combined mode, owning `data_dir`.

    Use it as a context manager (start on enter, stop on exit), or call `start` and `stop`.
    The JVM runs in its own session, so it outlives this Python process; `from_state`
    reattaches to it from another process through `data_dir/broker.json`.
    """

    def __init__(self, data_dir: Path, heap: str = "512m", secure: bool | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.heap = heap
        #: SASL + ACLs (module docstring). None: as the data dir was formatted (plain if new).
        self.secure = (self.credentials_dir / "broker").is_file() if secure is None else secure
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._bootstrap: str | None = None
        self._started_at: str | None = None

    # -- paths and properties

    @property
    def config_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    @property
    def log_path(self) -> Path:
        """The broker's log4j2 log (server.log in data_dir)."""
        return self.data_dir / "server.log"

    @property
    def out_path(self) -> Path:
        """The JVM's stdout and stderr."""
        return self.data_dir / "broker.out"

    @property
    def credentials_dir(self) -> Path:
        """Secured mode: one password file per principal (mode 0600) in this directory."""
        return broker_credentials_dir(self.data_dir)

    def credentials(self, user: str) -> KafkaCredentials:
        """The SCRAM credentials of `user` from its password file (secured mode)."""
        return KafkaCredentials.from_file(user, self.credentials_dir / user)

    def admin_credentials(self) -> KafkaCredentials | None:
        """The `admin` principal in secured mode, else None (PLAINTEXT)."""
        return self.credentials("admin") if self.secure else None

    @property
    def bootstrap(self) -> str | None:
        """ "127.0.0.1:PORT" once started (or reattached), else None."""
        return self._bootstrap

    @property
    def pid(self) -> int | None:
        return self._pid

    # -- state file

    @classmethod
    def from_state(cls, data_dir: Path) -> LocalBroker:
        """Reattach to the broker recorded in `data_dir/broker.json` (running or not)."""
        broker = cls(data_dir)
        if not broker._load_state():
            raise BrokerError(f"no broker state in {broker.state_path}: was it started?")
        return broker

    def _load_state(self) -> bool:
        try:
            state = json.loads(self.state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        self._pid, self._bootstrap = int(state["pid"]), str(state["bootstrap"])
        self._started_at, self.heap = state.get("started_at"), state.get("heap", self.heap)
        self.secure = bool(state.get("secure", self.secure))
        return True

    def _write_state(self) -> None:
        state = {
            "pid": self._pid,
            "bootstrap": self._bootstrap,
            "started_at": self._started_at,
            "heap": self.heap,
            "secure": self.secure,
            "kafka": KAFKA_VERSION,
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(self.state_path)

    # -- lifecycle

    def is_running(self) -> bool:
        if self._proc is not None:  # our child: poll() also reaps it once it exited
            return self._proc.poll() is None
        return self._pid is not None and _is_broker_process(self._pid, self.config_path)

    def status(self) -> BrokerStatus:
        if self._pid is None:
            self._load_state()
        if not self.is_running():
            return BrokerStatus(running=False, data_dir=self.data_dir)
        return BrokerStatus(True, self.data_dir, self._pid, self._bootstrap, self._started_at)

    def start(self, timeout_s: float = 60) -> str:
        """Start the broker and wait until it serves metadata; return its bootstrap address.

        Formats the storage on first use. Reuses the previous ports when they are free, so
        the address survives a restart. Fails fast, with the end of the broker's log, if the
        JVM exits; kills it and fails if it is not ready within `timeout_s`.
        """
        if self.status().running:
            raise BrokerError(
                f"a broker already runs in {self.data_dir} at {self._bootstrap} (pid {self._pid})"
            )
        libs = ensure_jars()
        java = find_java()
        classpath = str(libs / "*")
        self.data_dir.mkdir(parents=True, exist_ok=True)

        ports = read_ports(self.config_path)
        if ports is not None and all(port_free(p) for p in ports):
            port, controller_port = ports
        else:
            port, controller_port = free_ports(2)
        formatted = (self.data_dir / "kafka-data" / "meta.properties").is_file()
        passwords = self._passwords(formatted)
        properties = server_properties(self.data_dir, port, controller_port, passwords.get("broker"))
        if self.secure:
            _write_private(self.config_path, properties)
        else:
            self.config_path.write_text(properties)

        if not formatted:
            self._format(java, classpath, passwords)

        cmd = [
            java,
            f"-Xmx{self.heap}",
            f"-Xms{self.heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.data_dir}",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp",
            classpath,
            _MAIN_CLASS,
            str(self.config_path),
        ]
        with self.out_path.open("ab") as out:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self._pid, self._bootstrap = self._proc.pid, f"127.0.0.1:{port}"
        self._started_at = datetime.now(UTC).isoformat(timespec="seconds")
        self._write_state()  # at once: a broker that is still starting can be stopped
        try:
            self._wait_ready(self._bootstrap, port, timeout_s)
            if self.secure:
                self._grant_admin(self._bootstrap)
        except BaseException:
            self.stop(timeout_s=10)
            raise
        return self._bootstrap

    def _passwords(self, formatted: bool) -> dict[str, str]:
        """Secured mode: the broker's and admin's passwords, generated on first use."""
        from trainguard.kafka.acl import ADMIN_USER, BROKER_USER, ensure_password

        broker_file = self.credentials_dir / BROKER_USER
        if not self.secure:
            if broker_file.is_file():
                raise BrokerError(
                    f"{self.data_dir} was formatted secured: start it with secure=True (--secure)"
                )
            return {}
        if formatted and not broker_file.is_file():
            raise BrokerError(
                f"{self.data_dir} was formatted without SASL; secured mode needs a fresh data directory"
            )
        return {user: ensure_password(self.credentials_dir, user) for user in (BROKER_USER, ADMIN_USER)}

    def _format(self, java: str, classpath: str, passwords: dict[str, str]) -> None:
        """Format the storage once, with the SCRAM users of `passwords` in its first metadata."""
        args = ["-cp", classpath, "kafka.tools.StorageTool", "format", "-t", new_cluster_id()]
        args += ["-c", str(self.config_path), "--standalone"]
        for user, password in passwords.items():
            args += ["--add-scram", f"SCRAM-SHA-256=[name={user},password={password}]"]
        # The java launcher reads `@file` as more arguments: the passwords stay out of `ps`.
        argfile = self.data_dir / ".format.args"
        _write_private(argfile, "\n".join(f'"{arg}"' for arg in args) + "\n")
        try:
            fmt = subprocess.run([java, f"@{argfile}"], capture_output=True, text=True, timeout=120)
        finally:
            argfile.unlink(missing_ok=True)
        if fmt.returncode != 0:
            raise BrokerError(f"formatting {self.data_dir / 'kafka-data'} failed:\n{fmt.stdout}{fmt.stderr}")

    def _grant_admin(self, bootstrap: str) -> None:
        """The admin principal's ACLs, created by the super user (idempotent, every start)."""
        from trainguard.kafka.acl import BROKER_USER, admin_grants, create_grants

        create_grants(bootstrap, self.credentials(BROKER_USER), admin_grants())

    def _wait_ready(self, bootstrap: str, port: int, timeout_s: float) -> None:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        admin: AdminClient | None = None
        while True:
            if not self.is_running():
                raise BrokerError(
                    f"the Kafka broker exited during start-up; last lines of "
                    f"{self.log_path}:\n{self._log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerError(
                    f"the Kafka broker was not ready after {timeout_s:g} s; last "
                    f"lines of {self.log_path}:\n{self._log_tail()}"
                )
            if port_open(port):  # before that, librdkafka would only log refused connects
                if admin is None:
                    config: dict[str, str | int | float | bool] = {
                        "bootstrap.servers": bootstrap,
                        "log_level": 4,
                    }
                    if self.secure:  # the super user: no ACL exists yet on a new data dir
                        config.update(self.credentials("broker").librdkafka())
                    admin = AdminClient(config)  # log_level: see topics._admin
                try:
                    if admin.list_topics(timeout=min(2.0, remaining)).brokers:
                        return
                except KafkaException:
                    pass
            time.sleep(0.1)

    def _log_tail(self) -> str:
        text = _tail(self.log_path, 40)
        out = _tail(self.out_path, 15)
        return text + (f"\n--- {self.out_path.name}:\n{out}" if out else "")

    def stop(self, timeout_s: float = 30) -> bool:
        """SIGTERM (controlled shutdown), SIGKILL after `timeout_s`; True if it was running.

        Idempotent: stopping a stopped broker just clears its state file.
        """
        if self._pid is None:
            self._load_state()
        was_running = self.is_running()
        if was_running and self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGTERM)
            if not self._wait_exit(timeout_s):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pid, signal.SIGKILL)
                if not self._wait_exit(10):
                    raise BrokerError(f"broker pid {self._pid} survived SIGKILL")
        self.state_path.unlink(missing_ok=True)
        self._proc = None
        return was_running

    def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.is_running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalBroker({str(self.data_dir)!r}, bootstrap={self._bootstrap!r})"


# --------------------------------------------------------------------------- CLI helpers


def default_data_dir() -> Path:
    """`$TRAINGUARD_HOME/broker`, else `<cwd>/.trainguard/broker`."""
    return broker_data_dir()


def start_local_broker(data_dir: Path | None = None, secure: bool | None = None) -> LocalBroker:
    """Fetch jars if needed, start the broker (or reattach to a running one), ensure topics;
    secured, also the processor's and archive writer's users and ACLs (trainguard/kafka/acl.py)."""
    from trainguard.kafka.topics import ensure_topics

    broker = LocalBroker(data_dir or default_data_dir(), secure=secure)
    status = broker.status()
    bootstrap = status.bootstrap if status.running and status.bootstrap else broker.start()
    admin = broker.admin_credentials()
    ensure_topics(bootstrap, credentials=admin)
    if admin is not None:
        from trainguard.kafka.acl import provision_services

        provision_services(bootstrap, admin, broker.credentials_dir)
    return broker


def stop_local_broker(data_dir: Path | None = None) -> bool:
    """Stop the broker of `data_dir`; True if one was running."""
    return LocalBroker(data_dir or default_data_dir()).stop()


def local_broker_status(data_dir: Path | None = None) -> BrokerStatus:
    """Whether a broker runs in `data_dir`, and where."""
    return LocalBroker(data_dir or default_data_dir()).status()
