"""The documented queries (docs/queries.md, sinks/queries.py) on a real archive file built from
two simulated runs under the pure core (archive_scenarios.py): each query runs and returns
what the scenarios' ground truth says. Expectations come from the planned and fired faults,
the scenario and policy settings, and the raw telemetry, never from the views themselves.
Also: the seed's data-model views stay idempotent and order-independent, and the docs
cannot drift from the registry."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from trainguard.producers.simulator.scenario import SlowFault
from trainguard.producers.simulator.workload import NVLINK_WIDTH
from trainguard.schemas import (
    CheckpointFailed,
    CheckpointValidated,
    CheckpointWritten,
    CrossRankCheck,
    GpuHealth,
    InterruptionRecovered,
    RankExit,
    Reason,
    ReasonCode,
    Record,
    RestartPhases,
    RingCheck,
    RunStarted,
    SdcMismatch,
    SdcSelfCheck,
    StepTiming,
)
from trainguard.sinks.archive_schema import KEYS, VIEWS
from trainguard.sinks.archive_store import Archive, Db, query
from trainguard.sinks.queries import QUERIES, run_query

from .archive_scenarios import (
    DAY,
    ECC_CORRECTED,
    ECC_UNCORRECTED,
    MIDNIGHT,
    POLICY,
    SimulatedRun,
    fixture_runs,
    write_archive,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "queries.md"

#: What the core does about each fault that strikes (a slow rank only once it is flagged).
CAUSE = {"crash": "crash", "hang": "hang", "slow": "eviction", "bitflip": "sdc"}
#: Faults whose node the core quarantines (processors/core/decisions/quarantine.py; the SDC detector).
QUARANTINED = {"crash", "hang", "bitflip"}


# --------------------------------------------------------------------------- ground truth


@dataclass
class Attempt:
    """One attempt of a run, as its telemetry shows it."""

    resumed_from: int = -1
    started_at: float = 0.0
    step_done: dict[int, float] = field(default_factory=dict)  # step -> completion time
    first_exit: float = math.inf  # a rank exited: a checkpoint not yet durable fails
    ended_at: float = 0.0  # the last rank's exit

    @property
    def last_step(self) -> int:
        return max(self.step_done)


def attempts(run: SimulatedRun) -> dict[int, Attempt]:
    out: dict[int, Attempt] = {}
    for e in run.telemetry:
        a = out.setdefault(e.attempt, Attempt())
        if isinstance(e, RunStarted):
            a.resumed_from, a.started_at = e.resumed_from_step, e.ts
        elif isinstance(e, StepTiming):
            a.step_done[e.step] = max(e.ts, a.step_done.get(e.step, 0.0))
        elif isinstance(e, RankExit):
            a.first_exit, a.ended_at = min(a.first_exit, e.ts), max(a.ended_at, e.ts)
    return out


@dataclass(frozen=True)
class Interrupt:
    """A fault that stopped an attempt: what the core should call it, and what it cost."""

    run_id: str
    cause: str
    node: str
    rank: int
    step: int
    attempt: int
    lost_steps: int  # the attempt's last completed step minus the next attempt's resume step


#: The fewest slow steps either straggler detector needs: the per-step rule's streak, or
#: just over half the windowed detector's block (its median moves).
SLOW_STEPS_BEFORE_A_FLAG = min(POLICY.straggler.consecutive_steps, POLICY.slowdown.block_steps // 2)


def _flagged(run: SimulatedRun, rank: int) -> bool:
    """A slow window long enough for a straggler detector to flag it: longer than the per-step
    rule's streak, or than half the windowed detector's block (it moves the block's median)."""
    (slow,) = [f for f in run.scenario.faults if isinstance(f, SlowFault) and f.rank == rank]
    assert slow.to_step is not None
    return slow.to_step - slow.from_step > SLOW_STEPS_BEFORE_A_FLAG


def interrupts(run: SimulatedRun) -> list[Interrupt]:
    by_attempt = attempts(run)
    out = []
    for fault in run.fired:
        if fault.kind == "slow" and not _flagged(run, fault.rank):
            continue
        # a slow rank strikes in the attempt that is later stopped to evict it
        stopped, resumed = by_attempt[fault.attempt], by_attempt[fault.attempt + 1]
        lost = stopped.last_step - resumed.resumed_from
        out.append(
            Interrupt(run.run_id, CAUSE[fault.kind], fault.node, fault.rank, fault.step, fault.attempt, lost)
        )
    return out


@dataclass(frozen=True)
class Truth:
    runs: dict[str, SimulatedRun]
    interrupts: list[Interrupt]

    def of(self, run_id: str) -> list[Interrupt]:
        return [i for i in self.interrupts if i.run_id == run_id]

    def telemetry(self, cls: type[Record]) -> list[Any]:
        return [e for run in self.runs.values() for e in run.telemetry if isinstance(e, cls)]


def expected_checkpoints(run: SimulatedRun) -> dict[tuple[int, int], str]:
    """(attempt, step) -> 'validated' or 'failed': every multiple of checkpoint_every an attempt
    completed; failed when a rank exited before that checkpoint's write could finish."""
    sc = run.scenario
    out = {}
    for number, a in attempts(run).items():
        for step in range(a.resumed_from + 1, a.last_step + 1):
            if step > 0 and step % sc.checkpoint_every == 0:
                done = a.step_done[step]
                durable = a.first_exit - done >= sc.checkpoint_write_s - 0.01
                out[(number, step)] = "validated" if durable else "failed"
    return out


def day_of(ts: float) -> date:
    return date(1970, 1, 1) + timedelta(days=int(ts // DAY))


def utc(ts: float) -> datetime:
    return datetime(1970, 1, 1) + timedelta(microseconds=round(ts * 1e6))


def at(found: datetime, ts: float) -> bool:
    """The archive's utc(ts) shows this event time (to the microsecond it rounds to)."""
    return abs((found - utc(ts)).total_seconds()) <= 2e-6


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def truth() -> Truth:
    runs = {run.run_id: run for run in fixture_runs()}
    return Truth(runs, [i for run in runs.values() for i in interrupts(run)])


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_archive(tmp_path_factory.mktemp("queries") / "archive", fixture_runs())


def rows(archive: Path, name: str) -> list[dict[str, Any]]:
    return run_query(archive, name)


def test_the_scenarios_struck_every_fault_they_plan(truth: Truth) -> None:
    """The premise of every test below: one interruption per fault kind, node-0003 in both runs."""
    assert [(i.run_id, i.cause, i.node) for i in truth.interrupts] == [
        ("run-a", "crash", "node-0003"),
        ("run-a", "hang", "node-0001"),
        ("run-a", "eviction", "node-0002"),
        ("run-a", "sdc", "node-0000"),
        ("run-b", "crash", "node-0003"),
    ]


def test_every_documented_query_has_a_test() -> None:
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(QUERIES) <= tested, set(QUERIES) - tested


# --------------------------------------------------------------------------- one test per query


def test_interruptions_by_cause_node(archive: Path, truth: Truth) -> None:
    found = rows(archive, "interruptions_by_cause_node")
    expected = Counter((i.cause, i.node) for i in truth.interrupts)
    assert {(r["cause"], r["node_id"]): r["interruptions"] for r in found} == dict(expected)
    assert [r["interruptions"] for r in found] == sorted((r["interruptions"] for r in found), reverse=True)
    sc = truth.runs["run-a"].scenario
    for r in found:
        mine = [i for i in truth.interrupts if (i.cause, i.node) == (r["cause"], r["node_id"])]
        assert r["runs"] == len({i.run_id for i in mine})
        assert r["lost_steps"] == sum(i.lost_steps for i in mine)
        # every restart: the launcher's delay, then one step (an eviction also waits for validation)
        restart = len(mine) * (sc.restart_delay_s + sc.step_time_s)
        assert r["restart_s"] == pytest.approx(restart, abs=0.3 * len(mine))
        assert r["gpu_hours"] > 0


def test_nodes_that_killed_more_than_one_job(archive: Path, truth: Truth) -> None:
    runs_by_node: dict[str, set[str]] = {}
    for i in truth.interrupts:
        if i.cause in ("crash", "hang", "sdc"):
            runs_by_node.setdefault(i.node, set()).add(i.run_id)
    expected = {node: sorted(runs) for node, runs in runs_by_node.items() if len(runs) > 1}
    assert expected == {"node-0003": ["run-a", "run-b"]}  # the premise: one node, two jobs
    (row,) = rows(archive, "nodes_that_killed_more_than_one_job")
    assert row == {
        "node_id": "node-0003", "jobs_killed": 2, "run_ids": ["run-a", "run-b"], "causes": ["crash"],
        "quarantined": True, "quarantines": 2,
    }  # fmt: skip
    # the evicted straggler's node was slow, not a killer: it is not in node_kill at all
    every = {r["node_id"]: r["jobs_killed"] for r in query(archive, "SELECT * FROM node_kill")}
    assert every == {node: len(runs) for node, runs in runs_by_node.items()}


def test_restart_seconds_by_phase(archive: Path, truth: Truth) -> None:
    found = {(r["source"], r["phase"]): r for r in rows(archive, "restart_seconds_by_phase")}
    assert list(found) == [("core", "detect"), ("core", "reschedule"), ("core", "startup")]
    recovered = [
        d for run in truth.runs.values() for d in run.derived if isinstance(d, InterruptionRecovered)
    ]
    relaunches = sum(1 for e in truth.telemetry(RunStarted) if e.attempt > 0)
    for (_, phase), r in found.items():
        assert r["restarts"] == relaunches == len(truth.interrupts)
        assert r["total_s"] == pytest.approx(sum(d.phases[phase] for d in recovered), abs=0.01)
    # detection is instant for all but the hang, which waits out the step timeout (its floor here)
    hangs = sum(1 for i in truth.interrupts if i.cause == "hang")
    assert found[("core", "detect")]["total_s"] == pytest.approx(hangs * POLICY.hang.floor_s, abs=0.1)
    assert found[("core", "detect")]["max_s"] == pytest.approx(POLICY.hang.floor_s, abs=0.1)
    # reschedule + startup is the whole restart
    restart = sum(d.restart_s for d in recovered)
    assert found[("core", "reschedule")]["total_s"] + found[("core", "startup")]["total_s"] == pytest.approx(
        restart, abs=0.02
    )
    assert sum(r["share"] for r in found.values()) == pytest.approx(1.0, abs=0.002)


def _restart_phases(n: int, phases: dict[str, float]) -> RestartPhases:
    return RestartPhases(
        event_id=f"rp-{n}", run_id="r", attempt=n + 1, rank=-1, node="", step=10, ts=MIDNIGHT + n,
        interrupted_attempt=n, cause="crash", phases=phases,
    )  # fmt: skip


def test_the_launchers_phases_are_their_own_source(tmp_path: Path) -> None:
    """restart_by_phase keeps the launcher's finer phases apart from the core's (never summed)."""
    phases = [{"detect": 0.5, "reschedule": 1.0, "process_start": 2.0}, {"detect": 1.5, "reschedule": 3.0}]
    records = [_restart_phases(n, p) for n, p in enumerate(phases)]
    with Archive(tmp_path / "a") as db:
        db.write(records)
        found = query(db, "SELECT * FROM restart_by_phase ORDER BY source, phase_order")
    assert [(r["source"], r["phase"], r["restarts"], r["total_seconds"]) for r in found] == [
        ("launcher", "detect", 2, 2.0),
        ("launcher", "reschedule", 2, 4.0),
        ("launcher", "process_start", 1, 2.0),
    ]
    assert found[1]["share"] == pytest.approx(4.0 / 8.0)


def test_restart_cost_by_cause(archive: Path, truth: Truth) -> None:
    found = {r["cause"]: r for r in rows(archive, "restart_cost_by_cause")}
    assert {c: r["interruptions"] for c, r in found.items()} == dict(
        Counter(i.cause for i in truth.interrupts)
    )
    for cause, r in found.items():
        assert r["lost_steps"] == sum(i.lost_steps for i in truth.interrupts if i.cause == cause)
        assert r["mean_detect_s"] == pytest.approx(POLICY.hang.floor_s if cause == "hang" else 0.0, abs=0.1)
    # the hang cost most: it re-did the most work per GPU-hour AND waited out the timeout
    assert next(iter(found)) == "hang"


def test_goodput_by_day(archive: Path, truth: Truth) -> None:
    found = rows(archive, "goodput_by_day")
    every = POLICY.goodput.report_every_s
    expected = []
    for run in truth.runs.values():
        start, end = run.start_ts, max(e.ts for e in run.telemetry)
        for day in sorted({day_of(start), day_of(end)}):
            day_end = (day - date(1970, 1, 1)).days * DAY + DAY
            # reports follow the first event after each multiple of report_every_s
            last_report = start + every * (math.ceil((min(end, day_end) - start) / every) - 1)
            written = sum(
                1 for e in run.telemetry if isinstance(e, CheckpointWritten) and e.ts <= last_report
            )
            expected.append(
                (day, run.run_id, last_report - start, written * run.scenario.checkpoint_blocking_s)
            )
    assert [(r["day"], r["run_id"]) for r in found] == [(d, run_id) for d, run_id, _, _ in expected]
    assert [d for d, _, _, _ in expected] == [date(2023, 11, 14), date(2023, 11, 15), date(2023, 11, 15)]
    for r, (_, _, elapsed, checkpoint) in zip(found, expected, strict=True):
        assert r["elapsed_s"] == pytest.approx(elapsed, abs=0.6)
        assert r["checkpoint_s"] == pytest.approx(checkpoint, abs=0.006)
        overhead = (r["checkpoint_s"] + r["lost_s"] + r["restart_s"]) / r["elapsed_s"]
        pace = 1 - r["straggler_s"] / (r["elapsed_s"] - r["restart_s"])
        assert r["goodput"] == pytest.approx((1 - overhead) * pace, abs=0.01)
        assert r["worst_hour"] <= r["goodput"] + 1e-9 and 0 < r["goodput"] < 1
    # the straggler struck after midnight in run-a: only its second day pays for it
    (slow,) = [f for f in truth.runs["run-a"].fired if f.kind == "slow"]
    assert slow.ts > MIDNIGHT
    assert [r["straggler_s"] > 0 for r in found] == [False, True, False]
    # day one held one interruption, the crash: one restart
    sc = truth.runs["run-a"].scenario
    assert found[0]["restart_s"] == pytest.approx(sc.restart_delay_s + sc.step_time_s, abs=0.15)


def test_runs(archive: Path, truth: Truth) -> None:
    found = rows(archive, "runs")
    days = {r["run_id"]: r for r in rows(archive, "goodput_by_day")}  # each run's last day
    assert [r["run_id"] for r in found] == ["run-a", "run-b"]
    for r in found:
        run = truth.runs[r["run_id"]]
        assert r["state"] == "finished"
        assert r["world_size"] == run.scenario.world_size
        assert r["attempts"] == 1 + len(truth.of(r["run_id"]))
        assert at(r["started_at"], run.start_ts)
        assert at(r["last_seen"], max(e.ts for e in run.telemetry))
        # a run shorter than every window: its 7-day goodput is its last day's
        assert r["goodput"] == days[r["run_id"]]["goodput"]


def test_timeline(archive: Path, truth: Truth) -> None:
    found = rows(archive, "timeline")
    assert [(r["run_id"], r["cause"], r["node_id"]) for r in found] == [
        (i.run_id, i.cause, i.node) for i in truth.interrupts
    ]
    for r, i in zip(found, truth.interrupts, strict=True):
        assert r["lost_steps"] == i.lost_steps
        fired = next(f for f in truth.runs[i.run_id].fired if (f.rank, f.attempt) == (i.rank, i.attempt))
        assert utc(fired.ts) <= r["at"]
        if i.cause != "eviction":  # detected at once, or after the step timeout (an eviction waits)
            assert r["at"] <= utc(fired.ts + POLICY.hang.floor_s + 1)
        decided = set(r["decisions"])
        assert ("quarantine_node" in decided) == (i.cause in ("crash", "hang", "sdc"))
        assert ("rollback" in decided) == (i.cause == "sdc")
        assert ("evict_rank" in decided) == (i.cause == "eviction")


def test_checkpoints(archive: Path, truth: Truth) -> None:
    found = rows(archive, "checkpoints")
    expected = {
        (run_id, attempt, step): state
        for run_id, run in truth.runs.items()
        for (attempt, step), state in expected_checkpoints(run).items()
    }
    assert {(r["run_id"], r["attempt"], r["step"]): r["state"] for r in found} == expected
    assert [(r["run_id"], r["step"], r["attempt"]) for r in found] == sorted(
        (r["run_id"], r["step"], r["attempt"]) for r in found
    )
    sc = truth.runs["run-a"].scenario
    for r in found:
        if r["state"] == "validated":
            assert r["validate_s"] == pytest.approx(sc.checkpoint_validate_s, abs=0.01)
            assert -1 <= r["last_verified_step"] <= r["step"]
            assert (r["ranks_written"], r["shards"]) == (1, sc.world_size) and r["bytes"] > 0
        else:  # failed before its write was durable: nothing written
            assert r["last_verified_step"] is None and r["ranks_written"] is None


def test_resume_points(archive: Path, truth: Truth) -> None:
    found = rows(archive, "resume_points")
    assert [r["run_id"] for r in found] == ["run-a", "run-b"]
    for r in found:
        run = truth.runs[r["run_id"]]
        validated = [step for (_, step), state in expected_checkpoints(run).items() if state == "validated"]
        assert r["step"] == max(validated) and r["validated_checkpoints"] == len(validated)
        assert r["uri"].endswith(f"{max(validated):06d}")
        assert r["last_verified_step"] <= r["step"]


def test_failed_checkpoints(archive: Path, truth: Truth) -> None:
    found = rows(archive, "failed_checkpoints")
    expected = sorted(
        (run_id, attempt, step)
        for run_id, run in truth.runs.items()
        for (attempt, step), state in expected_checkpoints(run).items()
        if state == "failed"
    )
    assert [(r["run_id"], r["attempt"], r["step"]) for r in found] == expected
    assert expected == [("run-a", 0, 75), ("run-a", 3, 300)]  # the crash's, and the rollback's
    assert "rank 13 died" in found[0]["error"] and "torn down" in found[1]["error"]
    a = attempts(truth.runs["run-a"])
    assert at(found[0]["failed_at"], a[0].first_exit) and at(found[1]["failed_at"], a[3].first_exit)


def test_quarantines(archive: Path, truth: Truth) -> None:
    found = rows(archive, "quarantines")
    fired = [(run.run_id, f) for run in truth.runs.values() for f in run.fired if f.kind in QUARANTINED]
    assert [(r["node_id"], r["run_id"], r["attempt"]) for r in found] == [
        (f.node, run_id, f.attempt) for run_id, f in fired
    ]
    for r, (_, f) in zip(found, fired, strict=True):
        assert r["rank"] == f.rank
        if f.kind == "bitflip":  # the SDC detector's command: no Quarantine event behind it
            assert (r["source"], r["reason_code"], r["step"]) == (
                "quarantine_node",
                "self_check_mismatch",
                f.step,
            )
        else:  # the core's Quarantine event, after the step the fault struck in
            assert (r["source"], r["reason_code"], r["step"]) == ("quarantine", "quarantine", f.step - 1)


def test_sdc_checks_by_method(archive: Path, truth: Truth) -> None:
    found = {r["method"]: r for r in rows(archive, "sdc_checks_by_method")}
    selfs, rings = truth.telemetry(SdcSelfCheck), truth.telemetry(RingCheck)
    flips = sum(1 for run in truth.runs.values() for f in run.fired if f.kind == "bitflip")
    assert truth.telemetry(CrossRankCheck) == []  # the scheduler runs the ring, not pairs
    assert found == {
        "ring": {
            "method": "ring", "checks": len(rings), "ranks_checked": len({e.rank for e in rings}),
            "passed": len(rings), "failed": 0,  # no wrong GPU in the scenarios
        },
        "self_check": {
            "method": "self_check", "checks": len(selfs), "ranks_checked": len({e.rank for e in selfs}),
            "passed": len(selfs) - flips, "failed": flips,
        },
    }  # fmt: skip
    assert found["self_check"]["ranks_checked"] == truth.runs["run-a"].scenario.world_size  # rotation


def test_sdc_failures(archive: Path, truth: Truth) -> None:
    (flip,) = [f for f in truth.runs["run-a"].fired if f.kind == "bitflip"]
    (row,) = rows(archive, "sdc_failures")
    assert row == {
        "run_id": "run-a", "attempt": flip.attempt, "step": flip.step, "method": "self_check",
        "microbatch_id": f"mb-{flip.step:06d}-r{flip.rank}", "culprit_rank": flip.rank,
        "culprit_node": flip.node, "ranks": [flip.rank],
    }  # fmt: skip


def test_hot_gpus(archive: Path, truth: Truth) -> None:
    (thermal,) = [f for f in truth.runs["run-a"].scenario.faults if isinstance(f, SlowFault)]
    node = truth.runs["run-a"].scenario.node_of(thermal.rank or 0)
    (row,) = rows(archive, "hot_gpus")
    readings = [
        e for e in truth.telemetry(GpuHealth) if (e.run_id, e.rank, e.node) == ("run-a", thermal.rank, node)
    ]
    assert (row["run_id"], row["rank"], row["node_id"]) == ("run-a", thermal.rank, node)
    assert row["readings"] == len(readings)
    assert row["max_temp_c"] >= 85 and 0 < row["throttled"] < row["readings"] and row["power_capped"] == 0
    # throttled: the readings while the slow fault ran on its original node
    stopped = attempts(truth.runs["run-a"])
    slow_from = next(f.ts for f in truth.runs["run-a"].fired if f.kind == "slow")
    (evicted_attempt,) = [i.attempt for i in truth.of("run-a") if i.cause == "eviction"]
    during = [e for e in readings if slow_from <= e.ts <= stopped[evicted_attempt].ended_at]
    assert row["throttled"] == pytest.approx(len(during), abs=1)


def test_link_and_ecc_errors(archive: Path, truth: Truth) -> None:
    found = rows(archive, "link_and_ecc_errors")
    (link,) = [f for f in truth.runs["run-b"].scenario.faults if isinstance(f, SlowFault)]
    (crash,) = [f for f in truth.runs["run-b"].fired if f.kind == "crash"]
    assert [(r["run_id"], r["rank"], r["node_id"]) for r in found] == [
        ("run-b", link.rank, truth.runs["run-b"].scenario.node_of(link.rank or 0)),
        ("run-b", crash.rank, crash.node),
    ]
    narrow, ecc = found
    assert (narrow["min_nvlink_width"], narrow["expected_width"]) == (NVLINK_WIDTH // 2, NVLINK_WIDTH)
    assert narrow["ecc_uncorrected"] == 0 and narrow["nvlink_retries"] > 0
    assert (ecc["ecc_corrected"], ecc["ecc_uncorrected"], ecc["min_nvlink_width"]) == (
        ECC_CORRECTED, ECC_UNCORRECTED, NVLINK_WIDTH
    )  # fmt: skip


def test_stragglers(archive: Path, truth: Truth) -> None:
    (row,) = rows(archive, "stragglers")
    (slow,) = [f for f in truth.runs["run-a"].scenario.faults if isinstance(f, SlowFault)]
    (fired,) = [f for f in truth.runs["run-a"].fired if f.kind == "slow"]
    assert (row["run_id"], row["rank"], row["node"]) == ("run-a", slow.rank, fired.node)
    assert row["slowdown"] == pytest.approx(slow.factor, abs=0.05)
    assert row["flagged_at_step"] >= slow.from_step + SLOW_STEPS_BEFORE_A_FLAG - 1
    (planned,) = [t for t in truth.runs["run-a"].scenario.truth() if t.kind == "slow"]
    assert (row["diagnosis"], row["decision"]) == (str(planned.diagnosis), "evict")


# --------------------------------------------------------------------------- idempotency


def test_node_history(archive: Path, truth: Truth) -> None:
    """Each fault's records against its node: the interruption naming it, the core's
    Quarantine event and QuarantineNode command (the SDC detector's command alone); the
    eviction is a planned stop. Counted by the lemon rule: one failure per fault but the
    eviction, node-0003's in both runs."""
    from trainguard.common.lemons import LemonPolicy, failures
    from trainguard.sinks.node_history import history

    found = Counter(
        (r["node_id"], r["run_id"], r["attempt"], r["kind"]) for r in rows(archive, "node_history")
    )
    expected: Counter[tuple[str, str, int, str]] = Counter()
    for i in truth.interrupts:
        if i.cause == "eviction":
            expected[(i.node, i.run_id, i.attempt, "planned")] += 1
            continue
        expected[(i.node, i.run_id, i.attempt, i.cause)] += 1
        expected[(i.node, i.run_id, i.attempt, "quarantine")] += 1 if i.cause == "sdc" else 2
    assert found == expected
    counted = failures(history(archive), LemonPolicy(), MIDNIGHT + DAY)
    assert {node: [(f.run_id, f.kind) for f in fs] for node, fs in counted.items()} == {
        i.node: [(j.run_id, j.cause) for j in truth.interrupts if j.node == i.node]
        for i in truth.interrupts
        if i.cause != "eviction"
    }
    assert len(counted["node-0003"]) == 2


def _relations(db: Db) -> dict[str, int]:
    """Row counts of every table and view."""
    # A keyless table holds a row per batch (run_activity_batches): its view folds them.
    names = [*(t for t, key in KEYS.items() if key is not None), "run_activity", *VIEWS]
    return {name: query(db, f"SELECT count(*) AS n FROM {name}")[0]["n"] for name in names}


def _answers(db: Db) -> dict[str, list[dict[str, Any]]]:
    return {name: run_query(db, name) for name in QUERIES}


def test_views_lists_every_view(tmp_path: Path) -> None:
    """VIEWS names every view a reader sees besides the tables' own (and run_activity, which
    folds its table's batches)."""
    with Archive(tmp_path / "a") as db:
        found = db.connection.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
    views = {v for (v,) in found if not v.startswith("_lake_")} - set(KEYS) - {"run_activity"}
    assert sorted(views) == sorted(VIEWS)


def test_writing_the_same_records_twice_changes_no_view(tmp_path: Path) -> None:
    path = write_archive(tmp_path / "a", fixture_runs())
    with Archive(path) as db:
        counts, answers = _relations(db), _answers(db)
        assert all(counts[v] > 0 for v in VIEWS if v != "restart_phase"), counts  # no launcher here
        db.write(r for run in fixture_runs() for r in run.records())  # redelivered
        assert _relations(db) == counts
        assert _answers(db) == answers


def test_arrival_order_does_not_change_any_answer(tmp_path: Path, archive: Path) -> None:
    """Another consumer order (newest first, other transaction sizes) gives the same answers:
    a QuarantineNode command stored before its Quarantine event, a validation before its write."""
    reverse = write_archive(tmp_path / "reverse", fixture_runs(), chunk=777, reverse=True)
    assert _answers(reverse) == _answers(archive)
    assert _relations(reverse) == _relations(archive)


def test_a_quarantine_command_before_its_event_is_one_row(tmp_path: Path, truth: Truth) -> None:
    run = truth.runs["run-b"]
    (event,) = [d for d in run.derived if d.KIND == "quarantine"]
    (command,) = [c for c in run.commands if c.KIND == "quarantine_node"]
    with Archive(tmp_path / "a") as db:
        db.write([command])
        first = query(db, "SELECT source, node_id, command_id FROM quarantine")
        db.write([event, command])
        second = query(db, "SELECT source, node_id, command_id FROM quarantine")
    assert first == [{"source": "quarantine_node", "node_id": event.node, "command_id": command.command_id}]
    assert second == [{"source": "quarantine", "node_id": event.node, "command_id": command.command_id}]


def test_a_released_quarantine_is_no_quarantine(tmp_path: Path) -> None:
    from harness.streams import Job
    from trainguard.processors.core import CorePolicy, run_all

    # Step 126 fails on node-001, then on node-002: data or code; node-001 is released.
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    job.exit(5, exit_code=1)
    job.replace("node-001")
    job.restart(resumed_from_step=120).steps(5)
    job.exit(9, exit_code=1)
    _, outputs = run_all(job.events, CorePolicy())
    kinds = [o.KIND for o in outputs]
    assert "quarantine" in kinds and "quarantine_released" in kinds
    first = kinds.index("quarantine_released")
    with Archive(tmp_path / "a") as db:
        db.write(outputs[:first])
        assert [r["node_id"] for r in query(db, "SELECT node_id FROM quarantine")] == ["node-001"]
        db.write(outputs[first:])
        assert query(db, "SELECT node_id FROM quarantine") == []
        assert query(db, "SELECT * FROM node_quarantine") == []


def _cross_check(n: int, values: list[float]) -> CrossRankCheck:
    return CrossRankCheck(
        event_id=f"xr-{n}", run_id="r", attempt=0, rank=0, node="n0", step=100 + n, ts=MIDNIGHT + n,
        microbatch_id=f"mb-{n}", ranks=[0, 5, 9][: len(values)], values=values,
    )  # fmt: skip


def _cross_mismatch(n: int, rank: int) -> SdcMismatch:
    return SdcMismatch(
        event_id=f"mm-{n}", run_id="r", attempt=0, rank=rank, node=f"n{rank}", step=100 + n, ts=MIDNIGHT + n,
        reason=Reason(code=ReasonCode.CROSS_RANK_MISMATCH, text="differ"), caused_by=[f"xr-{n}"],
        method="cross_rank", microbatch_id=f"mb-{n}", tolerance=1e-6, deviation=1e-3,
    )  # fmt: skip


def test_a_cross_rank_check_fails_when_the_processor_says_so(tmp_path: Path) -> None:
    """Cross-rank values carry no verdict: the processor's SdcMismatch is it. A mismatch whose
    check is not archived is a failed check of its own."""
    with Archive(tmp_path / "a") as db:
        db.write([_cross_check(1, [2.0, 2.0]), _cross_check(2, [2.0, 2.1, 2.0]), _cross_mismatch(2, 5)])
        db.write([_cross_mismatch(3, -1)])
        found = query(
            db, "SELECT step, passed, culprit_rank, culprit_node, ranks FROM sdc_check ORDER BY step"
        )
    assert found == [
        {"step": 101, "passed": True, "culprit_rank": None, "culprit_node": None, "ranks": [0, 5]},
        {"step": 102, "passed": False, "culprit_rank": 5, "culprit_node": "n5", "ranks": [0, 5, 9]},
        {"step": 103, "passed": False, "culprit_rank": -1, "culprit_node": "n-1", "ranks": None},
    ]


def test_a_ring_check_fails_for_the_rank_the_processor_named(tmp_path: Path) -> None:
    """One row per rank per ring check; only the named device's fails (its neighbours,
    whose comparisons with it failed too, pass: the processor explained them)."""
    reports = [
        RingCheck(
            event_id=f"ring-{r}", run_id="r", attempt=0, rank=r, node=f"n{r // 2}", step=200, ts=MIDNIGHT + r,
            check_id="ring-a0-s200", own_value=2.0 + (r == 1) * 1e-3, peer_rank=(r + 2) % 6, peer_value=2.0,
        )
        for r in range(6)
    ]  # fmt: skip
    named = SdcMismatch(
        event_id="mm-ring", run_id="r", attempt=0, rank=1, node="n0", step=200, ts=MIDNIGHT + 6,
        reason=Reason(code=ReasonCode.CROSS_RANK_MISMATCH, text="both neighbours"), caused_by=["ring-1"],
        method="ring", microbatch_id="ring-a0-s200/r1", tolerance=1e-6, deviation=5e-4,
    )  # fmt: skip
    with Archive(tmp_path / "a") as db:
        db.write([*reports, named])
        found = query(db, "SELECT rank, passed, culprit_rank, ranks FROM sdc_check ORDER BY rank")
    assert found == [
        {"rank": r, "passed": r != 1, "culprit_rank": 1 if r == 1 else None, "ranks": [r, (r + 2) % 6]}
        for r in range(6)
    ]


# --------------------------------------------------------------------------- checkpoint state


def _ckpt(cls: type[Record], rank: int, ts: float, **fields: Any) -> Record:
    return cls(
        event_id=f"{cls.__name__}-{rank}-{ts}", run_id="r", attempt=0, rank=rank, node=f"n{rank}", step=10,
        ts=MIDNIGHT + ts, checkpoint_step=10, uri="file:///ck/10", **fields,
    )  # fmt: skip


def _written(rank: int, ts: float, nbytes: int = 100) -> Record:
    return _ckpt(
        CheckpointWritten, rank, ts, shards=1, digest=f"d{rank}", bytes=nbytes, blocking_s=0.1 * (rank + 1),
        write_s=1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("events", "state"),
    [
        pytest.param(["w0", "w1"], "written", id="written-awaiting-validation"),
        pytest.param(["w0", "w1", "v"], "validated", id="validated"),
        pytest.param(["v", "w1", "w0"], "validated", id="validation-archived-first"),
        pytest.param(["w0", "f", "w1", "v"], "validated", id="failed-write-retried-and-validated"),
        pytest.param(["w0", "f"], "failed", id="write-failed"),
        pytest.param(["w0", "w1", "v", "f_late"], "failed", id="rejected-after-validation"),
    ],
)
def test_a_checkpoints_state_is_its_newest_verdict(tmp_path: Path, events: list[str], state: str) -> None:
    made = {
        "w0": _written(0, 1.0),
        "w1": _written(1, 3.0),
        "f": _ckpt(CheckpointFailed, -1, 2.0, error="disk full"),
        "v": _ckpt(CheckpointValidated, -1, 4.0, last_verified_step=8),
        "f_late": _ckpt(CheckpointFailed, -1, 5.0, error="digest mismatch on load"),
    }
    with Archive(tmp_path / "a") as db:
        for name in events:
            db.write([made[name], made[name]])
        (row,) = query(db, "SELECT * FROM checkpoint")
    assert row["state"] == state and row["validated"] == (state == "validated")
    written = [name for name in events if name.startswith("w")]
    assert row["ranks_written"] == len(written) and row["bytes"] == 100 * len(written)
    assert row["blocking_s"] == pytest.approx(max(0.1 * (int(n[1]) + 1) for n in written))


def test_a_ranks_rewritten_part_counts_once(tmp_path: Path) -> None:
    with Archive(tmp_path / "a") as db:
        db.write([_written(0, 1.0, nbytes=100), _written(0, 2.0, nbytes=120), _written(1, 1.5)])
        (row,) = query(db, "SELECT ranks_written, shards, bytes, digests, written_at FROM checkpoint")
    assert row == {
        "ranks_written": 2, "shards": 2, "bytes": 220, "digests": ["d0", "d1"], "written_at": MIDNIGHT + 2.0
    }  # fmt: skip


# --------------------------------------------------------------------------- the docs


_SECTION = re.compile(
    r"^### \d+\. `(?P<name>[a-z_]+)`\n+\*\*Question:\*\* (?P<question>.+?)\n+```sql\n(?P<sql>.*?)\n```",
    re.MULTILINE | re.DOTALL,
)


def test_the_docs_show_exactly_the_registered_queries() -> None:
    documented = [(m["name"], m["question"], m["sql"]) for m in _SECTION.finditer(DOCS.read_text())]
    registered = [(q.name, q.question, q.sql) for q in QUERIES.values()]
    assert [d[0] for d in documented] == [r[0] for r in registered]
    for doc, reg in zip(documented, registered, strict=True):
        assert doc == reg, f"docs/queries.md differs from sinks/queries.py for {reg[0]}"
    assert len(registered) >= 12
