"""Actuator on a real broker: at-least-once delivery in, at-most-once execution out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from trainguard.kafka.topics import TopicNames
from trainguard.producers.command_roles import Role, kinds_of
from trainguard.producers.rank.actuator import Actuator
from trainguard.producers.rank.gate import RefuseReason
from trainguard.schemas import (
    RUN_LEVEL_RANK,
    Ack,
    AckStatus,
    CheckpointNow,
    Command,
    QuarantineNode,
    Reason,
    ReasonCode,
    SkipUpdate,
    auth,
    decode,
    encode,
)
from trainguard.schemas.codec import ACKS

from ...readers import TopicReader

pytestmark = pytest.mark.broker

SECRET = b"m" * 32


class AckReader(TopicReader):
    """The acks topic from its beginning; each `take` returns only the acks new since the last."""

    def take(self, n: int, timeout_s: float = 30.0, settle_s: float = 1.0) -> list[Ack]:
        """`n` new acks, then `settle_s` more of listening so that extras would be seen."""
        start = len(self.seen)
        self.until(lambda seen: len(seen) - start >= n, timeout_s)
        self.settle(settle_s)
        acks = [decode(s.value, ACKS) for s in self.seen[start:]]
        assert all(isinstance(a, Ack) for a in acks)
        return acks  # type: ignore[return-value]


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def acks(bootstrap: str, topics: TopicNames) -> Iterator[AckReader]:
    reader = AckReader(bootstrap, topics.acks)
    yield reader
    reader.close()


def checkpoint_now(run_id: str, command_id: str, attempt: int = 0, ranks: list[int] | None = None) -> Command:
    return CheckpointNow(
        command_id=command_id,
        run_id=run_id,
        attempt=attempt,
        ranks=ranks,
        issued_ts=1.0,
        reason=Reason(code=ReasonCode.OPERATOR, text="integration test"),
    )


def send(bootstrap: str, topic: str, run_id: str, *values: bytes) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for value in values:
        producer.produce(topic, key=run_id.encode(), value=value)
    assert producer.flush(30) == 0


def recorder(ran: list[tuple[str, int]], detail: str | None = None) -> Callable[[Command, int], str | None]:
    """A handler that records (command_id, rank) and answers `detail`."""

    def handler(command: Command, rank: int) -> str | None:
        ran.append((command.command_id, rank))
        return detail

    return handler


def make_actuator(
    bootstrap: str,
    topics: TopicNames,
    run_id: str,
    journal: Path,
    instance: str = "node-a",
    start_ts: float | None = None,
) -> Actuator:
    actuator = Actuator(
        bootstrap,
        topics.commands,
        topics.acks,
        run_id,
        attempt=0,
        local_ranks=[0, 1],
        key=auth.run_key(SECRET, run_id),
        node="node-a",
        instance=instance,
        journal_path=journal,
        start_ts=start_ts,
    )
    return actuator


def test_redelivered_command_runs_once_and_is_acked_twice(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    ran: list[tuple[str, int]] = []
    actuator = make_actuator(bootstrap, topics, run_id, tmp_path / "journal")
    actuator.register(CheckpointNow, recorder(ran, "flag set"))
    with actuator:
        assert actuator.wait_ready(30)
        raw = encode(auth.sign(checkpoint_now(run_id, "ckpt-1", ranks=[1]), auth.run_key(SECRET, run_id)))
        send(bootstrap, topics.commands, run_id, raw, raw)  # at-least-once: the same record twice
        got = acks.take(2)
    assert ran == [("ckpt-1", 1)]
    assert sorted((a.status, a.rank) for a in got) == [(AckStatus.DUPLICATE, 1), (AckStatus.EXECUTED, 1)]
    executed = next(a for a in got if a.status is AckStatus.EXECUTED)
    assert (executed.command_id, executed.command_kind, executed.run_id) == (
        "ckpt-1",
        "checkpoint_now",
        run_id,
    )
    assert (executed.node, executed.detail) == ("node-a", "flag set")
    assert (actuator.counters.executed, actuator.counters.duplicate) == (1, 1)
    assert actuator.stats.acks_delivered == 2


def test_forged_and_tampered_commands_are_refused(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    ran: list[tuple[str, int]] = []
    actuator = make_actuator(bootstrap, topics, run_id, tmp_path / "journal")
    actuator.register(CheckpointNow, recorder(ran))
    key = auth.run_key(SECRET, run_id)
    forged = auth.sign(checkpoint_now(run_id, "forged-1"), auth.run_key(b"attacker" * 4, run_id))
    tampered = auth.sign(checkpoint_now(run_id, "tampered-1", ranks=[7]), key).model_copy(
        update={"ranks": [0, 1]}
    )
    with actuator:
        assert actuator.wait_ready(30)
        send(bootstrap, topics.commands, run_id, encode(forged), encode(tampered))
        got = acks.take(2)
    assert ran == []
    assert sorted(a.command_id for a in got) == ["forged-1", "tampered-1"]
    for ack in got:
        assert (ack.status, ack.rank) == (AckStatus.REFUSED, RUN_LEVEL_RANK)
        assert ack.detail.startswith("bad_signature")
    assert actuator.counters.refused == {RefuseReason.BAD_SIGNATURE: 2}
    assert actuator.counters.executed == 0


def test_failures_stale_attempts_and_a_restart(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    key = auth.run_key(SECRET, run_id)
    ran: list[tuple[str, int]] = []

    def boom(cmd: SkipUpdate, rank: int) -> str:
        raise RuntimeError(f"cannot skip step {cmd.step}")

    first = make_actuator(bootstrap, topics, run_id, tmp_path / "journal")
    first.register(CheckpointNow, recorder(ran))
    first.register(SkipUpdate, boom)
    skip = SkipUpdate(
        command_id="skip-1", run_id=run_id, attempt=0, ranks=[0], issued_ts=1.0, step=5,
        reason=Reason(code=ReasonCode.OPERATOR, text="t"),
    )  # fmt: skip
    ckpt = encode(auth.sign(checkpoint_now(run_id, "ckpt-1", ranks=[0]), key))
    with first:
        assert first.wait_ready(30)
        send(bootstrap, topics.commands, run_id, encode(auth.sign(skip, key)), ckpt)
        got = acks.take(2)
    assert sorted((a.command_id, a.status) for a in got) == [
        ("ckpt-1", AckStatus.EXECUTED),
        ("skip-1", AckStatus.FAILED),
    ]
    assert "cannot skip step 5" in next(a.detail for a in got if a.status is AckStatus.FAILED)
    assert first.stats.failed == 1

    # While the actuator is down, a restarted processor re-makes a decision: same command id.
    send(bootstrap, topics.commands, run_id, ckpt)
    second = make_actuator(bootstrap, topics, run_id, tmp_path / "journal")  # same group, same journal
    second.register(CheckpointNow, recorder(ran))
    with second:
        assert second.wait_ready(30)
        # Resumed from the committed offset: only the re-sent command is read, a duplicate.
        got = acks.take(1)
        assert [(a.command_id, a.status) for a in got] == [("ckpt-1", AckStatus.DUPLICATE)]
        second.set_attempt(1)  # the job restarted as attempt 1
        stale = encode(auth.sign(checkpoint_now(run_id, "ckpt-2", attempt=0), key))
        fresh = encode(auth.sign(checkpoint_now(run_id, "ckpt-3", attempt=1, ranks=[1]), key))
        send(bootstrap, topics.commands, run_id, stale, fresh)
        got = acks.take(2)
        assert second.running and second.error is None
    assert sorted((a.command_id, a.status, a.attempt) for a in got) == [
        ("ckpt-2", AckStatus.REFUSED, 0),
        ("ckpt-3", AckStatus.EXECUTED, 1),
    ]
    assert ran == [("ckpt-1", 0), ("ckpt-3", 1)]
    assert second.counters.refused == {RefuseReason.STALE_ATTEMPT: 1}


def test_a_new_actuator_starts_at_the_end(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    """Commands already on the topic were meant for earlier processes: a new group skips them."""
    key = auth.run_key(SECRET, run_id)
    send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "old"), key)))
    ran: list[tuple[str, int]] = []
    actuator = make_actuator(bootstrap, topics, run_id, tmp_path / "journal", instance="fresh")
    actuator.register(CheckpointNow, recorder(ran))
    with actuator:
        assert actuator.wait_ready(30)
        send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "new"), key)))
        got = acks.take(2)
    assert ran == [("new", 0), ("new", 1)]
    assert {a.command_id for a in got} == {"new"}


def test_a_new_actuator_with_a_start_time_reads_the_commands_sent_since(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    """A rank on a new node (a group of its own) gives its process start: a command for its
    attempt sent while it was being assigned is not skipped; older ones still are."""
    key = auth.run_key(SECRET, run_id)
    send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "before"), key)))
    time.sleep(0.5)
    started = time.time()
    send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "since"), key)))
    ran: list[tuple[str, int]] = []
    actuator = make_actuator(bootstrap, topics, run_id, tmp_path / "journal", "spare", start_ts=started)
    actuator.register(CheckpointNow, recorder(ran))
    with actuator:
        assert actuator.wait_ready(30)
        got = acks.take(2)
    assert ran == [("since", 0), ("since", 1)]
    assert {a.command_id for a in got} == {"since"}


def test_a_topic_created_late_and_a_partition_added_while_running(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    """The actuator assigns partitions itself: it waits (not ready) for a missing topic,
    and reads a partition added while it runs from that partition's beginning."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    late = f"{topics.commands}.late-{uuid.uuid4().hex[:6]}"
    key = auth.run_key(SECRET, run_id)
    ran: list[tuple[str, int]] = []
    actuator = Actuator(
        bootstrap, late, topics.acks, run_id, attempt=0, local_ranks=[0], key=key, node="node-a",
        journal_path=tmp_path / "journal",
    )  # fmt: skip
    actuator.partition_refresh_s = 5.0
    actuator.register(CheckpointNow, recorder(ran))
    try:
        with actuator:
            assert not actuator.wait_ready(2)  # no topic yet: nothing assigned, not ready
            admin.create_topics([NewTopic(late, 1, 1)])[late].result(30)
            assert actuator.wait_ready(30)
            admin.create_partitions([NewPartitions(late, 2)])[late].result(30)
            # Written to the added partition before the actuator's next refresh sees it:
            # read only because an added partition starts at its beginning, not its end.
            producer = Producer({"bootstrap.servers": bootstrap})
            for partition, command_id in ((0, "on-old"), (1, "on-added")):
                raw = encode(auth.sign(checkpoint_now(run_id, command_id), key))
                producer.produce(late, key=run_id.encode(), value=raw, partition=partition)
            assert producer.flush(30) == 0
            got = acks.take(2)
            assert actuator.error is None
    finally:
        admin.delete_topics([late])
    assert sorted(ran) == [("on-added", 0), ("on-old", 0)]
    assert {(a.command_id, a.status) for a in got} == {
        ("on-old", AckStatus.EXECUTED), ("on-added", AckStatus.EXECUTED),
    }  # fmt: skip


def test_a_rank_actuator_does_not_ack_the_launchers_commands(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    """Live, the launcher's kinds addressed to every rank made each rank ack FAILED "no
    handler". With its role's kinds, a rank's actuator passes them over, unacked."""
    key = auth.run_key(SECRET, run_id)
    ran: list[tuple[str, int]] = []
    actuator = Actuator(
        bootstrap, topics.commands, topics.acks, run_id, attempt=0, local_ranks=[0, 1], key=key,
        node="node-a", journal_path=tmp_path / "journal", executes=kinds_of(Role.RANK),
    )  # fmt: skip
    actuator.register(CheckpointNow, recorder(ran))
    quarantine = QuarantineNode(
        command_id="q-1", run_id=run_id, attempt=0, issued_ts=1.0, node="node-b",
        reason=Reason(code=ReasonCode.OPERATOR, text="t"),
    )  # fmt: skip
    with actuator:
        assert actuator.wait_ready(30)
        send(bootstrap, topics.commands, run_id, encode(auth.sign(quarantine, key)))
        send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "ckpt-1"), key)))
        got = acks.take(2)
    assert sorted((a.command_id, a.rank, a.status) for a in got) == [
        ("ckpt-1", 0, AckStatus.EXECUTED),
        ("ckpt-1", 1, AckStatus.EXECUTED),
    ]
    assert actuator.stats.failed == 0 and actuator.counters.other_role == 1


def test_a_rank_kind_without_a_handler_still_fails_and_passed_over_offsets_are_committed(
    bootstrap: str, topics: TopicNames, run_id: str, acks: AckReader, tmp_path: Path
) -> None:
    """Passing over is for another role's kinds only: a kind the rank role executes but
    this actuator has no handler for is acked FAILED on each rank, saying so. The
    passed-over command's offset is committed like any other: a restarted actuator in the
    same group does not read it again."""
    key = auth.run_key(SECRET, run_id)
    ran: list[tuple[str, int]] = []

    def rank_actuator() -> Actuator:
        actuator = Actuator(
            bootstrap, topics.commands, topics.acks, run_id, attempt=0, local_ranks=[0, 1], key=key,
            node="node-a", journal_path=tmp_path / "journal", executes=kinds_of(Role.RANK),
        )  # fmt: skip
        actuator.register(CheckpointNow, recorder(ran))  # no SkipUpdate handler
        return actuator

    reason = Reason(code=ReasonCode.OPERATOR, text="t")
    quarantine = QuarantineNode(
        command_id="q-1", run_id=run_id, attempt=0, issued_ts=1.0, node="node-b", reason=reason
    )
    skip = SkipUpdate(command_id="skip-1", run_id=run_id, attempt=0, issued_ts=1.0, step=5, reason=reason)
    first = rank_actuator()
    with first:
        assert first.wait_ready(30)
        # The quarantine last: its offset is the one a restart would resume from.
        send(bootstrap, topics.commands, run_id, *(encode(auth.sign(c, key)) for c in (skip, quarantine)))
        got = acks.take(2)
    assert sorted((a.command_id, a.rank, a.status) for a in got) == [
        ("skip-1", 0, AckStatus.FAILED),
        ("skip-1", 1, AckStatus.FAILED),
    ]
    assert {a.detail for a in got} == {f"no handler registered for {SkipUpdate.KIND}"}
    assert first.stats.failed == 2 and first.counters.other_role == 1

    second = rank_actuator()  # same group: resumes from the committed offsets
    with second:
        assert second.wait_ready(30)
        send(bootstrap, topics.commands, run_id, encode(auth.sign(checkpoint_now(run_id, "ckpt-1"), key)))
        got = acks.take(2)
    assert sorted((a.command_id, a.rank, a.status) for a in got) == [
        ("ckpt-1", 0, AckStatus.EXECUTED),
        ("ckpt-1", 1, AckStatus.EXECUTED),
    ]
    assert second.counters.other_role == 0 and second.stats.failed == 0
    assert ran == [("ckpt-1", 0), ("ckpt-1", 1)]
