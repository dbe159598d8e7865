"""What the local broker listens on and how it is configured: free localhost ports and
``server.properties`` for one KRaft node that is both broker and controller, plain or
secured (SASL/SCRAM for clients, SASL/PLAIN for the controller listener, ACLs enforced;
see local_broker.py's module docstring for why)."""

from __future__ import annotations

import re
import socket
from pathlib import Path


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the JVM does
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that are free on 127.0.0.1 right now."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _jaas(module: str, user: str, password: str, **extra: str) -> str:
    options = {"username": user, "password": password, **extra}
    return f"{module} required " + " ".join(f'{k}="{v}"' for k, v in options.items()) + ";"


def security_properties(port: int, controller_port: int, broker_password: str) -> dict[str, str]:
    """SASL listeners, JAAS for the broker principal, and the authorizer (secured mode)."""
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    return {
        "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
        "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": "SASL_PLAINTEXT",
        "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-256",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.sasl_plaintext.sasl.enabled.mechanisms": "SCRAM-SHA-256",
        "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": _jaas(
            scram, "broker", broker_password
        ),
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": _jaas(
            plain, "broker", broker_password, user_broker=broker_password
        ),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": "User:broker",
        "allow.everyone.if.no.acl.found": "false",
    }


def server_properties(
    data_dir: Path, port: int, controller_port: int, broker_password: str | None = None
) -> str:
    """server.properties for one combined broker+controller node on 127.0.0.1; with
    `broker_password`, secured (SASL listeners and ACLs, see the module docstring)."""
    lines = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
        "controller.listener.names": "CONTROLLER",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir / "kafka-data"),
        "num.partitions": "1",
        # Topics are created explicitly (trainguard.kafka.topics); a typo must fail.
        "auto.create.topics.enable": "false",
        # One node: internal topics cannot have more than one replica.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # Fewer internal partitions (default 50): faster first group join, fewer files.
        "offsets.topic.num.partitions": "10",
        "transaction.state.log.num.partitions": "10",
        "group.initial.rebalance.delay.ms": "0",
        # Small thread pools: the machine also runs the tests and a faust worker.
        "num.network.threads": "2",
        "num.io.threads": "4",
        "background.threads": "4",
    }
    if broker_password is not None:
        lines.update(security_properties(port, controller_port, broker_password))
    return "".join(f"{key}={value}\n" for key, value in lines.items())


def read_ports(config: Path) -> tuple[int, int] | None:
    """(broker port, controller port) of an earlier server.properties, if any."""
    if not config.is_file():
        return None
    text = config.read_text()
    broker = re.search(r"PLAINTEXT://127\.0\.0\.1:(\d+)", text)
    controller = re.search(r"CONTROLLER://127\.0\.0\.1:(\d+)", text)
    if broker is None or controller is None:
        return None
    return int(broker.group(1)), int(controller.group(1))
