"""The simulator's pure core: no broker, no clock; hours of training in milliseconds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

import pytest

from trainguard.producers.simulator import CommandRefused, Phase, Scenario, SimulatedCluster
from trainguard.producers.simulator.scenario import COLLECTIVE_STACK
from trainguard.schemas import (
    Abort,
    CheckpointFailed,
    CheckpointNow,
    CheckpointValidated,
    CheckpointWritten,
    DrainNode,
    Envelope,
    EvictRank,
    GpuHealth,
    Heartbeat,
    NodeSelfTestResult,
    PauseRun,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    ReleaseNode,
    RunNodeSelfTest,
    RunStarted,
    SdcSelfCheck,
    SkipUpdate,
    StepStats,
    StepTiming,
    decode_batch,
    encode,
    encode_batch,
)

T0 = 1_000.0
BASE: dict[str, Any] = {
    "name": "t",
    "world_size": 64,
    "ranks_per_node": 8,
    "nodes_per_rack": 4,
    "step_time_s": 0.2,
    "steps": 120,
    "checkpoint_every": 25,
    "checkpoint_write_s": 0.2,
    "checkpoint_validate_s": 0.2,
    "heartbeat_interval_s": 0.5,
    "restart_delay_s": 2.0,
    "seed": 7,
}


def scenario(**changes: Any) -> Scenario:
    return Scenario.parse({**BASE, **changes})


def cluster(sc: Scenario, **kwargs: Any) -> SimulatedCluster:
    kwargs.setdefault("id_prefix", "t")
    kwargs.setdefault("validate", True)
    return SimulatedCluster(sc, T0, run_id="run-1", **kwargs)


def drive(c: SimulatedCluster, until: float, dt: float = 0.05) -> list[Envelope]:
    out: list[Envelope] = []
    t = c.now
    while t < until:
        t = min(until, t + dt)
        out += c.advance(t)
    return out


def of(kind: type[Envelope], events: Iterable[Envelope]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def abort(c: SimulatedCluster, stack_dump: bool = True, command_id: str = "abort-1", **kw: Any) -> Abort:
    reason = Reason(code=ReasonCode.OPERATOR, text="test")
    return Abort(
        command_id=command_id, run_id=c.run_id, attempt=c.attempt, issued_ts=c.now, reason=reason,
        stack_dump=stack_dump, **kw,
    )  # fmt: skip


def command(kind: type[Any], c: SimulatedCluster, **kw: Any) -> Any:
    reason = Reason(code=ReasonCode.OPERATOR, text="test")
    return kind(
        command_id=f"{kind.KIND}-1", run_id=c.run_id, attempt=c.attempt, issued_ts=c.now, reason=reason, **kw
    )


# --------------------------------------------------------------------------- healthy


def test_healthy_run_emits_every_kind_and_finishes() -> None:
    c = cluster(scenario(steps=60, gpu_health_interval_s=2.0, sdc_check_every=20))
    events = drive(c, T0 + 30)
    assert c.phase is Phase.FINISHED and c.done
    started = of(RunStarted, events)
    assert len(started) == 1 and started[0].attempt == 0 and started[0].resumed_from_step == -1
    assert started[0].nodes == [f"node-{i:04d}" for i in range(8)]
    assert started[0].racks["node-0004"] == "rack-01"
    timings = of(StepTiming, events)
    assert len(timings) == 60 * 64 and {t.step for t in timings} == set(range(60))
    stats = of(StepStats, events)  # finite stats: one rank per node (local rank 0) reports
    assert len(stats) == 60 * 8 and {s.rank % 8 for s in stats} == {0}
    assert [(w.checkpoint_step, w.uri) for w in of(CheckpointWritten, events)] == [
        (25, "sim://run-1/step-000025"),
        (50, "sim://run-1/step-000050"),
    ]
    validated = of(CheckpointValidated, events)
    assert [(v.checkpoint_step, v.last_verified_step, v.rank) for v in validated] == [
        (25, 20, -1),
        (50, 40, -1),
    ]
    assert len(of(SdcSelfCheck, events)) == 3 and all(s.passed for s in of(SdcSelfCheck, events))
    assert of(GpuHealth, events)
    exits = of(RankExit, events)
    assert len(exits) == 64 and all(e.exit_code == 0 and e.signal is None and e.step == 59 for e in exits)
    # Time only moves forward, and ids are unique.
    assert all(a.ts <= b.ts for a, b in zip(events, events[1:], strict=False))
    assert len({e.event_id for e in events}) == len(events)


def test_events_round_trip_through_the_codec() -> None:
    c = cluster(scenario(steps=30, gpu_health_interval_s=1.0, sdc_check_every=10))
    events = drive(c, T0 + 10)
    raw = encode_batch(
        {"run_id": "run-1", "node": "", "world_size": 64, "producer_id": "p", "seq": 0},
        (encode(e) for e in events),
    )
    decoded = decode_batch(raw)
    assert decoded.rejections == [] and decoded.events == events


def test_fast_construction_matches_validated_construction() -> None:
    sc = scenario(steps=40, gpu_health_interval_s=1.0, sdc_check_every=10, faults=[
        {"kind": "crash", "rank": 3, "at_step": 30},
    ])  # fmt: skip
    fast, checked = cluster(sc, validate=False), cluster(sc, validate=True)
    a = drive(fast, T0 + 12) + fast.apply(abort(fast)).events + drive(fast, T0 + 30)
    b = drive(checked, T0 + 12) + checked.apply(abort(checked)).events + drive(checked, T0 + 30)
    assert [encode(e) for e in a] == [encode(e) for e in b]
    assert a == b


@pytest.mark.parametrize("world_size", [8, 1024])
def test_healthy_median_step_is_the_scenario_step_time(world_size: int) -> None:
    c = cluster(scenario(world_size=world_size, steps=120, heartbeat_interval_s=60), validate=False)
    timings = of(StepTiming, drive(c, T0 + 30, dt=1.0))
    per_step = {t.step: t.total_s for t in timings}
    assert statistics.median(per_step.values()) == pytest.approx(0.2, rel=0.03)
    compute = [t.compute_s for t in timings]
    assert statistics.median(compute) < 0.7 * 0.2  # each rank computes a bit less than the slowest
    assert all(t.total_s >= t.compute_s for t in timings)


def test_heartbeats_are_staggered_and_carry_the_last_completed_step() -> None:
    c = cluster(scenario())
    events = drive(c, T0 + 5)
    beats = of(Heartbeat, events)
    assert len(beats) == pytest.approx(64 * 5 / 0.5, abs=64)
    assert len({round(b.ts, 6) for b in beats}) > 0.9 * len(beats)  # spread, not bursts
    last_step = -1
    for event in events:
        if isinstance(event, StepTiming):
            last_step = event.step
        elif isinstance(event, Heartbeat):
            assert event.step == last_step
    by_rank = sorted(b.ts for b in beats if b.rank == 17)
    assert all(b - a == pytest.approx(0.5) for a, b in zip(by_rank, by_rank[1:], strict=False))


# --------------------------------------------------------------------------- crash


def test_crash_stops_progress_while_survivors_heartbeat() -> None:
    c = cluster(scenario(faults=[{"kind": "crash", "rank": 13, "at_step": 80}]))
    events = drive(c, T0 + 40)
    [exit_] = of(RankExit, events)
    assert (exit_.rank, exit_.node, exit_.step, exit_.signal, exit_.exit_code) == (13, "node-0001", 79, 9, -9)
    assert not exit_.requested
    assert max(t.step for t in of(StepTiming, events)) == 79
    after = [b for b in of(Heartbeat, events) if b.ts > exit_.ts + 1]
    assert {b.rank for b in after} == set(range(64)) - {13}
    assert {b.step for b in after} == {79}
    assert c.phase is Phase.STALLED and c.attempt == 0 and c.live_ranks == 63
    assert [(f.kind, f.rank, f.node, f.step) for f in c.fired] == [("crash", 13, "node-0001", 80)]


def test_abort_after_crash_restarts_from_the_last_validated_checkpoint() -> None:
    c = cluster(scenario(faults=[{"kind": "crash", "rank": 13, "at_step": 80}]))
    drive(c, T0 + 25)
    aborted_at = c.now
    result = c.apply(abort(c, stack_dump=False))
    assert "aborted 63 ranks" in result.detail
    exits = of(RankExit, result.events)
    assert len(exits) == 63 and all(e.requested and e.stack_signature == "" for e in exits)
    assert c.phase is Phase.WAITING
    events = drive(c, T0 + 60)
    [started] = of(RunStarted, events)
    assert (started.attempt, started.resumed_from_step) == (1, 75)
    assert started.ts == pytest.approx(aborted_at + 2.0)
    first = min(of(StepTiming, events), key=lambda t: t.ts)
    assert (first.step, first.attempt) == (76, 1)
    # The crash struck once: the re-run of step 80 completes.
    assert not of(RankExit, [e for e in events if e.attempt == 1 and e.step < 119])
    assert [f.kind for f in c.fired] == ["crash"]
    assert c.phase is Phase.FINISHED and c.steps_completed == 80 + (120 - 76)


def test_a_repeating_fault_strikes_again_after_the_restart() -> None:
    c = cluster(scenario(faults=[{"kind": "crash", "rank": 13, "at_step": 80, "repeat": True}]))
    drive(c, T0 + 25)
    c.apply(abort(c, stack_dump=False))
    events = drive(c, T0 + 40)
    [again] = [e for e in of(RankExit, events) if not e.requested]
    assert (again.attempt, again.rank, again.step) == (1, 13, 79)
    assert [(f.kind, f.attempt) for f in c.fired] == [("crash", 0), ("crash", 1)]


def test_without_a_command_the_launcher_times_out_and_restarts() -> None:
    c = cluster(scenario(orphan_restart_after_s=20, faults=[{"kind": "crash", "rank": 13, "at_step": 80}]))
    events = drive(c, T0 + 60)
    killed = [e for e in of(RankExit, events) if e.signal == 6]
    assert len(killed) == 63 and not any(e.requested for e in killed)
    crash_ts = next(e.ts for e in of(RankExit, events) if e.rank == 13)
    assert killed[0].ts - crash_ts == pytest.approx(20, abs=0.2)
    assert [s.attempt for s in of(RunStarted, events)] == [0, 1]
    assert len(c.notes) == 1 and "no progress for 20s" in c.notes[0].text


def test_a_crash_during_a_checkpoint_write_fails_it() -> None:
    sc = scenario(checkpoint_write_s=5.0, faults=[{"kind": "crash", "rank": 0, "at_step": 27}])
    c = cluster(sc)
    events = drive(c, T0 + 20)
    [failed] = of(CheckpointFailed, events)
    assert failed.checkpoint_step == 25 and "rank 0 died" in failed.error
    assert not of(CheckpointWritten, events)
    c.apply(abort(c, stack_dump=False))
    [started] = of(RunStarted, drive(c, T0 + 30))
    assert started.resumed_from_step == -1  # nothing was ever validated: start over


# --------------------------------------------------------------------------- hang


def test_hang_keeps_everyone_alive_and_the_culprit_has_the_odd_stack() -> None:
    c = cluster(scenario(faults=[{"kind": "hang", "rank": 42, "at_step": 50}]))
    events = drive(c, T0 + 30)
    assert max(t.step for t in of(StepTiming, events)) == 49
    assert not of(RankExit, events)
    hang_ts = max(t.ts for t in of(StepTiming, events))
    late = [b for b in of(Heartbeat, events) if b.ts > hang_ts + 5]
    assert {b.rank for b in late} == set(range(64)) and {b.step for b in late} == {49}
    assert c.phase is Phase.STALLED

    result = c.apply(abort(c, stack_dump=True))
    exits = {e.rank: e for e in of(RankExit, result.events)}
    assert len(exits) == 64 and all(e.requested and e.stack_dump_ref for e in exits.values())
    assert exits[42].stack_signature == "compute:forward>matmul"
    assert {e.stack_signature for r, e in exits.items() if r != 42} == {COLLECTIVE_STACK}
    assert exits[42].node == "node-0005"
    [started] = of(RunStarted, drive(c, T0 + 40))
    assert (started.attempt, started.resumed_from_step) == (1, 25)


def test_heartbeats_report_the_phase_the_hung_rank_stuck_in_its_own() -> None:
    c = cluster(scenario(faults=[{"kind": "hang", "rank": 42, "at_step": 50, "phase": "data"}]))
    events = drive(c, T0 + 30)
    running = [b for b in of(Heartbeat, events) if b.step < 40]
    assert {b.phase for b in running} == {"forward", "allreduce"}  # computing, then waiting
    hang_ts = max(t.ts for t in of(StepTiming, events))
    late = [b for b in of(Heartbeat, events) if b.ts > hang_ts + 1]
    assert {b.phase for b in late if b.rank == 42} == {"data"}
    assert {b.phase for b in late if b.rank != 42} == {"allreduce"}


def repeat_crash_on_a_spare(**changes: Any) -> SimulatedCluster:
    """A data fault: whoever runs rank 13 crashes at step 80, every time. The first time,
    its node (node-0001) is quarantined and replaced by a spare; the second time it is the
    spare: the step, not the node."""
    c = cluster(scenario(faults=[{"kind": "crash", "rank": 13, "at_step": 80, "repeat": True}], **changes))
    drive(c, T0 + 25)
    c.apply(command(QuarantineNode, c, node="node-0001"))
    c.apply(abort(c, stack_dump=False))
    drive(c, T0 + 40)
    assert [(f.kind, f.node) for f in c.fired] == [("crash", "node-0001"), ("crash", "spare-0000")]
    return c


def test_pause_run_stops_the_run_and_nothing_restarts() -> None:
    c = repeat_crash_on_a_spare()
    result = c.apply(command(PauseRun, c, step=80))
    assert "run paused after attempt 1 (63 ranks stopped); no restart" in result.detail
    assert all(e.requested for e in of(RankExit, result.events)) and len(of(RankExit, result.events)) == 63
    assert c.phase is Phase.PAUSED and c.done and c.paused == "test"
    assert not of(RunStarted, drive(c, T0 + 120))  # no orphan timeout, no restart
    assert c.notes[-1].text == "paused at step 80: test"
    assert "nothing to pause" in c.apply(command(PauseRun, c, step=80)).detail


def test_release_node_returns_a_replaced_node_to_the_pool() -> None:
    c = repeat_crash_on_a_spare()
    with pytest.raises(CommandRefused, match="not part of the job"):
        c.apply(command(ReleaseNode, c, node="node-9999"))
    detail = c.apply(command(ReleaseNode, c, node="node-0001")).detail
    assert detail == "node-0001 is back in the pool (the next replacement takes it)"
    c.apply(command(QuarantineNode, c, node="node-0002"))
    c.apply(abort(c, stack_dump=False))
    [started] = of(RunStarted, drive(c, T0 + 50))
    assert "node-0001" in started.nodes and "node-0002" not in started.nodes


def test_release_node_before_the_restart_lifts_the_quarantine() -> None:
    c = cluster(scenario())
    drive(c, T0 + 5)
    c.apply(command(QuarantineNode, c, node="node-0003"))
    assert "quarantine is lifted" in c.apply(command(ReleaseNode, c, node="node-0003")).detail
    c.apply(abort(c, stack_dump=False))
    [started] = of(RunStarted, drive(c, T0 + 10))
    assert "node-0003" in started.nodes and not c.notes


def test_a_skipped_batch_does_not_strike_again() -> None:
    c = repeat_crash_on_a_spare()
    c.apply(command(SkipUpdate, c, step=80))
    c.apply(abort(c, stack_dump=False))
    drive(c, T0 + 120)
    assert c.phase is Phase.FINISHED and len(c.fired) == 2


# --------------------------------------------------------------------------- slow


def test_slow_rank_raises_only_its_compute_but_everyones_total() -> None:
    sc = scenario(
        steps=200, faults=[{"kind": "slow", "rank": 5, "from_step": 100, "to_step": 200, "factor": 1.22}]
    )
    timings = of(StepTiming, drive(cluster(sc, validate=False), T0 + 60, dt=0.5))
    before = [t for t in timings if 20 <= t.step < 100]
    during = [t for t in timings if t.step >= 100]

    def median(items: list[StepTiming], pick: Any) -> float:
        return statistics.median(pick(t) for t in items)

    culprit_ratio = median([t for t in during if t.rank == 5], lambda t: t.compute_s) / median(
        [t for t in before if t.rank == 5], lambda t: t.compute_s
    )
    assert culprit_ratio == pytest.approx(1.22, rel=0.03)
    others = median([t for t in during if t.rank != 5], lambda t: t.compute_s) / median(
        [t for t in before if t.rank != 5], lambda t: t.compute_s
    )
    assert others == pytest.approx(1.0, abs=0.02)
    assert median(during, lambda t: t.total_s) > 1.05 * median(before, lambda t: t.total_s)
    for step in (120, 150):
        totals = {t.total_s for t in during if t.step == step}
        assert len(totals) == 1  # synchronous: every rank leaves the all-reduce together
    # Robust z of the culprit is far above the straggler threshold (3).
    step_150 = {t.rank: t.compute_s for t in during if t.step == 150}
    med = statistics.median(step_150.values())
    mad = statistics.median(abs(x - med) for x in step_150.values())
    assert (step_150[5] - med) / mad > 3


def test_thermal_straggler_shows_in_gpu_health() -> None:
    sc = scenario(
        gpu_health_interval_s=1.0,
        faults=[{"kind": "slow", "rank": 5, "factor": 1.3, "cause": "thermal"}],
    )
    health = of(GpuHealth, drive(cluster(sc), T0 + 10))
    hot = [h for h in health if h.rank == 5]
    cool = [h for h in health if h.rank != 5]
    assert hot and all(h.thermal_throttle and h.temperature_c > 85 for h in hot)
    assert all(not h.thermal_throttle and h.temperature_c < 80 for h in cool)


def test_rack_wide_slowness_follows_the_rack_not_the_node() -> None:
    sc = scenario(faults=[{"kind": "slow", "rack": "rack-01", "factor": 1.5}])
    c = cluster(sc)
    drive(c, T0 + 5)
    c.apply(command(QuarantineNode, c, node="node-0004"))
    c.apply(abort(c, stack_dump=False, command_id="abort-2"))
    events = drive(c, T0 + 15)
    [started] = of(RunStarted, events)
    assert started.nodes[4] == "spare-0000" and started.racks["spare-0000"] == "rack-01"
    late = [t for t in of(StepTiming, events) if t.attempt == 1]
    spare = statistics.median(t.compute_s for t in late if t.node == "spare-0000")
    healthy = statistics.median(t.compute_s for t in late if t.node == "node-0000")
    assert spare / healthy == pytest.approx(1.5, rel=0.03)  # a hot aisle: the spare is slow too


def test_quarantine_replaces_the_slow_node_at_the_next_restart() -> None:
    sc = scenario(faults=[{"kind": "slow", "rank": 5, "factor": 1.5}])
    c = cluster(sc)
    drive(c, T0 + 5)
    detail = c.apply(command(QuarantineNode, c, node="node-0000")).detail
    assert "node-0000 leaves the pool" in detail
    with pytest.raises(CommandRefused, match="not part of the job"):
        c.apply(command(QuarantineNode, c, node="node-9999"))
    c.apply(abort(c, stack_dump=False))
    events = drive(c, T0 + 15)
    late = [t for t in of(StepTiming, events) if t.attempt == 1]
    assert {t.node for t in late if t.rank == 5} == {"spare-0000"}
    ratio = statistics.median(t.compute_s for t in late if t.rank == 5) / statistics.median(
        t.compute_s for t in late if t.rank != 5
    )
    assert ratio == pytest.approx(1.0, abs=0.03)
    assert c.notes[0].text == "node-0000 replaced by spare-0000"


# --------------------------------------------------------------------------- commands


def test_checkpoint_now_checkpoints_after_the_next_step() -> None:
    c = cluster(scenario())
    drive(c, T0 + 2.1)
    step = c.last_completed
    assert step % 25 != 0
    assert "checkpoint after step" in c.apply(command(CheckpointNow, c)).detail
    events = drive(c, T0 + 3)
    assert [w.checkpoint_step for w in of(CheckpointWritten, events)] == [step + 1]


def test_evict_stops_at_the_next_checkpoint_and_resumes_there_on_a_spare() -> None:
    c = cluster(scenario())
    drive(c, T0 + 1)
    c.apply(command(EvictRank, c, rank=9))
    events = drive(c, T0 + 12)
    stop = [e for e in of(RankExit, events) if e.attempt == 0]
    assert len(stop) == 64 and all(e.requested for e in stop)
    [started] = of(RunStarted, events)
    assert started.resumed_from_step == 25 and started.nodes[1] == "spare-0000"
    assert min(t.step for t in of(StepTiming, events) if t.attempt == 1) == 26


@pytest.mark.parametrize(("within_s", "boundary"), [(100.0, 25), (1.0, None)])
def test_a_drain_stops_at_the_next_boundary_and_loses_no_step(within_s: float, boundary: int | None) -> None:
    """The checkpoint the cadence makes due (step 25), or a checkpoint taken `within_s`
    after the command, whichever comes first: the ranks stop at that step, the node is
    swapped for a spare, and the next attempt trains the step after it."""
    c = cluster(scenario())
    drive(c, T0 + 1)
    at_command = c.last_completed
    detail = c.apply(command(DrainNode, c, node="node-0001", within_s=within_s)).detail
    assert "node-0001 drains at the next checkpoint boundary" in detail
    events = drive(c, T0 + 12)
    timings = [t.step for t in of(StepTiming, events) if t.attempt == 0]
    stop = max(timings)
    if boundary is None:  # 1 s of 0.2 s steps after the command, well before the cadence's 25
        boundary = stop
        assert at_command + 4 <= boundary <= at_command + 7
    assert stop == boundary  # no step trained past the boundary: none is lost
    assert boundary in {w.checkpoint_step for w in of(CheckpointWritten, events)}
    exits = [e for e in of(RankExit, events) if e.attempt == 0]
    assert len(exits) == 64 and all(e.requested for e in exits)
    [started] = of(RunStarted, events)
    assert started.resumed_from_step == boundary and started.nodes[1] == "spare-0000"
    assert min(t.step for t in of(StepTiming, events) if t.attempt == 1) == boundary + 1
    with pytest.raises(CommandRefused, match="already out"):
        c.apply(command(DrainNode, c, node="spare-0000", within_s=0).model_copy(update={"node": "node-0001"}))
    with pytest.raises(CommandRefused, match="not part of the job"):
        c.apply(command(DrainNode, c, node="node-0099", within_s=0))


def test_commands_for_another_attempt_are_refused() -> None:
    c = cluster(scenario())
    drive(c, T0 + 1)
    stale = abort(c).model_copy(update={"attempt": 3})
    with pytest.raises(CommandRefused, match="attempt 3"):
        c.apply(stale)
    assert c.phase is Phase.TRAINING


def test_a_quarantine_that_lands_after_its_restart_takes_the_node_out_at_the_next() -> None:
    """A node's quarantine outlives the attempt that decided it (command_roles.
    OUTLIVE_THEIR_ATTEMPT), as at a real launcher's gate: decided in attempt 0, it reaches the
    job once attempt 1 runs on the node, and the node leaves at attempt 2's restart. Any
    other command of attempt 0 is still refused."""
    c = cluster(scenario())
    drive(c, T0 + 1)
    late = command(QuarantineNode, c, node="node-0002")
    stale_abort = abort(c, stack_dump=False, command_id="abort-0")
    c.apply(abort(c, stack_dump=False))
    [first] = of(RunStarted, drive(c, T0 + 10))
    assert first.attempt == c.attempt == 1 and "node-0002" in first.nodes
    assert "node-0002 leaves the pool" in c.apply(late).detail
    with pytest.raises(CommandRefused, match="attempt 0, the job is at 1"):
        c.apply(stale_abort)
    c.apply(abort(c, stack_dump=False, command_id="abort-2"))
    [second] = of(RunStarted, drive(c, T0 + 20))
    assert second.attempt == 2 and "node-0002" not in second.nodes


def test_abort_of_some_ranks_stalls_the_rest() -> None:
    c = cluster(scenario())
    drive(c, T0 + 1)
    result = c.apply(abort(c, stack_dump=False, ranks=[3]))
    assert len(of(RankExit, result.events)) == 1 and c.phase is Phase.STALLED and c.live_ranks == 63


# --------------------------------------------------------------------------- data faults


def test_nan_and_grad_spike_faults() -> None:
    sc = scenario(faults=[
        {"kind": "nan", "rank": 3, "at_step": 10},
        {"kind": "grad_spike", "rank": 4, "at_step": 12, "factor": 50},
    ])  # fmt: skip
    stats = of(StepStats, drive(cluster(sc), T0 + 5))
    at10 = {s.rank: s for s in stats if s.step == 10}
    assert math.isnan(at10[3].loss) and not at10[3].finite and math.isfinite(at10[4].loss)
    grads = {s.step: s.grad_norm for s in stats if s.rank == 0}
    assert grads[12] > 20 * grads[11]
    assert all(s.finite for s in stats if s.step != 10)


def test_sdc_fault_fails_self_checks_and_freezes_the_watermark() -> None:
    sc = scenario(sdc_check_every=5, world_size=8, faults=[{"kind": "sdc", "rank": 2, "at_step": 8}])
    events = drive(cluster(sc), T0 + 25)
    checks = of(SdcSelfCheck, events)
    failed = [s for s in checks if not s.passed]
    assert failed and {s.rank for s in failed} == {2} and min(s.step for s in failed) == 10
    validated = {v.checkpoint_step: v.last_verified_step for v in of(CheckpointValidated, events)}
    assert validated[25] == 5 and validated[50] == 5  # never past the last clean check


def test_node_self_test_fails_on_hardware_that_computes_wrong_answers_and_passes_elsewhere() -> None:
    sc = scenario(faults=[
        {"kind": "wrong_gpu", "rank": 41, "at_step": 10, "bias": 1e-3},  # node-0005
        {"kind": "sdc", "rank": 18, "at_step": 10},  # node-0002
        {"kind": "bitflip", "rank": 3, "at_step": 10},  # node-0000: transient
        {"kind": "nan", "rank": 60, "at_step": 10, "repeat": True},  # node-0007: the data's fault
    ])  # fmt: skip
    c = cluster(sc)
    drive(c, T0 + 1)  # step ~5: no fault has struck yet
    assert "passed" in c.apply(command(RunNodeSelfTest, c, node="node-0005")).detail
    drive(c, T0 + 4)
    detail = c.apply(command(RunNodeSelfTest, c, node="node-0005")).detail
    assert detail == "node node-0005 failed gemm self-test: wrong answer on rank 41; collective passed"
    gemm_only = c.apply(command(RunNodeSelfTest, c, node="node-0002", tests=["gemm"])).detail
    assert gemm_only == "node node-0002 failed gemm self-test: wrong answer on rank 18"
    for healthy in ("node-0000", "node-0001", "node-0007"):
        result = c.apply(command(RunNodeSelfTest, c, node=healthy))
        assert result.detail == f"node {healthy} passed gemm, collective self-tests"
        (report,) = result.events  # the record the launcher sends on real hardware
        assert isinstance(report, NodeSelfTestResult) and (report.node, report.passed) == (healthy, True)
        assert report.reason.code == ReasonCode.NODE_SELF_TEST_PASSED and report.reason.text == result.detail
    (failed,) = c.apply(command(RunNodeSelfTest, c, node="node-0005")).events
    assert isinstance(failed, NodeSelfTestResult) and not failed.passed and failed.failed_tests == ["gemm"]
    assert failed.reason.code == ReasonCode.NODE_SELF_TEST_FAILED and failed.purpose == "quarantine"
    assert c.node_self_tests[1:3] == [("node-0005", False), ("node-0002", False)]
    assert c.node_self_tests[-1] == ("node-0005", False)
    with pytest.raises(CommandRefused, match="not part of the job"):
        c.apply(command(RunNodeSelfTest, c, node="node-9999"))
    with pytest.raises(CommandRefused, match="no memtest self-test"):
        c.apply(command(RunNodeSelfTest, c, node="node-0005", tests=["memtest"]))


def test_a_quarantined_node_is_still_tested_after_a_spare_replaced_it() -> None:
    c = cluster(scenario(faults=[{"kind": "wrong_gpu", "rank": 41, "at_step": 0}]))
    drive(c, T0 + 2)
    c.apply(command(QuarantineNode, c, node="node-0005"))
    c.apply(abort(c, stack_dump=False))
    drive(c, T0 + 6)
    assert c.attempt == 1 and "node-0005" not in c.node_of(41)
    assert "failed gemm" in c.apply(command(RunNodeSelfTest, c, node="node-0005")).detail
    assert "passed" in c.apply(command(RunNodeSelfTest, c, node=c.node_of(41))).detail  # the spare


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_events_however_the_driver_ticks() -> None:
    sc = scenario(gpu_health_interval_s=1.0, faults=[{"kind": "hang", "rank": 42, "at_step": 50}])
    fine = drive(cluster(sc), T0 + 20, dt=0.01)
    coarse = drive(cluster(sc), T0 + 20, dt=0.37)
    assert [encode(e) for e in fine] == [encode(e) for e in coarse]
    other_ids = drive(cluster(sc, id_prefix="zz"), T0 + 20, dt=1.0)
    strip = [e.model_copy(update={"event_id": ""}) for e in other_ids]
    assert strip == [e.model_copy(update={"event_id": ""}) for e in fine]
    reseeded = drive(cluster(scenario(seed=8)), T0 + 20)
    assert [t.compute_s for t in of(StepTiming, reseeded)][:64] != [
        t.compute_s for t in of(StepTiming, fine)
    ][:64]


def test_re_run_steps_report_the_same_loss() -> None:
    c = cluster(scenario(faults=[{"kind": "crash", "rank": 13, "at_step": 80}]))
    first = {(s.rank, s.step): s.loss for s in of(StepStats, drive(c, T0 + 25))}
    c.apply(abort(c, stack_dump=False))
    again = {(s.rank, s.step): s.loss for s in of(StepStats, drive(c, T0 + 40)) if s.attempt == 1}
    for key in [(0, 76), (16, 79), (56, 77)]:  # local rank 0 of nodes 0, 2 and 7 reports
        assert again[key] == first[key]


def test_every_rank_reports_its_stats_when_asked_and_a_non_finite_one_always() -> None:
    every = drive(cluster(scenario(steps=10, stats_every_rank=True)), T0 + 30)
    assert len(of(StepStats, every)) == 10 * 64
    nan = scenario(steps=10, faults=[{"kind": "nan", "rank": 13, "at_step": 4, "steps": 1}])
    stats = [s for s in of(StepStats, drive(cluster(nan), T0 + 30)) if s.step == 4]
    # a NaN on one rank poisons the all-reduced grad norm: every rank's report is non-finite
    assert len(stats) == 64 and not any(s.finite for s in stats) and 13 in {s.rank for s in stats}
