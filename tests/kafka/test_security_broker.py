"""Issue 7, scenario 8: a secured local broker (SASL/SCRAM-SHA-256, StandardAuthorizer,
no ACL means no access) of this module's own, in a temporary directory.

Unauthenticated clients and wrong passwords are refused. A run's rank principal writes
telemetry and acks and reads its own run's commands only; it may not read another run's
commands, the shared commands topic, or write any commands; the processor principal may.
End to end, a real processor (its own process) and a real actuator, each under its own
principal, deliver a signed command; a forged, a tampered and a replayed command, written
by a principal the ACLs allow (admin), are still refused or not re-run, and counted."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from harness.devtools.broker_jars import ensure_jars
from harness.devtools.local_broker import BrokerError, LocalBroker, start_local_broker
from harness.devtools.stack import builtin_policy, start_processor
from harness.scoring.oracle import check
from harness.streams import Job
from trainguard.kafka.acl import PROCESSOR_USER, provision_run, revoke_run, wait_login
from trainguard.kafka.security import KafkaCredentials
from trainguard.kafka.topics import TopicNames, actuator_group_prefix, topic_names
from trainguard.processors.core.policy import load_policy
from trainguard.producers.rank.actuator import Actuator
from trainguard.producers.rank.gate import RefuseReason
from trainguard.replay.log import read_recording
from trainguard.schemas import Abort, Ack, AckStatus, Command, auth, decode, encode, encode_batch
from trainguard.schemas.codec import ACKS, COMMANDS

from ..pipeline import free_port
from ..readers import TopicReader

pytestmark = pytest.mark.broker

SECRET = b"security-test-secret-0123456789abcdef"
RUN_A, RUN_B = "run-a", "run-b"


@dataclass(frozen=True)
class Secured:
    broker: LocalBroker
    bootstrap: str
    names: TopicNames
    admin: KafkaCredentials
    processor: KafkaCredentials
    rank_a: KafkaCredentials
    rank_b: KafkaCredentials


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    ensure_jars()
    broker = start_local_broker(tmp_path_factory.mktemp("secured-kafka"), secure=True)
    try:
        bootstrap = broker.bootstrap
        assert bootstrap is not None
        admin = broker.admin_credentials()
        assert admin is not None
        ranks = [
            KafkaCredentials.from_file(*provision_run(bootstrap, admin, broker.credentials_dir, run))
            for run in (RUN_A, RUN_B)
        ]
        yield Secured(
            broker, bootstrap, topic_names(), admin, broker.credentials(PROCESSOR_USER), ranks[0], ranks[1]
        )
    finally:
        broker.stop()


def _config(secured: Secured, credentials: KafkaCredentials | None, **extra: Any) -> dict[str, Any]:
    config = {"bootstrap.servers": secured.bootstrap, "log_level": 0, **extra}
    return {**config, **(credentials.librdkafka() if credentials is not None else {})}


def produce(
    secured: Secured, credentials: KafkaCredentials, topic: str, value: bytes = b"x", key: bytes = b"k"
) -> KafkaError | None:
    """Produce one record as `credentials`; the delivery error (None: delivered)."""
    producer = Producer(_config(secured, credentials, **{"message.timeout.ms": 10_000}))
    errors: list[KafkaError | None] = []
    producer.produce(topic, value, key=key, on_delivery=lambda err, _msg: errors.append(err))
    producer.flush(15)
    assert len(errors) == 1
    return errors[0]


def consume(secured: Secured, credentials: KafkaCredentials, topic: str, group: str) -> bytes | KafkaError:
    """The first record of `topic` read as `credentials`, or the error the consumer got."""
    consumer = Consumer(_config(secured, credentials, **{"group.id": group, "auto.offset.reset": "earliest"}))
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                return msg.error() or msg.value() or b""
        raise AssertionError(f"nothing from {topic} in 15 s")
    finally:
        consumer.close()


def code(result: object) -> int | None:
    return result.code() if isinstance(result, KafkaError) else None


def test_unauthenticated_clients_and_wrong_passwords_are_refused(secured: Secured) -> None:
    for credentials in (None, KafkaCredentials(secured.rank_a.username, "wrong-password")):
        errors: list[KafkaError] = []
        admin = AdminClient(_config(secured, credentials, error_cb=errors.append))
        with pytest.raises(KafkaException):
            admin.list_topics(timeout=4)
        if credentials is not None:  # SASL says why; a PLAINTEXT client only sees its connection dropped
            admin.poll(1)  # serves error_cb
            assert KafkaError._AUTHENTICATION in {e.code() for e in errors}, errors


def test_a_rank_principal_writes_telemetry_and_acks_and_reads_only_its_runs_commands(
    secured: Secured,
) -> None:
    names, rank = secured.names, secured.rank_a
    own, other = names.run_commands(RUN_A), names.run_commands(RUN_B)
    assert produce(secured, rank, names.telemetry) is None
    assert produce(secured, rank, names.acks) is None
    for topic in (names.commands, own, other):  # no commands from a rank, not even its own run's
        assert code(produce(secured, rank, topic)) == KafkaError.TOPIC_AUTHORIZATION_FAILED, topic
    # Only the processor (and the operator) writes commands (on the shared topic: the next test).
    assert produce(secured, secured.processor, own, b"for run-a") is None

    group = actuator_group_prefix(RUN_A) + "acl-test"
    assert consume(secured, rank, own, group) == b"for run-a"
    for topic in (other, names.commands):  # another run's commands, and the shared log of all runs
        assert code(consume(secured, rank, topic, group)) == KafkaError.TOPIC_AUTHORIZATION_FAILED, topic
    # Nor can it join another run's actuator groups (it could steal their partition).
    denied = consume(secured, rank, own, actuator_group_prefix(RUN_B) + "acl-test")
    assert code(denied) == KafkaError.GROUP_AUTHORIZATION_FAILED
    assert code(produce(secured, secured.rank_b, names.telemetry)) is None


def _until(what: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_processor_and_actuator_deliver_signed_commands_and_forgeries_are_refused(
    secured: Secured, tmp_path: Path
) -> None:
    names, key = secured.names, auth.run_key(SECRET, RUN_A)
    executed: list[tuple[str, int]] = []
    actuator = Actuator(
        secured.bootstrap, names.commands, names.acks, RUN_A, 0, range(4), key, credentials=secured.rank_a
    )
    assert actuator.commands_topic == names.run_commands(RUN_A)
    actuator.register(Abort, lambda command, rank: executed.append((command.command_id, rank)) and None)
    actuator.start()
    env = {
        "TRAINGUARD_SECRET": SECRET.decode(),
        **secured.processor.env(secured.broker.credentials_dir / PROCESSOR_USER),
    }
    log = tmp_path / "processor.log"
    processor, _ = start_processor(secured.bootstrap, builtin_policy("demo"), free_port(), log, env)
    acks = TopicReader(secured.bootstrap, names.acks, secured.admin)
    audit = TopicReader(secured.bootstrap, names.commands, secured.admin)
    try:
        assert actuator.wait_ready(30)
        # The ranks report under their own principal; rank 1 crashes.
        job = Job(run_id=RUN_A, world_size=4, ranks_per_node=2).start().steps(8).exit(1, signal=9)
        header = dict(run_id=RUN_A, node="node-000", world_size=4, producer_id="sec", seq=0)
        batch = encode_batch(header, [encode(e) for e in job.events])
        assert produce(secured, secured.rank_a, names.telemetry, batch, key=RUN_A.encode()) is None

        def our_acks() -> list[Ack]:  # (the ACL test wrote a non-ack there)
            decoded = [decode(s.value, ACKS) for s in acks.seen if s.value.startswith(b"{")]
            return [a for a in decoded if isinstance(a, Ack) and a.command_kind == "abort"]

        acks.until(lambda _: len(our_acks()) >= 4)
        assert sorted((a.rank, a.status) for a in our_acks()) == [(r, AckStatus.EXECUTED) for r in range(4)]
        # The audit log (shared topic) holds the same signed command.
        seen = audit.until(lambda s: any(b'"schema":"abort/' in x.value for x in s))
        (raw,) = [x.value for x in seen if b'"schema":"abort/' in x.value]
        command = decode(raw, COMMANDS)
        assert isinstance(command, Abort) and auth.verify(command, key)

        # Written by the operator, whom the ACLs allow: the HMAC still refuses the forged and
        # the tampered command, and the replayed one is acknowledged, not run again.
        forged = auth.sign(command.model_copy(update={"command_id": "forged"}), b"k" * 32)
        tampered: Command = command.model_copy(update={"command_id": "tampered", "ranks": [0]})
        for value in (encode(forged), encode(tampered), raw):
            assert produce(secured, secured.admin, names.run_commands(RUN_A), value) is None
        acks.until(lambda _: len(our_acks()) >= 10)
        later = sorted((a.command_id, a.status.value) for a in our_acks()[4:])
        assert later == sorted(
            [(command.command_id, "duplicate")] * 4 + [("forged", "refused"), ("tampered", "refused")]
        )
        assert actuator.counters.refused == {RefuseReason.BAD_SIGNATURE: 2}
        assert actuator.counters.duplicate == 4
        assert sorted(executed) == [(command.command_id, r) for r in range(4)]
        assert processor.poll() is None, log.read_text()[-3000:]
        # The oracle, read back as the operator: nothing the rank wrote is lost, the live
        # decisions are the replay's, and no command ran twice on a rank.
        recording = read_recording(secured.bootstrap, names, RUN_A, credentials=secured.admin)
        report = check(recording, load_policy(builtin_policy("demo")),
                       acknowledged={e.event_id for e in job.events}, acks=our_acks())  # fmt: skip
        assert report.ok, str(report)
    finally:
        actuator.stop()
        acks.close()
        audit.close()
        processor.terminate()
        try:
            processor.wait(30)
        except subprocess.TimeoutExpired:
            processor.kill()


def test_secured_mode_is_the_data_dirs(secured: Secured) -> None:
    """Passwords are in 0600 files of a 0700 directory; a secured dir never starts open."""
    credentials_dir = secured.broker.credentials_dir
    assert os.stat(credentials_dir).st_mode & 0o777 == 0o700
    for path in credentials_dir.iterdir():
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    assert os.stat(secured.broker.config_path).st_mode & 0o777 == 0o600
    assert LocalBroker(secured.broker.data_dir).secure


def test_a_revoked_run_cannot_log_in_and_a_restart_keeps_everyone_elses_logins(secured: Secured) -> None:
    """Runs last: it restarts the module's broker. Kafka 4.1.1 can lose every SCRAM login on
    a restart once a credential was deleted (for a deleted user "rank-x" it does, for
    "rank-y" not), so revoke_run disables the user instead; run "x" is the case that broke."""
    broker, admin = secured.broker, secured.admin
    provision_run(secured.bootstrap, admin, broker.credentials_dir, "x")
    for run in ("x", RUN_B):
        revoke_run(secured.bootstrap, admin, broker.credentials_dir, run)
    assert not (broker.credentials_dir / secured.rank_b.username).exists()
    broker.stop()
    assert broker.start() == secured.bootstrap
    for credentials in (admin, secured.processor, secured.rank_a):
        wait_login(secured.bootstrap, credentials, timeout_s=10)
    with pytest.raises(BrokerError, match="cannot log in"):
        wait_login(secured.bootstrap, secured.rank_b, timeout_s=3)
