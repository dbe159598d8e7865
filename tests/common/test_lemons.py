"""The lemon-node rule (trainguard/common/lemons.py), pure: records as the archive's
node_history view gives them (one row per record: a crash's interruption, its Quarantine
event and its QuarantineNode command are three), a policy and the time now."""

from __future__ import annotations

import pytest

from trainguard.common.lemons import DAY_S, LemonPolicy, NodeRecord, failures, lemons

#: 2024-05-20 00:00:00 UTC.
NOW = 1_716_163_200.0


def crash(node: str, run: str, attempt: int, days_ago: float, rank: int = 5) -> list[NodeRecord]:
    """What one crash leaves in the archive: the core's interruption naming the culprit, its
    Quarantine event and its QuarantineNode command (the same time, the same attempt)."""
    ts = NOW - days_ago * DAY_S
    died = f"rank {rank} on {node} died (signal 9) after step 120"
    taken = f"node {node} caused interruption 1f2e3d4c5b6a of run {run} (crash: {died}); out of the pool"
    return [
        NodeRecord(node, run, attempt, ts, "crash", died),
        NodeRecord(node, run, attempt, ts, "quarantine", taken),
        NodeRecord(node, run, attempt, ts, "quarantine", taken),
    ]


def test_three_failures_across_runs_within_the_window_make_a_lemon() -> None:
    records = [
        *crash("node-0007", "run-a", 0, days_ago=21),
        *crash("node-0007", "run-b", 2, days_ago=9, rank=6),
        *crash("node-0007", "run-c", 1, days_ago=1),
        *crash("node-0002", "run-b", 0, days_ago=9),
    ]
    (lemon,) = lemons(records, LemonPolicy(), NOW)
    assert lemon.node == "node-0007"
    assert lemon.runs == ("run-a", "run-b", "run-c")
    assert [(f.run_id, f.attempt, f.kind) for f in lemon.failures] == [
        ("run-a", 0, "crash"),
        ("run-b", 2, "crash"),
        ("run-c", 1, "crash"),
    ]
    assert lemon.reason == (
        "node-0007: 3 failures in 30 days across runs run-a, run-b, run-c: "
        "crash in run-a on 2024-04-29 (rank 5 on node-0007 died (signal 9) after step 120); "
        "crash in run-b on 2024-05-11 (rank 6 on node-0007 died (signal 9) after step 120); "
        "crash in run-c on 2024-05-19 (rank 5 on node-0007 died (signal 9) after step 120)"
    )


def test_two_failures_are_not_a_lemon() -> None:
    records = [*crash("node-0007", "run-a", 0, days_ago=5), *crash("node-0007", "run-b", 0, days_ago=3)]
    assert lemons(records, LemonPolicy(), NOW) == []
    assert [f.run_id for f in failures(records, LemonPolicy(), NOW)["node-0007"]] == ["run-a", "run-b"]
    (lemon,) = lemons(records, LemonPolicy(min_failures=2), NOW)
    assert lemon.reason.startswith("node-0007: 2 failures in 30 days across runs run-a, run-b: ")


def test_a_failure_older_than_the_window_does_not_count() -> None:
    records = [
        *crash("node-0007", "run-a", 0, days_ago=31),  # a day too old
        *crash("node-0007", "run-b", 0, days_ago=12),
        *crash("node-0007", "run-c", 0, days_ago=2),
    ]
    assert lemons(records, LemonPolicy(), NOW) == []
    assert [f.run_id for f in failures(records, LemonPolicy(), NOW)["node-0007"]] == ["run-b", "run-c"]
    (lemon,) = lemons(records, LemonPolicy(window_days=45), NOW)
    assert lemon.reason.startswith("node-0007: 3 failures in 45 days across runs run-a, run-b, run-c: ")


def test_a_released_quarantine_and_a_culprit_left_in_the_pool_do_not_count() -> None:
    """Step 126 failed on node-0007, then on node-0003 at the same step: data or code. The
    core quarantined node-0007 at the first failure and released it at the second; it never
    took node-0003 out (its interruption names it, nothing else does)."""
    ts = NOW - 4 * DAY_S
    released = NodeRecord(
        "node-0007", "run-d", 0, ts + 70, "released",
        "step 126 failed on 2 different nodes: data or code, not node-0007; node-0007 returns to the pool",
    )  # fmt: skip
    second = NodeRecord("node-0003", "run-d", 1, ts + 60, "crash", "rank 9 on node-0003 died (exit 1)")
    records = [
        *crash("node-0007", "run-a", 0, days_ago=20),
        *crash("node-0007", "run-b", 0, days_ago=10),
        *crash("node-0007", "run-d", 0, days_ago=4),
        second,
        released,
    ]
    assert lemons(records, LemonPolicy(), NOW) == []
    found = failures(records, LemonPolicy(), NOW)
    assert [f.run_id for f in found["node-0007"]] == ["run-a", "run-b"]
    assert "node-0003" not in found
    # Without the release, the same records make it a lemon.
    assert [
        lemon.node for lemon in lemons([r for r in records if r is not released], LemonPolicy(), NOW)
    ] == ["node-0007"]


def test_planned_stops_do_not_count() -> None:
    """An eviction (a slow node stopped at a checkpoint) and a drain before a predicted
    failure take the node out on purpose; a crash in the drained attempt still counts."""
    ts = NOW - 3 * DAY_S
    evicted = NodeRecord(
        "node-0007", "run-e", 2, ts, "planned", "eviction: attempt 2 stopped to evict rank 9"
    )
    drained = [
        NodeRecord("node-0007", "run-f", 0, ts, "planned", "drain: P(failure within 1 h) 0.42"),
        NodeRecord("node-0007", "run-f", 0, ts + 5, "quarantine", "node-0007 drained at step 300"),
    ]
    records = [*crash("node-0007", "run-a", 0, days_ago=20), *crash("node-0007", "run-b", 0, days_ago=10)]
    assert lemons([*records, evicted, *drained], LemonPolicy(), NOW) == []
    crashed_first = crash("node-0007", "run-f", 0, days_ago=3.1)
    (lemon,) = lemons([*records, *drained, *crashed_first], LemonPolicy(), NOW)
    assert [(f.run_id, f.kind) for f in lemon.failures] == [
        ("run-a", "crash"),
        ("run-b", "crash"),
        ("run-f", "crash"),
    ]


def test_one_interruption_is_one_failure_however_many_records_it_left() -> None:
    """A crash's three records, stored twice (a redelivery), and its node's failed retest
    in the next attempt (a quarantined suspect's known-answer test): one failure."""
    once = crash("node-0007", "run-a", 0, days_ago=2)
    retest = NodeRecord(
        "node-0007", "run-a", 1, NOW - 2 * DAY_S + 40, "retest",
        "quarantine self-test: 1 of 2 tests failed on node-0007: gemm (local rank 1)",
    )  # fmt: skip
    found = failures([*once, *once, retest], LemonPolicy(), NOW)
    assert [(f.run_id, f.attempt, f.kind) for f in found["node-0007"]] == [("run-a", 0, "crash")]
    # Two attempts of one run are two failures (a lost host readmitted, lost again).
    again = crash("node-0007", "run-a", 3, days_ago=1.5)
    assert len(failures([*once, retest, *again], LemonPolicy(), NOW)["node-0007"]) == 2


def test_failed_self_tests_count_as_failures() -> None:
    """A spare that failed its self-test before it joined (the core quarantines it: the
    same attempt), and a retest with no failure of the node before it in that run."""
    ts = NOW - DAY_S
    spare = [
        NodeRecord("spare-0001", "run-a", 0, ts, "self_test", "spare self-test: gemm wrong on local rank 0"),
        NodeRecord("spare-0001", "run-a", 0, ts, "quarantine", "node spare-0001 failed its spare self-test"),
    ]
    lone = NodeRecord("spare-0001", "run-b", 2, ts + 9, "retest", "quarantine self-test: collective wrong")
    records = [*spare, lone, *crash("spare-0001", "run-c", 0, days_ago=0.5)]
    (lemon,) = lemons(records, LemonPolicy(), NOW)
    assert [(f.run_id, f.kind) for f in lemon.failures] == [
        ("run-a", "self_test"),
        ("run-b", "self_test"),
        ("run-c", "crash"),
    ]
    assert "self-test in run-a on 2024-05-19 (spare self-test: gemm wrong on local rank 0)" in lemon.reason


def test_records_that_are_no_evidence_are_ignored_and_the_rule_can_be_off() -> None:
    records = [
        *crash("node-0007", "run-a", 0, days_ago=3),
        *crash("node-0007", "run-b", 0, days_ago=2),
        NodeRecord("node-0007", "run-c", 0, NOW - DAY_S, "node_excluded", "kept out of run-c"),
        NodeRecord("", "run-c", 0, NOW - DAY_S, "crash", "culprit unknown"),
    ]
    assert lemons(records, LemonPolicy(), NOW) == []
    assert lemons([*records, *crash("node-0007", "run-c", 0, 1)], LemonPolicy(min_failures=0), NOW) == []
    with pytest.raises(ValueError, match="window_days"):
        LemonPolicy(window_days=0)


def test_a_long_history_keeps_the_reason_within_a_reasons_limit() -> None:
    records = [r for i in range(60) for r in crash("node-0007", f"run-{i:02d}", 0, days_ago=20 - i / 4)]
    (lemon,) = lemons(records, LemonPolicy(), NOW)
    assert len(lemon.failures) == 60 and len(lemon.runs) == 60
    assert len(lemon.reason) <= 2000 and lemon.reason.endswith("...")
