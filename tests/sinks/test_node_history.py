"""The lemon-node history from a real archive (issue 46): the archive's node_history view,
read by sinks/node_history.py into the pure rule's records (trainguard/common/lemons.py).
Every archive here is written by the archive's own store from records the pure policy core
produced (simulated runs in a closed loop, or realistic telemetry streams folded by it);
expectations come from the faults the runs planned and the core's decisions, never from
the view itself."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from harness.streams import Job
from trainguard.common.lemons import DAY_S, LemonPolicy, failures
from trainguard.processors.core import CorePolicy, run_all
from trainguard.schemas import NodeSelfTestResult, Reason, ReasonCode
from trainguard.sinks.archive_store import Archive
from trainguard.sinks.node_history import find_lemons, history

from .lemon_runs import LEMON, PAST, TWICE, past_runs, write_lemon_archive

#: 2024-05-20 00:00:00 UTC: the lemon archive's runs are 20, 10 and 2 days before.
NOW = 1_716_163_200.0


def test_three_crashes_across_runs_make_node_0001_a_lemon(tmp_path: Path) -> None:
    archive = write_lemon_archive(tmp_path / "archive", NOW)
    (lemon,) = find_lemons(archive, LemonPolicy(), NOW)
    assert lemon.node == LEMON
    assert lemon.runs == tuple(p.run_id for p in PAST)
    fired = [(run.run_id, f) for run in past_runs(NOW) for f in run.fired if f.node == LEMON]
    assert [(f.run_id, f.attempt, f.kind) for f in lemon.failures] == [
        (r, f.attempt, "crash") for r, f in fired
    ]
    assert lemon.reason.startswith(f"{LEMON}: 3 failures in 30 days across runs lemon-a, lemon-b, lemon-c: ")
    for run_id, f in fired:  # each crash with the core's reason: the rank, the signal, the step before
        assert f"crash in {run_id} on " in lemon.reason
        assert f"(rank {f.rank} on {LEMON} died (signal 9) after step {f.step - 1})" in lemon.reason
    # node-0000 failed twice (lemon-a, lemon-b): counted, not a lemon.
    counted = failures(history(archive), LemonPolicy(), NOW)
    assert [f.run_id for f in counted[TWICE]] == ["lemon-a", "lemon-b"]
    # Over 15 days lemon-a is too old: node-0001 has two failures left, no lemon.
    assert find_lemons(archive, LemonPolicy(window_days=15), NOW) == []
    assert find_lemons(archive, LemonPolicy(min_failures=2, window_days=15), NOW)[0].runs == (
        "lemon-b",
        "lemon-c",
    )


def test_each_crash_leaves_three_records_of_one_failure(tmp_path: Path) -> None:
    archive = write_lemon_archive(tmp_path / "archive", NOW)
    records = history(archive)
    kinds = Counter((r.node, r.run_id, r.attempt, r.kind) for r in records)
    expected: Counter[tuple[str, str, int, str]] = Counter()
    for run in past_runs(NOW):
        for f in run.fired:  # the interruption, the Quarantine event, the QuarantineNode command
            expected[(f.node, run.run_id, f.attempt, "crash")] += 1
            expected[(f.node, run.run_id, f.attempt, "quarantine")] += 2
    assert kinds == expected
    assert [r.ts for r in records] == sorted(r.ts for r in records)  # oldest first
    # Only what happened since: the last run's.
    since = NOW - 5 * DAY_S
    assert {r.run_id for r in history(archive, since)} == {"lemon-c"}
    # Stored again (a redelivery), nothing changes.
    with Archive(archive) as db:
        db.write(past_runs(NOW)[0].records())
    assert Counter((r.node, r.run_id, r.attempt, r.kind) for r in history(archive)) == expected


def test_a_released_quarantine_and_a_culprit_the_core_left_in_count_for_nothing(tmp_path: Path) -> None:
    """Step 126 fails on node-001, then on node-002 after the restart: data or code. The core
    quarantined node-001 at the first failure and releases it; node-002 it never took out."""
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    job.exit(5, exit_code=1)
    job.replace("node-001")
    job.restart(resumed_from_step=120).steps(5)
    job.exit(9, exit_code=1)
    _, outputs = run_all(job.events, CorePolicy())
    assert "quarantine_released" in [o.KIND for o in outputs]
    with Archive(tmp_path / "archive") as db:
        db.write([*job.events, *outputs])
    records = history(tmp_path / "archive")
    assert sorted({(r.node, r.attempt, r.kind) for r in records}) == [
        ("node-001", 0, "crash"),
        ("node-001", 0, "quarantine"),
        ("node-001", 0, "released"),  # the quarantine's attempt, though released in the next
        ("node-002", 1, "crash"),
    ]
    assert failures(records, LemonPolicy(), job.t) == {}


def _self_test(job: Job, node: str, purpose: str, passed: bool, ts: float) -> NodeSelfTestResult:
    code = ReasonCode.NODE_SELF_TEST_PASSED if passed else ReasonCode.NODE_SELF_TEST_FAILED
    text = (
        "2 of 2 tests passed" if passed else f"1 of 2 tests failed on {node}: gemm (local rank 1: 12 wrong)"
    )
    return NodeSelfTestResult(
        event_id=f"selftest-{node}-{purpose}-{ts}",
        run_id=job.run_id,
        attempt=job.attempt,
        rank=-1,
        node=node,
        step=-1,
        ts=ts,
        passed=passed,
        tests=["gemm", "collective"],
        failed_tests=[] if passed else ["gemm"],
        purpose=purpose,  # type: ignore[arg-type]
        devices=4,
        wall_s=3.5,
        reason=Reason(code=code, text=text),
    )


def test_failed_self_tests_are_failures_and_a_suspects_retest_confirms_its_crash(tmp_path: Path) -> None:
    """A spare fails its self-test before it joins (the core quarantines it); node-001
    crashes, and after the restart fails the self-test it was given as a suspect; a spare
    that passes is no evidence."""
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(30)
    job.events.append(_self_test(job, "spare-007", "spare", passed=False, ts=job.t))
    job.events.append(_self_test(job, "spare-008", "spare", passed=True, ts=job.t))
    job.steps(5).exit(5, exit_code=1)
    job.replace("node-001")
    job.restart(resumed_from_step=30).steps(3)
    job.events.append(_self_test(job, "node-001", "quarantine", passed=False, ts=job.t))
    _, outputs = run_all(job.events, CorePolicy())
    with Archive(tmp_path / "archive") as db:
        db.write([*job.events, *outputs])
    records = history(tmp_path / "archive")
    assert sorted({(r.node, r.attempt, r.kind) for r in records}) == [
        ("node-001", 0, "crash"),
        ("node-001", 0, "quarantine"),
        ("node-001", 1, "retest"),
        ("spare-007", 0, "quarantine"),  # the core's, on the failed result
        ("spare-007", 0, "self_test"),
    ]
    (retest,) = [r for r in records if r.kind == "retest"]
    assert (
        retest.detail
        == "quarantine self-test: 1 of 2 tests failed on node-001: gemm (local rank 1: 12 wrong)"
    )
    counted = failures(records, LemonPolicy(), job.t)
    assert {n: [(f.attempt, f.kind) for f in fs] for n, fs in counted.items()} == {
        "node-001": [(0, "crash")],
        "spare-007": [(0, "self_test")],
    }
