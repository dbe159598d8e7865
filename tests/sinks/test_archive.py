"""The DuckDB archive: idempotent storage (unit, real DuckDB files) and the Kafka writer
(broker tests: redelivery, re-reading with a new group and committed offsets)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from trainguard.kafka.topics import TopicNames
from trainguard.schemas import (
    Ack,
    AckStatus,
    CheckpointNow,
    GoodputReport,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    Quarantine,
    Reason,
    ReasonCode,
    Record,
    RestartPhases,
    RunStarted,
    StepTiming,
    encode,
    encode_batch,
)
from trainguard.schemas.auth import sign
from trainguard.sinks.archive import (
    Archive,
    ArchiveWriter,
    DeadLetter,
    Located,
    Role,
    decode_message,
    goodput_breakdown,
    summary,
    timeline,
)
from trainguard.sinks.archive_store import open_snapshot

RUN = "run-a"
T0 = 1_700_000_000.0


def step_timing(rank: int, step: int, run_id: str = RUN) -> StepTiming:
    return StepTiming(
        event_id=f"{run_id}:st:{rank}:{step}", run_id=run_id, attempt=0, rank=rank, node=f"n{rank // 4}",
        step=step, ts=T0 + step, compute_s=0.5, total_s=0.6,
    )  # fmt: skip


def run_started(attempt: int, world_size: int = 8, run_id: str = RUN) -> RunStarted:
    return RunStarted(
        event_id=f"{run_id}:start:{attempt}", run_id=run_id, attempt=attempt, rank=-1, node="", step=-1,
        ts=T0 + 1000 * attempt, world_size=world_size, ranks_per_node=4,
        nodes=[f"n{i}" for i in range(world_size // 4)],
    )  # fmt: skip


def interruption(iid: str, at: float, node: str = "n1", rank: int = 5, run_id: str = RUN) -> Interruption:
    return Interruption(
        event_id=f"{run_id}:int:{iid}", run_id=run_id, attempt=0, rank=rank, node=node, step=120, ts=at,
        reason=Reason(code=ReasonCode.RANK_EXITED, text=f"rank {rank} exited with signal 9"),
        interruption_id=iid, cause=InterruptionCause.CRASH, detected_by="hang_watchdog", lost_steps=20,
        last_checkpoint_step=100,
    )  # fmt: skip


def recovered(iid: str, restart_s: float, run_id: str = RUN) -> InterruptionRecovered:
    return InterruptionRecovered(
        event_id=f"{run_id}:rec:{iid}", run_id=run_id, attempt=1, rank=-1, node="", step=101, ts=T0 + 500,
        reason=Reason(code=ReasonCode.RESUMED, text="attempt 1 completed its first step"),
        interruption_id=iid, restart_s=restart_s, resumed_attempt=1,
    )  # fmt: skip


def command() -> CheckpointNow:
    cmd = CheckpointNow(
        command_id="cmd-1", run_id=RUN, attempt=0, ranks=[0, 1], issued_ts=T0 + 10,
        reason=Reason(code=ReasonCode.OPERATOR, text="checkpoint before maintenance"),
    )  # fmt: skip
    return sign(cmd, b"k" * 32)


def ack(rank: int = 0) -> Ack:
    return Ack(
        command_id="cmd-1", command_kind="checkpoint_now", run_id=RUN, attempt=0, rank=rank, node="n0",
        status=AckStatus.EXECUTED, ts=T0 + 11,
    )  # fmt: skip


def every_kind() -> list[Record | DeadLetter]:
    return [
        run_started(0),
        *(step_timing(rank, step) for rank in range(8) for step in range(3)),
        interruption("i-1", T0 + 200),
        recovered("i-1", 42.5),
        command(),
        ack(0),
        ack(1),
        DeadLetter("telemetry:0:7", "telemetry", "malformed", "not JSON", b"\xffgarbage", T0),
    ]


def test_writing_the_same_records_twice_shows_them_once(tmp_path: Path) -> None:
    path = tmp_path / "archive"
    with Archive(path) as archive:
        first = archive.write(every_kind())
        archive.write(every_kind())  # stored again; readers see the first of each key
    assert first.inserted == first.offered
    assert summary(path) == {
        "raw_event": 1 + 24 + 2,
        "run": 1,
        "interruption": 1,
        "interruption_recovered": 1,
        "command": 1,
        "ack": 2,
        "dead_letter": 1,
    }


def test_duplicates_inside_one_batch_are_stored_once(tmp_path: Path) -> None:
    with Archive(tmp_path / "a") as archive:
        result = archive.write([step_timing(0, 1), step_timing(0, 1), ack(0), ack(0)])
        assert result.inserted["raw_event"] == 1 and result.inserted["ack"] == 1
        assert summary(archive)["raw_event"] == 1


@pytest.mark.parametrize(
    "batches",
    [
        pytest.param([["int", "rec"]], id="same-batch"),
        pytest.param([["rec", "int"]], id="same-batch-recovered-first"),
        pytest.param([["rec"], ["int"]], id="recovered-before"),
        pytest.param([["int"], ["rec"]], id="recovered-after"),
        pytest.param([["int"], ["rec", "int"], ["rec"]], id="redelivered"),
    ],
)
def test_recovery_gives_restart_seconds_in_any_order(tmp_path: Path, batches: list[list[str]]) -> None:
    records = {"int": interruption("i-1", T0 + 200), "rec": recovered("i-1", 42.5)}
    with Archive(tmp_path / "a") as archive:
        for batch in batches:
            archive.write(records[name] for name in batch)
        (row,) = timeline(archive)
    assert row["restart_seconds"] == 42.5
    assert row["resumed_attempt"] == 1
    assert row["lost_steps"] == 20


def test_timeline_orders_interruptions_by_detection_time(tmp_path: Path) -> None:
    other = "run-b"
    with Archive(tmp_path / "a") as archive:
        archive.write(
            [
                interruption("i-late", T0 + 900, node="n3", rank=13),
                interruption("i-early", T0 + 100, node="n1", rank=5),
                recovered("i-early", 31.0),
                interruption("i-other", T0 + 500, node="n9", rank=2, run_id=other),
            ]
        )
        rows = timeline(archive)
        only_a = timeline(archive.connection, run_id=RUN)
    assert [r["interruption_id"] for r in rows] == ["i-early", "i-other", "i-late"]
    assert [r["interruption_id"] for r in only_a] == ["i-early", "i-late"]
    early, late = only_a
    assert early == {
        "run_id": RUN, "interruption_id": "i-early", "at": T0 + 100, "cause": "crash", "node": "n1",
        "rank": 5, "lost_steps": 20, "last_checkpoint_step": 100, "restart_seconds": 31.0,
        "resumed_attempt": 1, "detected_by": "hang_watchdog", "reason": "rank 5 exited with signal 9",
        "reason_code": "rank_exited", "lost_seconds": 0.0, "gpu_hours": 0.0, "detect_seconds": None,
        "reschedule_seconds": None, "startup_seconds": None, "decisions": [], "decision_reasons": [],
    }  # fmt: skip
    assert late["restart_seconds"] is None and late["node"] == "n3"


def test_timeline_lists_each_interruptions_decisions_and_cost(tmp_path: Path) -> None:
    """The core's own records of one crash: the decisions it caused (directly, or through
    the quarantine: its command) with their reasons, and the cost of the restart."""
    from harness.streams import Job
    from trainguard.processors.core import CorePolicy, run_all

    job = Job(step_s=60.0, checkpoint_every=10).start().steps(45)
    job.exit(9, exit_code=1)
    job.restart(resumed_from_step=40, delay_s=300.0)
    job.steps(20)
    _, outputs = run_all(job.events, CorePolicy())
    with Archive(tmp_path / "a") as archive:
        archive.write([*job.events, *outputs])
        (row,) = timeline(archive)
    assert row["cause"] == "crash" and row["node"] == job.node(9)
    # issue 45: the node is out and no spare was said to be ready: the capacity decision too
    assert row["decisions"] == ["abort", "interruption_decided", "quarantine", "quarantine_node"]
    assert any(
        job.node(9) in text and text.startswith("quarantine_node: ") for text in row["decision_reasons"]
    )
    elastic = "interruption_decided: if no spare is ready:"
    assert any(text.startswith(elastic) for text in row["decision_reasons"])
    # 4 steps re-done at 60 s each, a 300 s relaunch then the first step: the cost in GPU-hours
    assert row["lost_steps"] == 4 and row["lost_seconds"] == pytest.approx(240.0, rel=0.05)
    assert row["reschedule_seconds"] + row["startup_seconds"] == pytest.approx(row["restart_seconds"])
    cost = job.world_size * (row["restart_seconds"] + row["lost_seconds"]) / 3600
    assert row["gpu_hours"] == pytest.approx(cost)


def test_timeline_shows_a_checkpoint_rejected_at_resume_and_why(tmp_path: Path) -> None:
    """Issue 15: stopped, relaunched on checkpoint 30 whose shard rank 0 finds flipped; it
    resumes from 20. The restart's timeline entry lists the rejection with its reason."""
    from harness.streams import Job
    from trainguard.processors.core import CorePolicy, run_all
    from trainguard.schemas import CheckpointRejected

    job = Job(world_size=4).start().steps(35)
    for r in range(4):
        job.exit(r, signal=15, requested=True)
    job.restart(resumed_from_step=30)
    job.events.append(
        CheckpointRejected(
            **job._env(0), checkpoint_step=30, uri="file:///c/30", resumed_from_step=20,
            error="re-verification before resume failed: digest mismatch in shard __2_0.distcp",
        )
    )  # fmt: skip
    job.step = 20
    job.steps(5)
    _, outputs = run_all(job.events, CorePolicy())
    with Archive(tmp_path / "a") as archive:
        archive.write([*job.events, *outputs])
        (row,) = timeline(archive)
    assert row["cause"] == "operator" and row["decisions"] == ["resume_rejected"]
    (text,) = row["decision_reasons"]
    assert text.startswith("resume_rejected: checkpoint step 30 failed verification before resume")
    assert "digest mismatch in shard __2_0.distcp" in text and "resumes from step 20" in text


def test_dead_letters_keep_reason_and_original_bytes(tmp_path: Path) -> None:
    bad_event = step_timing(99, 1).model_dump(mode="json")  # rank 99 in a world of 8
    batch = encode_batch(
        {"run_id": RUN, "node": "n0", "world_size": 8, "producer_id": "p", "seq": 0},
        [encode(step_timing(0, 1)), orjson.dumps({"schema": "step_timing/1", **bad_event})],
    )
    messages = [
        _message("tg.telemetry", 2, 40, batch),
        _message("tg.telemetry", 2, 41, b"\x00not json"),
        _message("tg.events", 0, 7, encode(step_timing(0, 2))),  # telemetry on the events topic
        _message(
            "tg.deadletter", 1, 3, b"original", headers=[("reason", b"oversized"), ("detail", b"9 MiB")]
        ),
    ]
    roles = [Role.TELEMETRY, Role.TELEMETRY, Role.EVENTS, Role.DEADLETTER]
    items = [item for role, msg in zip(roles, messages, strict=True) for item in decode_message(role, msg)]
    with Archive(tmp_path / "a") as archive:
        archive.write(items)
        archive.write(items)
        rows = archive.connection.execute(
            "SELECT id, topic, reason, detail, raw, ts FROM dead_letter ORDER BY id"
        ).fetchall()
        stored = archive.connection.execute("SELECT event_id, kafka_partition, kafka_offset FROM raw_event")
        assert stored.fetchall() == [(f"{RUN}:st:0:1", 2, 40)]
    by_id = {row[0]: row[1:] for row in rows}
    assert set(by_id) == {"tg.telemetry:2:40:0", "tg.telemetry:2:41", "tg.events:0:7", "tg.deadletter:1:3"}
    assert by_id["tg.telemetry:2:40:0"][1] == "rank_out_of_range"
    assert by_id["tg.telemetry:2:41"][1] == "malformed" and by_id["tg.telemetry:2:41"][3] == b"\x00not json"
    assert by_id["tg.events:0:7"][1] == "wrong_record_type"
    assert by_id["tg.events:0:7"][3] == encode(step_timing(0, 2))
    assert by_id["tg.deadletter:1:3"] == ("tg.deadletter", "oversized", "9 MiB", b"original", T0)


def test_integers_beyond_64_bits_become_dead_letters_not_crashes(tmp_path: Path) -> None:
    huge = step_timing(0, 1).model_copy(update={"event_id": "huge", "step": 2**70})
    with Archive(tmp_path / "a") as archive:
        result = archive.write([Located([huge, step_timing(0, 3)], "tg.telemetry", 0, 5), step_timing(0, 2)])
        assert result.inserted["raw_event"] == 2
        (reason,) = archive.connection.execute("SELECT reason FROM dead_letter").fetchall()[0]
    assert reason == "unarchivable"


def test_run_view_and_reopen_keep_data(tmp_path: Path) -> None:
    path = tmp_path / "a"
    with Archive(path) as archive:
        archive.write([run_started(0, world_size=8), step_timing(0, 2)])
    with Archive(path) as archive:  # reopening runs the DDL again: idempotent
        archive.write([run_started(1, world_size=4)])
        (run,) = _dicts(archive.connection, "SELECT * FROM run")
    assert run["attempts"] == 2 and run["world_size"] == 4 and run["last_attempt"] == 1
    assert run["started_at"] == T0 and run["last_ts"] == T0 + 1000
    assert summary(path)["raw_event"] == 3


def test_timeline_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        timeline(tmp_path / "nope")


# --------------------------------------------------------------------------- broker


def _produce(bootstrap: str, topics: TopicNames) -> tuple[int, int]:
    """Every kind of record once; returns how many Kafka records, and how many bad ones."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    failures: list[str] = []

    def on_delivery(err: Any, _msg: Message) -> None:
        if err is not None:
            failures.append(str(err))

    def send(topic: str, value: bytes, headers: list[tuple[str, str | bytes | None]] | None = None) -> None:
        producer.produce(topic, value, key=RUN.encode(), headers=headers, on_delivery=on_delivery)

    header = {"run_id": RUN, "world_size": 8, "producer_id": "test"}
    send(topics.telemetry, encode(run_started(0)))
    for node in range(2):
        events = [
            encode(step_timing(rank, step)) for rank in range(node * 4, node * 4 + 4) for step in range(3)
        ]
        send(topics.telemetry, encode_batch({**header, "node": f"n{node}", "seq": 0}, events))
    bad = orjson.dumps({"schema": "step_timing/1", **step_timing(42, 0).model_dump(mode="json")})
    send(topics.telemetry, encode_batch({**header, "node": "n0", "seq": 1}, [bad]))
    send(topics.events, encode(recovered("i-1", 42.5)))  # before its interruption: still correct
    send(topics.events, encode(interruption("i-1", T0 + 200)))
    send(topics.events, b'{"schema": "interruption/1", "event_id": ')  # malformed
    send(topics.commands, encode(command()))
    send(topics.acks, encode(ack(0)))
    send(topics.deadletter, b"\x01raw", headers=[("reason", b"oversized"), ("detail", b"too big")])
    assert producer.flush(30) == 0 and not failures, failures
    return 10, 3


EXPECTED = {
    "raw_event": 1 + 24 + 2,
    "run": 1,
    "interruption": 1,
    "interruption_recovered": 1,
    "command": 1,
    "ack": 1,
}


def _end_offsets(bootstrap: str, topics: TopicNames, group: str) -> list[tuple[str, int, int, int]]:
    """(topic, partition, committed offset of `group`, end offset) of every archived partition."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        names = [topics.telemetry, topics.events, topics.commands, topics.acks, topics.deadletter]
        metadata = consumer.list_topics(timeout=10).topics
        parts = [TopicPartition(t, p) for t in names for p in metadata[t].partitions]
        committed = consumer.committed(parts, timeout=10)
        return [
            (tp.topic, tp.partition, tp.offset, consumer.get_watermark_offsets(tp, timeout=10)[1])
            for tp in committed
        ]
    finally:
        consumer.close()


@pytest.mark.broker
def test_writer_archives_every_topic_exactly_once(bootstrap: str, topics: TopicNames, tmp_path: Path) -> None:
    db = tmp_path / "archive"
    group = f"archive-{uuid.uuid4().hex[:8]}"
    total, bad = _produce(bootstrap, topics)

    with ArchiveWriter(bootstrap, topics, db, group_id=group) as writer:
        stats = writer.run_until_caught_up(timeout_s=60)
    counts = summary(db)
    assert counts == {**EXPECTED, "dead_letter": bad}
    assert stats.consumed == total and stats.rows["raw_event"] == 27
    (row,) = timeline(db)
    assert row["restart_seconds"] == 42.5 and row["node"] == "n1"
    with contextlib.closing(open_snapshot(db)) as con:
        reasons = dict(con.execute("SELECT reason, raw FROM dead_letter").fetchall())
        (signature,) = con.execute("SELECT payload->>'$.signature' FROM command").fetchall()[0]
    assert set(reasons) == {"rank_out_of_range", "malformed", "oversized"}
    assert reasons["oversized"] == b"\x01raw"
    assert signature == command().signature
    ends = _end_offsets(bootstrap, topics, group)
    assert all(committed == end for _, _, committed, end in ends if end > 0), ends

    # Redelivery: the same records produced again show once; only the bad ones, at new log
    # positions, are new dead letters (a dead letter's identity is its position).
    _produce(bootstrap, topics)
    with ArchiveWriter(bootstrap, topics, db, group_id=group) as writer:
        again = writer.run_until_caught_up(timeout_s=60)
    assert again.consumed == total and again.rows["dead_letter"] == bad
    assert summary(db) == {**EXPECTED, "dead_letter": 2 * bad}

    # A new consumer group resumes from the archive's own offsets: nothing is read twice.
    with ArchiveWriter(bootstrap, topics, db, group_id=f"{group}-fresh") as writer:
        fresh = writer.run_until_caught_up(timeout_s=60)
    assert fresh.consumed == 0 and sum(fresh.rows.values()) == 0
    assert summary(db) == {**EXPECTED, "dead_letter": 2 * bad}


@pytest.mark.broker
def test_a_failed_write_commits_no_offsets(
    bootstrap: str, topics: TopicNames, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "archive"
    group = f"archive-{uuid.uuid4().hex[:8]}"
    total, bad = _produce(bootstrap, topics)
    with ArchiveWriter(bootstrap, topics, db, group_id=group) as writer:

        def disk_full(_items: object, _offsets: object = None) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(writer.archive, "write", disk_full)
        with pytest.raises(OSError, match="No space left"):
            writer.run_until_caught_up(timeout_s=30)
    assert all(committed < 0 for _, _, committed, _ in _end_offsets(bootstrap, topics, group))

    # The same group resumes from nothing committed and stores everything, here via run() in a
    # thread and in small transactions (each followed by its offset commit).
    with ArchiveWriter(bootstrap, topics, db, group_id=group, max_events_per_write=5) as writer:
        stop = threading.Event()
        thread = threading.Thread(target=writer.run, args=(stop,))
        thread.start()
        deadline = time.monotonic() + 60
        while writer.stats.consumed < total and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert writer.stats.batches >= 3 and writer.stats.commit_failures == 0
    assert summary(db) == {**EXPECTED, "dead_letter": bad}
    ends = _end_offsets(bootstrap, topics, group)
    assert all(committed == end for _, _, committed, end in ends if end > 0), ends


@pytest.mark.broker
def test_caught_up_on_empty_topics_returns_at_once(
    bootstrap: str, topics: TopicNames, tmp_path: Path
) -> None:
    with ArchiveWriter(bootstrap, topics, tmp_path / "a", group_id=f"g-{uuid.uuid4().hex[:8]}") as w:
        stats = w.run_until_caught_up(timeout_s=10)
    assert stats.consumed == 0 and stats.batches == 0


# --------------------------------------------------------------------------- helpers


def _message(
    topic: str,
    partition: int,
    offset: int,
    value: bytes,
    headers: list[tuple[str, str | bytes | None]] | None = None,
) -> Message:
    return Message(
        topic=topic, partition=partition, offset=offset, value=value, headers=headers,
        timestamp=(1, int(T0 * 1000)),
    )  # fmt: skip


def _dicts(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict[str, Any]]:
    result = con.execute(sql)
    names = [d[0] for d in result.description]
    return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def goodput_report(window_s: float, at: float, goodput: float, run_id: str = RUN) -> GoodputReport:
    return GoodputReport(
        event_id=f"g-{run_id}-{window_s:.0f}-{at:.0f}",
        run_id=run_id,
        attempt=0,
        rank=-1,
        node="",
        step=100,
        ts=at,
        reason=Reason(code=ReasonCode.GOODPUT, text="goodput"),
        window_s=window_s,
        elapsed_s=min(window_s, at - T0),
        checkpoint_s=120.0,
        lost_s=300.0,
        restart_s=(1 - goodput) * window_s - 420.0 if goodput < 0.8 else 0.0,
        straggler_s=0.0,
        goodput=goodput,
    )


def test_the_goodput_view_gives_each_runs_latest_breakdown_per_window(tmp_path: Path) -> None:
    with Archive(tmp_path / "a") as archive:
        archive.write(
            [
                goodput_report(3600.0, T0 + 4200, 0.9),
                goodput_report(3600.0, T0 + 4800, 0.5),  # the newer hour
                goodput_report(86_400.0, T0 + 4800, 0.85),
                goodput_report(3600.0, T0 + 4800, 0.7, run_id="run-b"),
            ]
        )
        rows = goodput_breakdown(archive)
        only_a = goodput_breakdown(archive.connection, run_id=RUN)
    assert [(r["run_id"], r["window_s"], r["goodput"]) for r in rows] == [
        (RUN, 3600.0, 0.5),
        (RUN, 86_400.0, 0.85),
        ("run-b", 3600.0, 0.7),
    ]
    assert [r["at"] for r in only_a] == [T0 + 4800, T0 + 4800]
    assert only_a[0]["restart_s"] == pytest.approx(0.5 * 3600 - 420)


def quarantine_event(node: str, run_id: str, at: float) -> Quarantine:
    return Quarantine(
        event_id=f"q-{node}-{run_id}-{at:.0f}",
        run_id=run_id,
        attempt=0,
        rank=3,
        node=node,
        step=50,
        ts=at,
        reason=Reason(code=ReasonCode.QUARANTINE, text="node caused an interruption"),
        run_ids_affected=[run_id],
    )


def test_which_node_killed_the_most_jobs_is_one_query(tmp_path: Path) -> None:
    with Archive(tmp_path / "a") as archive:
        archive.write(
            [quarantine_event("n0417", f"run-{i}", T0 + 100 * i) for i in range(6)]
            + [quarantine_event("n0417", "run-0", T0 + 900), quarantine_event("n0002", "run-9", T0 + 50)]
        )
        rows = archive.connection.execute(
            "SELECT node_id, runs_affected, quarantines, run_ids FROM node_quarantine "
            "ORDER BY runs_affected DESC"
        ).fetchall()
    assert rows[0] == ("n0417", 6, 7, [f"run-{i}" for i in range(6)])
    assert rows[1][:3] == ("n0002", 1, 1)


def test_restart_phases_are_one_row_per_phase_in_order(tmp_path: Path) -> None:
    phases = {
        "detect": 0.4,
        "reschedule": 1.2,
        "process_start": 2.5,
        "checkpoint_load": 0.8,
        "first_step": 0.3,
    }
    record = RestartPhases(
        event_id="rp-1", run_id=RUN, attempt=3, rank=-1, node="", step=120, ts=T0 + 60,
        interrupted_attempt=2, cause="crash", phases=phases, resumed_from_step=120,
    )  # fmt: skip
    with Archive(tmp_path / "a") as archive:
        archive.write([record, record])  # redelivered: stored once
        rows = archive.connection.execute(
            "SELECT phase, seconds, interrupted_attempt FROM restart_phase ORDER BY phase_order"
        ).fetchall()
    assert rows == [(phase, seconds, 2) for phase, seconds in phases.items()]
