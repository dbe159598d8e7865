"""The soak's account of where each abort's seconds went (issue 49), and its check that a
command meant to outlive its attempt is never refused as stale."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from harness.devtools.soak import LASTING, lasting_commands
from harness.devtools.soak_timeline import AbortTimeline, Placed, stopped_at, worker_events
from trainguard.schemas import Ack, AckStatus


def ack(kind: str, status: AckStatus, detail: str = "", command_id: str = "c-1", rank: int = 0) -> Ack:
    return Ack(command_id=command_id, command_kind=kind, run_id="run-t", attempt=1, rank=rank,
               node="node-000", status=status, detail=detail, ts=1_800_000_000.0)  # fmt: skip


def test_a_late_quarantine_refused_as_stale_fails_the_check() -> None:
    stale = "CommandRefused: command is for attempt 1, the job is at 2"
    verdict = lasting_commands([ack("quarantine_node", AckStatus.FAILED, stale, rank=r) for r in range(4)])
    assert verdict.name == LASTING and not verdict.held and verdict.covered == 1
    assert "1 refused as stale" in verdict.detail and "quarantine_node c-1" in verdict.detail


def test_executed_lasting_commands_and_a_stale_abort_pass_the_check() -> None:
    acks = [
        ack("quarantine_node", AckStatus.EXECUTED, "node-003 out at the next restart"),
        ack("release_node", AckStatus.EXECUTED, command_id="c-2"),
        # An abort is about one attempt's processes: refused as stale, rightly.
        ack("abort", AckStatus.REFUSED, "stale_attempt: command is for attempt 0, this is attempt 1", "c-3"),
    ]
    verdict = lasting_commands(acks)
    assert verdict.held and verdict.covered == 2


def test_stages_run_from_the_fault_to_the_first_ack() -> None:
    line = AbortTimeline("run-t", "abort-1", "interruption", fault=100.0, shipped=100.4, decided=109.4,
                         received=109.6, executed=109.7, acked=109.9)  # fmt: skip
    stages = line.stages()
    assert [round(s, 2) if s is not None else None for s in stages] == [0.4, 9.0, 0.2, 0.1, 0.2, 9.9]
    unacked = AbortTimeline("run-t", "abort-2", "hang_detected", fault=100.0, shipped=100.4)
    assert unacked.stages() == [unacked.stages()[0], None, None, None, None, None]


def test_worker_events_come_from_the_kills_and_the_workers_logs(tmp_path: Path) -> None:
    def stamp(text: str) -> float:
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()

    head = "[2026-12-06 19:55:%s] [15145] [INFO] "
    (tmp_path / "worker-0.1.log").write_text(
        head % "03,451"
        + "Revoking previously assigned partitions set() for group g \n"
        + head % "09,065"
        + "Joined group 'g' (generation 3) with member_id m \n"
        + head % "12,440"
        + "recovered p.trainguard.telemetry[3] at 5325: snapshot 4686, "
        "639 records folded, 4 outputs published, 3.21 s (snapshot 0.50 s, fold 1.20 s, outputs 1.51 s) \n"
        "| a table row faust prints |\n"
    )
    (tmp_path / "worker-1.0.log").write_text(
        "[2026-12-06 19:55:04,019] [14688] [INFO] Revoking previously assigned partitions \n"
        "[2026-12-06 19:55:09,080] [14688] [INFO] generation 3: kept 1 of 1 revoked partitions of t \n"
    )
    killed = stamp("2026-12-06 19:54:58,000")
    events = worker_events(tmp_path, {"worker-0": [killed]})
    assert [(e.worker, e.what) for e in events] == [
        ("worker-0", "kill"),
        ("worker-1", "revoke"),
        ("worker-0", "join"),
        ("worker-1", "kept its partitions"),
        ("worker-0", "recovered"),
    ]
    recovered = events[-1]
    assert recovered.partition == 3 and recovered.seconds == 3.21
    assert recovered.describe(killed) == "worker-0 recovered p3 +14.4 (fold 3.2 s)"


def test_an_undelivered_abort_says_where_it_stopped() -> None:
    on_topic = Placed(ts=1_800_000_100.0, partition=2, offset=40)
    assert stopped_at(None, None, 1_800_000_200.0) == "never on the commands topic"
    # The actuator's group committed past the record: it read it and handed it to no rank.
    assert stopped_at(on_topic, 41, 1_800_000_200.0).startswith("read by the actuator (p2@40)")
    # Committed short of it (or nothing committed): never read, while the run went on ...
    unread = stopped_at(on_topic, 40, 1_800_000_130.0)
    assert "not read by the actuator" in unread and unread.endswith("the run went on 30.0 s")
    assert "the run went on" in stopped_at(on_topic, None, 1_800_000_130.0)
    # ... or because the run had already stopped.
    assert stopped_at(on_topic, None, 1_800_000_090.0).endswith("the run had ended 10.0 s before")
