"""The fleet's GPU health for failure prediction (issue 46): healthy noise in every counter
and level (producers/simulator/precursors.py), the plan of failures and precursors
(fleet_truth.py), the run-level fleet run that emits them and applies drains (fleet.py),
and the library's fleet scenarios beside the per-rank ones (fleet_scenario.py). No core:
the commands here are the test's."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainguard.producers.simulator import Scenario, ScenarioError
from trainguard.producers.simulator.fleet import simulate_fleet
from trainguard.producers.simulator.fleet_scenario import FleetScenario, fleet_library
from trainguard.producers.simulator.fleet_truth import draw_plan
from trainguard.producers.simulator.precursors import COUNTERS, DEFAULT_COUNTERS, FleetHealth, HealthNoise
from trainguard.schemas import (
    CheckpointValidated,
    Command,
    DrainNode,
    Envelope,
    GpuHealth,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    RunStarted,
    StepTiming,
)

DAY = 86_400.0
START = 1_767_225_600.0


def fleet(**fields: Any) -> FleetScenario:
    return FleetScenario.parse({"name": "t", "fleet": fields})


def day_of_ticks(noise: HealthNoise, gpus: int, interval: float = 300.0, seed: int = 1) -> FleetHealth:
    health = FleetHealth(noise, gpus, 8, np.random.default_rng(seed))
    nodes = [f"n{i:05d}" for i in range(gpus // 8)]
    for k in range(int(DAY / interval)):
        health.tick(START + k * interval, interval, nodes)
    return health


# --------------------------------------------------------------------------- healthy noise


@pytest.mark.parametrize("counter", COUNTERS)
def test_every_counter_is_noisy_at_its_rate_uneven_across_gpus(counter: str) -> None:
    spec = DEFAULT_COUNTERS[counter]
    gpus = 8192
    counts = day_of_ticks(HealthNoise(), gpus).counts[counter]
    expected = spec.per_gpu_day + spec.bursts_per_gpu_day * spec.burst_mean
    mean = float(counts.mean())
    # Poisson at the fleet's rate: within 5 standard errors (the Gamma spread and the
    # bursts widen it: var = m + m^2 / shape + the bursts' own)
    sd = math.sqrt(
        expected + spec.per_gpu_day**2 / spec.dispersion + spec.bursts_per_gpu_day * spec.burst_mean**2 * 2
    )
    assert abs(mean - expected) <= 5 * sd / math.sqrt(gpus) + 1e-3
    if spec.per_gpu_day >= 1:  # common enough to see the unevenness: overdispersed
        assert float(counts.var()) > 2 * mean
        assert (counts == 0).mean() > math.exp(-mean) + 0.1  # more clean GPUs than Poisson's


def test_the_scale_multiplies_every_rate_and_bursts_come_on_top() -> None:
    quiet = day_of_ticks(HealthNoise(), 4096, seed=2).counts["nvlink_crc_errors"].sum()
    loud = day_of_ticks(HealthNoise(scale=3.0), 4096, seed=2).counts["nvlink_crc_errors"].sum()
    assert 2.4 < loud / quiet < 3.6
    no_bursts = HealthNoise(counters={"nvlink_crc_errors": {"per_gpu_day": 5.0, "dispersion": 0.5}})
    plain = day_of_ticks(no_bursts, 4096, seed=2).counts["nvlink_crc_errors"]
    assert plain.max() < quiet / 4096 * 20  # no GPU with a burst of hundreds
    assert day_of_ticks(HealthNoise(), 4096, seed=2).counts["nvlink_crc_errors"].max() > 100


def test_temperature_and_power_follow_the_load_with_each_gpus_offset() -> None:
    noise = HealthNoise()
    health = day_of_ticks(noise, 1024, seed=3)
    idle = [health.reading(r, START, 0.0) for r in range(1024)]
    busy = [health.reading(r, START, 1.0) for r in range(1024)]
    temps_idle = [r["temperature_c"] for r in idle]
    temps_busy = [r["temperature_c"] for r in busy]
    assert statistics.mean(temps_idle) == pytest.approx(noise.idle_c, abs=0.5)
    assert statistics.mean(temps_busy) - statistics.mean(temps_idle) == pytest.approx(
        noise.load_rise_c, abs=0.5
    )
    spread = math.sqrt(noise.offset_c**2 + noise.noise_c**2)
    assert statistics.stdev(temps_idle) == pytest.approx(spread, rel=0.15)
    assert statistics.mean(r["power_w"] for r in busy) == pytest.approx(noise.load_w, rel=0.02)
    assert statistics.mean(r["power_w"] for r in idle) == pytest.approx(noise.idle_w, rel=0.1)
    # the room's daily swing moves every GPU together: a quarter day later, +diurnal_c
    health.tick(START + DAY / 4, 300.0, [f"n{i:05d}" for i in range(128)])
    later = statistics.mean(health.reading(r, START + DAY / 4, 1.0)["temperature_c"] for r in range(1024))
    assert later - statistics.mean(temps_busy) == pytest.approx(noise.diurnal_c, abs=0.3)


def test_a_report_has_every_field_of_gpu_health_v3() -> None:
    health = day_of_ticks(HealthNoise(), 64)
    fields = health.reading(5, START, 1.0)
    event = GpuHealth.model_validate(
        {
            "event_id": "e",
            "run_id": "r",
            "attempt": 0,
            "rank": 5,
            "node": "n00000",
            "step": 0,
            "ts": START,
            **fields,
        }
    )
    for name in (
        *COUNTERS,
        "remap_pending",
        "remap_failed",
        "retired_pages_pending",
        "temperature_c",
        "power_w",
    ):
        assert getattr(event, name) is not None, name
    assert event.throttle_reasons is not None


# --------------------------------------------------------------------------- the plan


def test_the_plan_holds_the_share_kinds_and_lead_times_configured() -> None:
    f = fleet(
        world_size=1024,
        days=30,
        seed=9,
        failures={"per_day": 100},
        precursors={"share": 0.3, "lead_median_s": 1800, "lead_sigma": 0.8, "false_per_node_day": 0.05},
    ).fleet
    failures, foretold, false = draw_plan(f, START, 0.0)
    n = len(failures)
    assert n == pytest.approx(3000, rel=0.06)
    share = sum(x.precursor is not None for x in failures) / n
    assert abs(share - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    kinds = defaultdict(int)
    for x in failures:
        kinds[x.kind] += 1
    assert kinds["crash"] / n == pytest.approx(0.75, abs=0.04) and kinds["wrong_gpu"] / n == pytest.approx(
        0.1, abs=0.03
    )
    leads = sorted(x.lead_s for x in failures if x.precursor is not None)
    assert statistics.median(leads) == pytest.approx(1800, rel=0.1)
    p10 = leads[len(leads) // 10]
    assert p10 == pytest.approx(1800 * math.exp(-1.2816 * 0.8), rel=0.15)
    assert min(leads) >= 60 and max(leads) <= 6 * 3600
    # each precursor ends when its failure strikes, on its GPU
    assert len(foretold) == sum(x.precursor is not None for x in failures)
    for episode in foretold:
        failure = failures[episode.failure]  # type: ignore[index]
        assert (episode.slot, episode.gpu, episode.end_ts) == (failure.slot, failure.gpu, failure.ts)
        assert episode.start_ts == pytest.approx(failure.precursor_ts)
    # false precursors: ~0.05 per node-day, foretelling nothing, half fading
    assert len(false) == pytest.approx(0.05 * 128 * 30, rel=0.25)
    assert all(e.failure is None for e in false)
    assert 0.3 < sum(e.fades for e in false) / len(false) < 0.7


def test_the_same_seed_draws_the_same_plan_and_another_seed_another() -> None:
    def plan(seed: int) -> list[tuple[float, int, int, str, str | None]]:
        f = fleet(world_size=256, days=5, seed=seed, failures={"per_day": 4}).fleet
        return [(x.ts, x.slot, x.gpu, x.kind, x.precursor) for x in draw_plan(f, START, 0.0)[0]]

    assert plan(1) == plan(1) and plan(1) != plan(2)


# --------------------------------------------------------------------------- the run


def record(into: list[Envelope], react: Callable[[Envelope], list[Command]] | None = None) -> Any:
    def core(event: Envelope) -> list[Command]:
        into.append(event)
        return react(event) if react is not None else []

    return core


def command(kind: type[Any], event: Envelope, **fields: Any) -> Any:
    return kind(
        command_id=f"{kind.KIND}-{event.event_id}",
        run_id=event.run_id,
        attempt=event.attempt,
        issued_ts=event.ts,
        reason=Reason(code=ReasonCode.OPERATOR, text="test"),
        **fields,
    )


ECC_2H = {
    "world_size": 64,
    "days": 0.5,
    "seed": 3,
    "health_interval_s": 120,
    "failures": {"per_day": 4, "kinds": {"crash": 1.0}},
    "precursors": {
        "share": 1.0,
        "kinds": {"ecc": 1.0},
        "lead_median_s": 7200,
        "lead_sigma": 0.0,
        "intensity_sigma": 0.0,
    },
}


def test_a_precursor_climbs_on_its_gpu_from_its_onset_to_its_failure() -> None:
    events: list[Envelope] = []
    truth = simulate_fleet(fleet(**ECC_2H), record(events), validate=True)
    struck = [f for f in truth.struck if f.ts - 7200 > START + 1800]
    assert struck, "the plan has a failure well inside the run"
    for failure in struck:
        rank = failure.slot * 8 + failure.gpu
        mine = [e for e in events if isinstance(e, GpuHealth) and e.rank == rank and e.node == failure.node]
        before = [e.ecc_corrected for e in mine if e.ts < failure.precursor_ts]
        during = [e for e in mine if failure.precursor_ts <= e.ts < failure.ts]
        assert before and during
        # the background over the hour before the onset is a few counts at most; the
        # precursor adds ~30/h, climbing e^2.5 to the failure
        first_half = during[len(during) // 2].ecc_corrected - during[0].ecc_corrected
        second_half = during[-1].ecc_corrected - during[len(during) // 2].ecc_corrected
        assert before[-1] - before[max(0, len(before) - 30)] < 10
        assert first_half > 20 and second_half > 2 * first_half
        exit_ = next(e for e in events if isinstance(e, RankExit) and e.ts == failure.ts)
        assert (exit_.rank, exit_.node) == (rank, failure.node)


def test_without_a_core_every_failure_strikes_and_the_time_adds_up() -> None:
    events: list[Envelope] = []
    scenario = fleet(**{**ECC_2H, "failures": {"per_day": 6}, "days": 1.0, "seed": 5})
    truth = simulate_fleet(scenario, record(events), validate=True)
    in_run = [f for f in truth.failures if truth.in_run(f)]
    assert in_run and all(f.outcome == "struck" for f in in_run)
    assert {f.kind for f in in_run} <= {"crash", "hang", "wrong_gpu"}
    assert sum(isinstance(e, RankExit) for e in events) == len(in_run)
    assert sum(isinstance(e, RunStarted) for e in events) == len(in_run) + 1
    for f in in_run:  # detection: a crash at once, a hang after the watchdog's timeout
        if f.kind == "crash":
            assert f.detected_ts == f.struck_ts
        elif f.kind == "hang":
            assert f.detected_ts == pytest.approx(f.struck_ts + 90.0)
    # useful steps x step time = the elapsed time less every loss (R ends with the first
    # step of the next attempt, as longrun.py counts it; the run ends within a step)
    if all(f.kind != "wrong_gpu" for f in in_run):
        assert truth.productive_s == pytest.approx((truth.steps - len(in_run)) * 10.0, abs=10.0)
    assert truth.health_reports == sum(isinstance(e, GpuHealth) for e in events)
    # every GPU of the attempt reports every interval while it is up (8 nodes x 8 GPUs)
    up = truth.elapsed_s - truth.restart_s * 0.5
    assert truth.health_reports == pytest.approx(64 * up / 120, rel=0.05)


def test_a_wrong_gpu_is_found_at_the_next_ring_check_and_the_job_goes_back_before_its_onset() -> None:
    events: list[Envelope] = []
    scenario = fleet(
        **{**ECC_2H, "failures": {"per_day": 6, "kinds": {"wrong_gpu": 1.0}}, "days": 1.0, "seed": 5}
    )
    truth = simulate_fleet(scenario, record(events), validate=True)
    wrong = [f for f in truth.failures if truth.in_run(f) and f.detected_ts is not None]
    assert wrong
    for f in wrong:
        steps = [e for e in events if isinstance(e, StepTiming) and e.ts <= f.struck_ts]
        at_onset = steps[-1].step if steps else -1
        exit_ = next(e for e in events if isinstance(e, RankExit) and e.ts == f.detected_ts)
        # the ring every 1,800 s of 10 s steps (180 steps), judged 3 steps after: the job
        # trained on, wrong, until then
        assert exit_.step == (at_onset // 180 + 1) * 180 + 3
        resumed = next(e for e in events if isinstance(e, RunStarted) and e.ts > f.detected_ts)
        assert resumed.resumed_from_step <= at_onset
        # the newest checkpoint of the job's own line before the onset: its attempt's, or
        # the checkpoint that attempt resumed from (an older line's later ones were wrong)
        began = [e for e in events if isinstance(e, RunStarted) and e.ts <= f.struck_ts][-1]
        validated = [
            e.checkpoint_step
            for e in events
            if isinstance(e, CheckpointValidated) and began.ts < e.ts <= f.struck_ts
        ]
        assert resumed.resumed_from_step == (validated[-1] if validated else began.resumed_from_step)


def drain_at_onset() -> Callable[[Envelope], list[Command]]:
    """A stand-in core: drains a node once a GPU of it reports 15 correctable ECC errors
    (ECC_2H's precursors get there within minutes; its seed's background never does),
    and quarantines the node of every exit."""
    drained: set[str] = set()

    def react(event: Envelope) -> list[Command]:
        if isinstance(event, RankExit):
            return [command(QuarantineNode, event, node=event.node)]
        if not isinstance(event, GpuHealth) or event.ecc_corrected is None or event.node in drained:
            return []
        if event.ecc_corrected >= 15:  # far beyond this seed's background on any GPU
            drained.add(event.node)
            return [command(DrainNode, event, node=event.node, within_s=300.0)]
        return []

    return react


def test_a_drain_checkpoints_at_the_boundary_swaps_the_node_and_its_failure_never_strikes() -> None:
    events: list[Envelope] = []
    truth = simulate_fleet(fleet(**ECC_2H), record(events, drain_at_onset()), validate=True)
    assert truth.drains
    drained = [f for f in truth.failures if f.outcome == "drained"]
    assert drained and all(f.gained_s is not None and f.gained_s > 0 for f in drained)
    for drain in truth.drains:
        assert drain.boundary_ts is not None
        # the boundary: the first step end within_s after the command, then C (or sooner)
        assert drain.decided_ts < drain.boundary_ts <= drain.decided_ts + 300.0 + 10.0 + 30.0
        assert drain.node in truth.quarantined and drain.node not in truth_nodes(events)
        checkpoints = [e for e in events if isinstance(e, CheckpointValidated) and e.ts == drain.boundary_ts]
        assert len(checkpoints) == 1
        # no step lost: the next attempt resumes from the boundary's checkpoint, 10 s later
        started = next(e for e in events if isinstance(e, RunStarted) and e.ts > drain.boundary_ts)
        assert started.resumed_from_step == checkpoints[0].checkpoint_step
        first = next(e for e in events if isinstance(e, StepTiming) and e.ts > drain.boundary_ts)
        assert first.ts == pytest.approx(drain.boundary_ts + 10.0)
        assert first.step == checkpoints[0].checkpoint_step + 1
        # the spare was idle: it warms up from the next first step while the others stay hot
        before = [e for e in events if isinstance(e, RunStarted) and e.ts < drain.boundary_ts][-1]
        (spare,) = set(started.nodes) - set(before.nodes)
        after = [e for e in events if isinstance(e, GpuHealth) and first.ts < e.ts < first.ts + 120]
        cold = [e.temperature_c for e in after if e.node == spare]
        hot = [e.temperature_c for e in after if e.node in before.nodes]
        assert cold and hot and statistics.mean(cold) < statistics.mean(hot) - 10
    assert truth.drain_s == pytest.approx(10.0 * len([d for d in truth.drains if d.boundary_ts]))
    assert not any(isinstance(e, RankExit) and e.node in {d.node for d in truth.drains} for e in events)


def test_a_spare_straight_from_a_burn_in_joins_as_warm_as_the_others() -> None:
    events: list[Envelope] = []
    truth = simulate_fleet(fleet(**ECC_2H, spare_idle=False), record(events, drain_at_onset()))
    drain = next(d for d in truth.drains if d.boundary_ts is not None)
    started = next(e for e in events if isinstance(e, RunStarted) and e.ts > drain.boundary_ts)  # type: ignore[operator]
    before = [e for e in events if isinstance(e, RunStarted) and e.ts < drain.boundary_ts][-1]  # type: ignore[operator]
    (spare,) = set(started.nodes) - set(before.nodes)
    after = [e for e in events if isinstance(e, GpuHealth) and started.ts < e.ts < started.ts + 120]
    spare_c = statistics.mean(e.temperature_c for e in after if e.node == spare)
    others_c = statistics.mean(e.temperature_c for e in after if e.node in before.nodes)
    assert abs(spare_c - others_c) < 3


def truth_nodes(events: list[Envelope]) -> list[str]:
    return [e for e in events if isinstance(e, RunStarted)][-1].nodes


def test_a_drain_too_late_names_the_right_node_and_takes_nothing_away() -> None:
    sc = fleet(**ECC_2H)
    plan = draw_plan(sc.fleet, START, 0.0)[0]
    drained: set[str] = set()

    def react(event: Envelope) -> list[Command]:
        if isinstance(event, GpuHealth) and event.node not in drained:
            due = [f for f in plan if f.slot * 8 <= event.rank < f.slot * 8 + 8 and 0 < f.ts - event.ts < 60]
            if due:  # a minute before the failure: the boundary within 300 s comes after it
                drained.add(event.node)
                return [command(DrainNode, event, node=event.node, within_s=300.0)]
        return []

    truth = simulate_fleet(sc, record([], react))
    late = [d for d in truth.drains if d.late]
    assert late, truth.drains
    for drain in late:
        failure = truth.failures[drain.failure]  # type: ignore[index]
        assert failure.outcome == "struck" and failure.node == drain.node and drain.boundary_ts is None
        assert 0 < drain.failure_ts - drain.decided_ts < 60  # type: ignore[operator]


def test_a_drained_failure_is_the_same_failure_the_undrained_run_meets() -> None:
    off = simulate_fleet(fleet(**ECC_2H), record([]))
    on = simulate_fleet(fleet(**ECC_2H), record([], drain_at_onset()))
    assert [(f.ts, f.slot, f.kind) for f in on.failures] == [(f.ts, f.slot, f.kind) for f in off.failures]
    saved = [f.id for f in on.failures if f.outcome == "drained"]
    assert saved and all(off.failures[i].outcome == "struck" for i in saved if off.in_run(off.failures[i]))
    assert on.restart_s < off.restart_s and on.goodput > off.goodput


# --------------------------------------------------------------------------- the library


def test_the_librarys_fleet_scenarios_are_routed_apart_from_the_per_rank_ones() -> None:
    fleets = fleet_library()
    assert {n for n in fleets if n.startswith("precursor-")} == {
        "precursor-1k",
        "precursor-16k",
        "precursor-false-1k",
        "precursor-none-1k",
    }
    assert {n for n in fleets if n.startswith("noise-")} == {"noise-1k", "noise-1k-noisy", "noise-16k"}
    assert not set(fleets) & set(Scenario.library())
    assert {s.fleet.world_size for s in fleets.values()} == {1024, 16384}
    noise = [s for s in fleets.values() if s.noise_only]
    assert {s.name for s in noise} == {"noise-1k", "noise-1k-noisy", "noise-16k"}
    assert sum(s.fleet.node_days for s in noise) >= 1000
    with pytest.raises(ScenarioError, match="fleet scenario.*evaluate --scenario noise-1k"):
        Scenario.builtin("noise-1k")


def test_a_bad_fleet_scenario_names_its_field(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "name: bad\nfleet: {world_size: 64, days: 1, noise: {counters: {ecc: {}}}}\n"
    )
    with pytest.raises(ScenarioError, match="fleet.noise.counters"):
        fleet_library(tmp_path)
    (tmp_path / "bad.yaml").write_text("name: other\nfleet: {world_size: 64, days: 1}\n")
    with pytest.raises(ScenarioError, match="differs from the file name"):
        fleet_library(tmp_path)
