"""Replay determinism: a run recorded through the real broker and the live processor
(the demo's crash, hang and straggler, with the restarts they cause), read back from
the topics and driven through a fresh core with the policy the run used, yields the
live processor's decisions exactly, event for event; under another policy it does not.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import duckdb
import pytest

from harness.devtools.stack import builtin_policy
from trainguard.kafka.topics import topic_names
from trainguard.processors.core.policy import CorePolicy, load_policy, parse_policy
from trainguard.replay.log import Recording, read_archived_recording
from trainguard.replay.replay import compare, decisions_of, replay, replay_all, replayed_decisions, unique
from trainguard.schemas import (
    Abort,
    Interruption,
    Reason,
    ReasonCode,
    RunRingCheck,
    StragglerFlagged,
    encode,
)
from trainguard.sinks.archive_schema import TABLE_DDL
from trainguard.sinks.archive_store import Archive, Logged

from ..sinks.test_archive import T0
from .conftest import Recorded

POLICY = builtin_policy("demo")


@pytest.mark.broker
def test_replaying_a_recorded_run_with_its_policy_reproduces_every_decision(recorded: Recorded) -> None:
    recording = recorded.recording
    causes = {d.cause.value for d in recording.derived if isinstance(d, Interruption)}
    assert {"crash", "hang"} <= causes  # a run with faults, restarts and their decisions
    assert any(isinstance(d, StragglerFlagged) for d in recording.derived)
    # aborts, restarts' self-checks and the ring check (one calibrates all 64 ranks: the
    # scheduler no longer sends a calibration pair every 100 steps)
    assert len(recording.commands) > 5 and any(isinstance(c, RunRingCheck) for c in recording.commands)

    replayed = replay(recording, load_policy(str(POLICY)))
    comparison = compare(decisions_of(recording), replayed_decisions(replayed))
    assert comparison.identical, comparison.differences[:10]
    assert comparison.matched == comparison.recorded == comparison.replayed > 20
    assert replayed.events > 10_000 and replayed.rejections == 0


@pytest.mark.broker
def test_the_recorded_runs_blocks_folded_row_by_row_decide_the_same(recorded: Recorded) -> None:
    """Issue 20: the per-event and the columnar paths decide identically on a recorded run
    (its step timings came as columnar blocks, processors/core/folds/block.py)."""
    recording = recorded.recording
    assert sum(b'"step_timings/1"' in value for _, _, value in recording.records) > 100
    policy = load_policy(str(POLICY))
    columns, rows = replay(recording, policy), replay(recording, policy, columnar=False)
    assert rows.events == columns.events > 10_000
    assert [encode(d) for d in replayed_decisions(rows)] == [encode(d) for d in replayed_decisions(columns)]


@pytest.mark.broker
def test_the_archive_keeps_the_log_and_a_replay_from_it_is_identical(recorded: Recorded) -> None:
    """Issue 20: the archive keeps the telemetry records as the processor consumed them
    (telemetry_log) and the decisions (raw_event, command): read back from it, the run is the
    one read from Kafka, record for record, and replays to the live decisions exactly, from
    its columns as from its bytes."""
    recording = recorded.recording
    archived = read_archived_recording(recorded.archive, recorded.names, recording.run_id)
    assert archived.records == recording.records  # every record's place and bytes
    for mine, theirs in ((archived.derived, recording.derived), (archived.commands, recording.commands)):
        assert [encode(d) for d in mine] == [encode(d) for d in unique(theirs)]
    # The writer kept most records as columns too (schemas/record_columns.py): the replay
    # folds those, and decides as from every record's bytes.
    assert archived.stored is not None
    assert sum(s >= 0 for s in archived.stored.slot) > len(archived.records) // 2
    replayed = replay(archived, load_policy(str(POLICY)))
    comparison = compare(decisions_of(archived), replayed_decisions(replayed))
    assert comparison.identical and comparison.matched > 20, comparison.differences[:10]
    as_bytes = replay(archived, load_policy(str(POLICY)), columns=False)
    assert [encode(d) for d in replayed_decisions(as_bytes)] == [
        encode(d) for d in replayed_decisions(replayed)
    ]
    assert (as_bytes.events, as_bytes.duplicates, as_bytes.goodput) == (
        replayed.events,
        replayed.duplicates,
        replayed.goodput,
    )
    assert read_archived_recording(recorded.archive, recorded.names, "no-such-run").records == []


@pytest.mark.broker
def test_policies_replayed_in_one_pass_decide_as_each_alone(recorded: Recorded) -> None:
    """A backtest's pass decodes each record once and folds it into every policy's core
    (replay_all): each policy decides exactly as when replayed alone from the bytes."""
    recording = recorded.recording
    strict = parse_policy({"version": 1, "hang": {"min_samples": 20, "floor_s": 2.0, "stack_collect_s": 5.0},
                           "straggler": {"consecutive_steps": 50}})  # fmt: skip
    seen: list[int] = []
    together = replay_all(
        recording, [load_policy(str(POLICY)), strict], observe=lambda p: seen.append(p.events)
    )
    assert len(seen) == len(recording.records) and sum(seen) == together[0].events
    for policy, out in zip((load_policy(str(POLICY)), strict), together, strict=True):
        alone = replay(recording, policy)
        assert [encode(d) for d in replayed_decisions(out)] == [encode(d) for d in replayed_decisions(alone)]
        assert (out.events, out.duplicates, out.goodput) == (alone.events, alone.duplicates, alone.goodput)
    assert replayed_decisions(together[0]) != replayed_decisions(together[1])


@pytest.mark.broker
def test_replaying_under_another_policy_shows_the_decisions_that_differ(recorded: Recorded) -> None:
    strict = parse_policy({"version": 1, "hang": {"min_samples": 20, "floor_s": 2.0, "stack_collect_s": 5.0},
                           "straggler": {"consecutive_steps": 50},
                           "slowdown": {"block_steps": 16}})  # fmt: skip
    comparison = compare(
        decisions_of(recorded.recording), replayed_decisions(replay(recorded.recording, strict))
    )
    assert not comparison.identical
    # The same straggle (its id is its onset's) is flagged sooner: a 50-step streak, and the
    # windowed detector judging blocks of 16 steps instead of 32.
    (flag,) = [d for d in comparison.differences if d.kind == "straggler_flagged" and d.what == "changed"]
    assert "step" in flag.detail and "consecutive_steps" in flag.detail


def flagged(rank: int, step: int) -> StragglerFlagged:
    return StragglerFlagged(
        event_id=f"flag-{rank}-{step}", run_id="r", attempt=0, rank=rank, node=f"n{rank}", step=step,
        ts=step * 2.0, reason=Reason(code=ReasonCode.STRAGGLER, text=f"rank {rank} slow"),
        robust_z=9.0, slowdown=1.2,
    )  # fmt: skip


def test_compare_names_missing_extra_changed_and_moved_decisions() -> None:
    a, b, c = (flagged(rank=r, step=100 + r) for r in (1, 2, 3))
    changed = b.model_copy(update={"robust_z": b.robust_z + 1})
    assert compare([a, b, c, a], [a, b, c]).identical  # a redelivered decision counts once
    what = {(d.what, d.decision_id) for d in compare([a, b], [changed, c]).differences}
    assert what == {("missing", a.event_id), ("changed", b.event_id), ("extra", c.event_id)}
    (moved,) = compare([a, b, c], [a, c, b]).differences
    assert (moved.what, moved.decision_id) == ("moved", b.event_id)


def test_a_replay_of_nothing_decides_nothing() -> None:
    replayed = replay(Recording("empty"), CorePolicy())
    assert (replayed.records, replayed.derived, replayed.commands) == (0, [], [])


def test_signature_is_not_compared() -> None:
    abort = Abort(
        command_id="a1",
        run_id="r",
        attempt=0,
        issued_ts=1.0,
        reason=Reason(code=ReasonCode.OPERATOR, text="x"),
    )
    assert compare([abort.model_copy(update={"signature": "a" * 64})], [abort]).identical
    assert not compare([abort.model_copy(update={"attempt": 1})], [abort]).identical


def test_the_archived_log_is_read_in_partition_and_offset_order_each_record_once(tmp_path: Path) -> None:
    """The archive read (replay/log.py) orders a run's records by partition and offset
    whatever batches stored them, keeps the first copy of a record stored again, and
    leaves other runs out; a DuckDB connection holding the table reads the same."""
    root = tmp_path / "archive"
    first = [
        Logged("run-a", 1, 0, T0, b"a-1-0"),
        Logged("run-a", 0, 5, T0, b"a-0-5"),
        Logged("run-b", 0, 6, T0, b"b"),
    ]
    later = [Logged("run-a", 0, 2, T0 + 1, b"a-0-2"), Logged("run-a", 0, 5, T0 + 1, b"again")]
    with Archive(root) as archive:
        archive.write(first)
        archive.write(later)
    expected = [(0, 2, b"a-0-2"), (0, 5, b"a-0-5"), (1, 0, b"a-1-0")]
    assert read_archived_recording(root, topic_names(), "run-a").records == expected
    with contextlib.closing(duckdb.connect()) as con:
        for statement in TABLE_DDL:
            con.execute(statement)
        con.executemany(
            "INSERT INTO telemetry_log VALUES (?, ?, ?, ?, ?)",
            [(item.run_id, item.partition, item.offset, item.ts, item.value) for item in first],
        )
        assert read_archived_recording(con, topic_names(), "run-a").records == [expected[1], expected[2]]
