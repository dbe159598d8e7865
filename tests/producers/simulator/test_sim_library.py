"""The scenario library of issue 3: every fault it lists, and healthy controls, each with
its ground truth; and, for each, the telemetry signature a detector has to find, checked
on the pure simulator (no broker, no processor)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import pytest

from trainguard.producers.simulator import FaultTruth, Phase, Scenario, SimulatedCluster
from trainguard.producers.simulator.fleet_scenario import fleet_library
from trainguard.producers.simulator.scenario import COLLECTIVE_STACK, LIBRARY_DIR, SlowFault
from trainguard.schemas import (
    Abort,
    CheckpointValidated,
    Command,
    CrossRankCheck,
    Diagnosis,
    Envelope,
    GpuHealth,
    QuarantineNode,
    RankExit,
    Rollback,
    RunCrossRankCheck,
    RunSelfCheck,
    RunStarted,
    SdcSelfCheck,
    StepStats,
    StepTiming,
)

from .simkit import command, make_cluster, of, quantile, run, straggler_streaks

LIBRARY = Scenario.library()
STRAGGLERS = [
    "straggler-thermal",
    "straggler-power-capped",
    "straggler-hot-aisle",
    "straggler-nvlink",
    "straggler-nic",
]
THERMAL_LIMIT_C = 85.0
#: Several faults in one run (issue 14), scored in tests/harness/scoring/test_harms.py.
MIXED = ["mixed-256", "mixed-2048", "mixed-2048-b"]
#: A node lost with its replacement 30 minutes away (issue 45), scored in
#: tests/harness/scoring/test_capacity.py.
ELASTIC = ["elastic-1k", "elastic-16k"]
#: A node 5% and a rank 8% slow (issue 47), scored by bench/bench_slowdown.py and `trainguard evaluate`.
SLOW_SMALL = ["slow-small-1k", "slow-small-16k"]


_RUNS: dict[str, tuple[SimulatedCluster, list[Envelope]]] = {}


def _uncommanded(name: str) -> tuple[SimulatedCluster, list[Envelope]]:
    """The scenario run to its end with nobody reacting (cached: several tests read it)."""
    if name not in _RUNS:
        c = make_cluster(LIBRARY[name], validate=False)
        _RUNS[name] = (c, run(c))
    return _RUNS[name]


class Checker:
    """A stand-in for the processor's SDC schedule: after every 100th step, one rank
    self-checks (rotating), and two or three ranks cross-check (rotating pairs)."""

    def __init__(self, world_size: int, every: int = 100, cross: tuple[int, ...] | None = None) -> None:
        self.world_size, self.every, self.cross = world_size, every, cross
        self.issued: list[Command] = []
        self._done: set[tuple[int, int]] = set()

    def __call__(self, c: SimulatedCluster, events: list[Envelope]) -> list[Command]:
        out: list[Command] = []
        for e in events:
            if (
                not isinstance(e, StepTiming)
                or e.rank != 0
                or e.step % self.every
                or c.phase is not Phase.TRAINING
            ):
                continue
            if (e.attempt, e.step) in self._done:
                continue
            self._done.add((e.attempt, e.step))
            k = e.step // self.every
            rank = k % self.world_size
            out.append(
                command(RunSelfCheck, c, step=e.step + 1, ranks=[rank], command_id=f"sc-{e.attempt}-{k}")
            )
            ranks = (
                list(self.cross) if self.cross else [rank, (rank + self.world_size // 2) % self.world_size]
            )
            out.append(
                command(
                    RunCrossRankCheck,
                    c,
                    step=e.step + 1,
                    microbatch_id=f"xr-{e.step}",
                    ranks=ranks,
                    command_id=f"xr-{e.attempt}-{k}",
                )
            )
        self.issued += out
        return out


# --------------------------------------------------------------------------- the library


def test_the_library_has_one_scenario_per_fault_and_two_controls() -> None:
    assert sorted(LIBRARY) == sorted(
        [
            *STRAGGLERS,
            "sdc-bitflip",
            "sdc-wrong-gpu",
            "hang-allreduce",
            "hang-2048",
            "nan-burst",
            "grad-spike",
            "data-fault-repeat",
            "rack-slow-5pct",
            "control-healthy",
            "control-16k",
            *MIXED,
            *ELASTIC,
            *SLOW_SMALL,
        ]
    )
    # the fleet scenarios (run level, issue 46) are fleet_scenario.py's: the others are these
    assert {path.stem for path in LIBRARY_DIR.glob("*.yaml")} == set(LIBRARY) | set(fleet_library())
    for name, sc in LIBRARY.items():
        assert sc.name == name and sc.description
        assert Scenario.builtin(name) == sc  # the CLI's `simulate NAME` finds them too
        assert sc.noise.active, f"{name}: every library run has realistic noise"
        # Small enough for the live pipeline: under ~2 minutes of wall clock at live_speed
        # (the 16,384-rank control runs in real time, live only when named).
        healthy_s = sc.steps * sc.step_time_s
        assert healthy_s / sc.live_speed < 75 or sc.world_size > 1024, name
        if name not in (
            "control-16k",
            "hang-2048",
            "mixed-2048",
            "mixed-2048-b",
            *ELASTIC,
            *SLOW_SMALL,
        ):  # at scale
            # 512 for the racks 5% slow: a rack must be a minority of 8, of 64 ranks each
            assert sc.world_size <= (512 if name == "rack-slow-5pct" else 256) and sc.step_time_s == 0.2
            assert sc.gpu_health_interval_s > 0


@pytest.mark.parametrize(
    ("name", "truth"),
    [
        ("straggler-thermal", FaultTruth("slow", 21, "node-0002", "rack-00", 100, 400, "thermal")),
        ("straggler-power-capped", FaultTruth("slow", 50, "node-0006", "rack-01", 100, 400, "power")),
        ("straggler-hot-aisle", FaultTruth("slow", None, None, "rack-02", 100, 400, "thermal")),
        ("straggler-nvlink", FaultTruth("slow", 90, "node-0011", "rack-02", 100, 400, "link")),
        ("straggler-nic", FaultTruth("slow", 33, "node-0004", "rack-01", 100, 400, "network")),
        ("sdc-bitflip", FaultTruth("bitflip", 3, "node-0000", "rack-00", 250)),
        ("sdc-wrong-gpu", FaultTruth("wrong_gpu", 11, "node-0001", "rack-00", 300)),
        ("hang-allreduce", FaultTruth("hang", 100, "node-0012", "rack-03", 300)),
        ("hang-2048", FaultTruth("hang", 1234, "node-0154", "rack-09", 30)),
        ("nan-burst", FaultTruth("nan", 40, "node-0005", "rack-01", 300, 305)),
        ("grad-spike", FaultTruth("grad_spike", 0, "node-0000", "rack-00", 300)),
        ("data-fault-repeat", FaultTruth("crash", 77, "node-0009", "rack-02", 237, repeat=True)),
    ],
)
def test_truth(name: str, truth: FaultTruth) -> None:
    assert LIBRARY[name].truth() == [truth]


def test_the_racks_5_percent_slow_are_one_hot_aisle_and_one_contended_network() -> None:
    hot, network = LIBRARY["rack-slow-5pct"].truth()
    assert hot == FaultTruth("slow", None, None, "rack-02", 60, 260, "thermal")
    assert network == FaultTruth("slow", None, None, "rack-05", 100, None, "network")
    assert (hot.diagnosis, network.diagnosis) == (Diagnosis.ENVIRONMENTAL, Diagnosis.NETWORK_CONTENTION)


def test_controls_have_no_truth() -> None:
    assert LIBRARY["control-healthy"].truth() == [] and LIBRARY["control-16k"].truth() == []
    assert LIBRARY["control-16k"].world_size == 16_384


def test_straggler_diagnoses_follow_seed_r2() -> None:
    diagnoses = {name: LIBRARY[name].truth()[0].diagnosis for name in STRAGGLERS}
    assert diagnoses == {
        "straggler-thermal": Diagnosis.NODE_THERMAL,
        "straggler-power-capped": Diagnosis.NODE_THERMAL,
        "straggler-hot-aisle": Diagnosis.ENVIRONMENTAL,
        "straggler-nvlink": Diagnosis.NODE_LINK,
        "straggler-nic": Diagnosis.NETWORK_CONTENTION,
    }
    assert LIBRARY["hang-allreduce"].truth()[0].diagnosis is None


# --------------------------------------------------------------------------- stragglers


@pytest.mark.parametrize("name", STRAGGLERS)
def test_a_straggler_is_slow_long_enough_and_nobody_else_is(name: str) -> None:
    sc = LIBRARY[name]
    [fault] = sc.faults
    assert isinstance(fault, SlowFault) and fault.to_step is not None
    assert fault.to_step - fault.from_step >= 200  # flagged after 100, with room to act
    c, events = _uncommanded(name)
    timings = of(StepTiming, events)
    culprits = {t.rank for t in timings if t.node in _target_nodes(sc, fault)}
    if fault.rank is not None:
        culprits = {fault.rank}
    streaks = straggler_streaks(timings)
    flagged = {rank for rank, n in streaks.items() if n >= 100}
    if fault.rank is not None:
        assert flagged == culprits
        assert streaks[fault.rank] >= fault.to_step - fault.from_step - 5
    else:  # a whole rack: a quarter of the ranks, which moves the median and MAD
        assert flagged <= culprits and len(flagged) >= 0.75 * len(culprits)

    # The measured slowdown (compute over the median of the other ranks, same steps).
    during = [t for t in timings if fault.from_step <= t.step < fault.to_step]
    mine = statistics.median(t.compute_s for t in during if t.rank in culprits)
    others = statistics.median(t.compute_s for t in during if t.rank not in culprits)
    assert mine / others == pytest.approx(fault.factor, abs=0.03)
    if name == "straggler-thermal":
        assert 1.18 <= mine / others <= 1.25
    # It recovers: after to_step it is a rank like the others.
    after = [t for t in timings if t.step >= fault.to_step + 5]
    ratio = statistics.median(t.compute_s for t in after if t.rank in culprits) / statistics.median(
        t.compute_s for t in after if t.rank not in culprits
    )
    assert ratio == pytest.approx(1.0, abs=0.04)


def _target_nodes(sc: Scenario, fault: SlowFault) -> set[str]:
    if fault.rank is not None:
        return {sc.node_of(fault.rank)}
    if fault.node is not None:
        return {fault.node}
    return {node for node, rack in sc.racks().items() if rack == fault.rack}


def _health(name: str) -> tuple[Scenario, SlowFault, list[GpuHealth], list[GpuHealth]]:
    """The scenario, its slow fault, and the GPU health of its culprits / of everyone else
    while the fault is active."""
    sc = LIBRARY[name]
    [fault] = sc.faults
    assert isinstance(fault, SlowFault)
    _, events = _uncommanded(name)
    nodes = _target_nodes(sc, fault)
    window = [h for h in of(GpuHealth, events) if fault.from_step + 1 <= h.step < (fault.to_step or 0) - 1]
    culprit = [(h.rank == fault.rank if fault.rank is not None else h.node in nodes) for h in window]
    bad = [h for h, is_bad in zip(window, culprit, strict=True) if is_bad]
    good = [h for h, is_bad in zip(window, culprit, strict=True) if not is_bad]
    assert len(bad) >= 10 and good
    return sc, fault, bad, good


def test_thermal_straggler_is_hot_and_throttled_alone_in_its_rack() -> None:
    sc, _, bad, good = _health("straggler-thermal")
    assert all(
        h.temperature_c > THERMAL_LIMIT_C and h.thermal_throttle and h.sm_clock_mhz < 1700 for h in bad
    )
    assert all(h.temperature_c < 80 and not h.thermal_throttle and not h.power_capped for h in good)
    rack = {h.temperature_c for h in good if sc.racks()[h.node] == "rack-00"}
    assert statistics.median(rack) < THERMAL_LIMIT_C  # not environmental


def test_power_capped_straggler_reports_the_cap_at_a_normal_temperature() -> None:
    _, _, bad, good = _health("straggler-power-capped")
    assert all(h.power_capped and not h.thermal_throttle and h.temperature_c < 80 for h in bad)
    assert all(h.sm_clock_mhz < 1700 for h in bad)
    assert not any(h.power_capped for h in good)


def test_hot_aisle_every_node_of_the_rack_is_over_the_limit() -> None:
    sc, _, bad, good = _health("straggler-hot-aisle")
    rack_nodes = {node for node, rack in sc.racks().items() if rack == "rack-02"}
    assert {h.node for h in bad} == rack_nodes
    for node in rack_nodes:
        assert all(h.temperature_c > THERMAL_LIMIT_C and h.thermal_throttle for h in bad if h.node == node)
    assert statistics.median(h.temperature_c for h in bad) > THERMAL_LIMIT_C  # the rack's median
    assert all(h.temperature_c < 80 for h in good)
    # The aisle cools down after the window.
    _, events = _uncommanded("straggler-hot-aisle")
    later = [h for h in of(GpuHealth, events) if h.step >= 401 and h.node in rack_nodes]
    assert later and all(h.temperature_c < 80 for h in later)


def test_degraded_nvlink_is_narrow_and_its_retries_climb() -> None:
    _, _, bad, good = _health("straggler-nvlink")
    assert all(h.nvlink_width < h.nvlink_expected_width for h in bad)
    retries = [h.nvlink_retries for h in sorted(bad, key=lambda h: h.ts)]
    assert retries == sorted(retries) and retries[-1] > retries[0] + 1_000
    assert all(h.nvlink_width == h.nvlink_expected_width and h.nvlink_retries == 0 for h in good)
    assert all(h.temperature_c < 80 and not h.power_capped for h in bad)


def test_nic_contention_saturates_the_nic_only() -> None:
    _, _, bad, good = _health("straggler-nic")
    assert all(h.nic_utilization > 0.9 for h in bad)
    assert all(h.nic_utilization < 0.6 for h in good)
    assert all(h.nvlink_width == h.nvlink_expected_width and h.temperature_c < 80 for h in bad)


# --------------------------------------------------------------------------- SDC


def test_bitflip_fails_exactly_one_commanded_self_check_then_rolls_back_clean() -> None:
    sc = LIBRARY["sdc-bitflip"]
    checker = Checker(sc.world_size)
    rolled_back: list[int] = []

    def controller(c: SimulatedCluster, events: list[Envelope]) -> list[Command]:
        out = checker(c, events)
        if c.attempt == 0 and c.phase is Phase.TRAINING and c.commands_applied == 0:
            out.append(command(RunSelfCheck, c, step=50, ranks=[3], command_id="early"))  # before the flip
        for e in events:
            if isinstance(e, SdcSelfCheck) and not e.passed and not rolled_back:
                # What the processor does (R6): quarantine, roll back to the newest
                # checkpoint at or before the last passing check.
                watermark = max(validated.values())
                target = max(step for step in validated if step <= watermark)
                rolled_back.append(target)
                out += [
                    command(QuarantineNode, c, node=e.node),
                    command(Rollback, c, checkpoint_step=target, uri=""),
                ]
            elif isinstance(e, CheckpointValidated):
                validated[e.checkpoint_step] = e.last_verified_step
        return out

    validated: dict[int, int] = {}
    c = make_cluster(sc, validate=True)
    events = run(c, controller=controller)
    checks = of(SdcSelfCheck, events)
    failed = [s for s in checks if not s.passed]
    assert len(failed) == 1
    [bad] = failed
    assert (bad.rank, bad.node) == (3, "node-0000") and bad.step >= 250
    asked = [cmd for cmd in checker.issued if isinstance(cmd, RunSelfCheck) and cmd.ranks == [3]]
    assert any(cmd.step <= bad.step for cmd in asked)  # it answered a command for rank 3
    assert any(s.rank == 3 and s.passed and s.step < 250 for s in checks)  # before the flip: clean
    again = [s for s in checks if s.rank == 3 and s.attempt == 1]
    assert again and all(s.passed and s.node == "spare-0000" for s in again)  # quarantined: a spare
    assert [(f.kind, f.rank, f.step) for f in c.fired] == [("bitflip", 3, bad.step)]
    # R6: the watermark stops at the last passing check before the flip.
    passing_before = max(s.step for s in checks if s.passed and s.step < bad.step and s.attempt == 0)
    assert rolled_back == [max(step for step in validated if step <= passing_before)]
    restarted = of(RunStarted, events)[-1]
    assert restarted.resumed_from_step == rolled_back[0] and restarted.nodes[0] == "spare-0000"
    assert c.phase is Phase.FINISHED


def test_wrong_gpu_passes_self_checks_and_fails_cross_rank_checks() -> None:
    sc = LIBRARY["sdc-wrong-gpu"]
    checker = Checker(sc.world_size)
    c = make_cluster(sc, validate=True)
    events = run(c, controller=checker)
    selfs = of(SdcSelfCheck, events)
    assert selfs and all(s.passed for s in selfs)
    assert any(s.rank == 11 and s.step >= 300 for s in selfs)  # it was self-checked, and passed
    crosses = of(CrossRankCheck, events)
    good, bad = [], []
    for x in crosses:
        rel = abs(x.values[0] - x.values[1]) / abs(x.values[1])
        (bad if 11 in x.ranks and x.step >= 300 else good).append(rel)
    assert len(good) >= 10 and bad
    tolerance = 5 * math.sqrt(statistics.fmean(r * r for r in good))  # 5 sigma of the good spread
    assert 0 < max(good) < 1e-6 and tolerance < 1e-6
    assert all(r > 100 * tolerance for r in bad)
    assert [(f.kind, f.rank) for f in c.fired] == [("wrong_gpu", 11)]

    # A third rank bisects: the two good ranks agree, the wrong one stands out.
    c3 = make_cluster(sc, validate=True)
    run(c3, until=70)  # past step 300
    assert c3.last_completed > 300
    c3.apply(
        command(RunCrossRankCheck, c3, step=c3.last_completed + 1, microbatch_id="bisect", ranks=[11, 2, 7])
    )
    [x] = of(CrossRankCheck, run(c3, until=72))
    values = dict(zip(x.ranks, x.values, strict=True))
    assert abs(values[2] - values[7]) / values[7] < tolerance
    assert abs(values[11] - values[2]) / values[2] > 100 * tolerance
    assert values[11] / values[2] == pytest.approx(1 + 1e-4, rel=1e-6)


# --------------------------------------------------------------------------- hang, NaN, grad, data


def test_hang_inside_the_allreduce_has_its_own_collective_stack() -> None:
    c = make_cluster(LIBRARY["hang-allreduce"], validate=False)
    events = run(c, until=75)
    assert c.phase is Phase.STALLED and c.live_ranks == 128
    assert max(t.step for t in of(StepTiming, events)) == 299
    exits = {e.rank: e for e in of(RankExit, c.apply(command(Abort, c, stack_dump=True)).events)}
    culprit = exits[100].stack_signature
    assert culprit.startswith(COLLECTIVE_STACK) and culprit != COLLECTIVE_STACK  # inside the all-reduce
    assert {e.stack_signature for r, e in exits.items() if r != 100} == {COLLECTIVE_STACK}
    [started] = of(RunStarted, run(c, until=85))
    assert started.resumed_from_step == 250


def test_nan_burst_is_nan_on_every_rank_for_five_steps() -> None:
    _, events = _uncommanded("nan-burst")
    stats = of(StepStats, events)
    bad = {s.step for s in stats if not s.finite}
    assert bad == set(range(300, 305))
    for step in range(300, 305):
        at = [s for s in stats if s.step == step]
        assert len(at) == 128 and all(math.isnan(s.loss) and math.isnan(s.grad_norm) for s in at)
    # Aborted mid-burst, the re-run is clean: a transient, not the data.
    c = make_cluster(LIBRARY["nan-burst"], validate=False)
    events = run(c, controller=_abort_on(lambda e: isinstance(e, StepStats) and not e.finite))
    rerun = [s for s in of(StepStats, events) if s.attempt == 1]
    assert rerun and all(s.finite for s in rerun) and min(s.step for s in rerun) == 251


def test_grad_spike_is_far_over_ten_times_the_running_p99() -> None:
    _, events = _uncommanded("grad-spike")
    grads = {s.step: s.grad_norm for s in of(StepStats, events) if s.rank == 0}
    history = [grads[step] for step in range(300)]
    assert grads[300] > 10 * quantile(history, 0.99)
    assert all(s.finite for s in of(StepStats, events))
    assert max(grads[s] for s in grads if s != 300) < 10 * quantile(history, 0.99)


def test_data_fault_fails_at_the_same_step_after_every_restart() -> None:
    c = make_cluster(LIBRARY["data-fault-repeat"], validate=False)
    events = run(c, controller=_abort_on(lambda e: isinstance(e, RankExit) and not e.requested))
    crashes = [e for e in of(RankExit, events) if not e.requested]
    assert [(e.attempt, e.rank, e.step, e.exit_code, e.signal) for e in crashes] == [
        (a, 77, 236, 1, None) for a in range(4)
    ]
    assert [s.resumed_from_step for s in of(RunStarted, events)] == [-1, 200, 200, 200]
    assert [(f.kind, f.step) for f in c.fired] == [("crash", 237)] * 4
    assert c.phase is Phase.FAILED and c.done and "giving up after 3 restarts" in c.notes[-1].text


def _abort_on(trigger: Callable[[Envelope], bool]) -> Any:
    """A controller that aborts (with stacks) the first time `trigger` sees an event of an attempt."""
    aborted: set[int] = set()

    def controller(c: SimulatedCluster, events: list[Envelope]) -> list[Command]:
        if c.attempt in aborted or c.phase in (Phase.WAITING, Phase.FINISHED, Phase.FAILED):
            return []
        if any(trigger(e) for e in events if e.attempt == c.attempt):
            aborted.add(c.attempt)
            return [command(Abort, c, stack_dump=True)]
        return []

    return controller


def test_phantom_ranks_report_well_formed_records_from_outside_the_world() -> None:
    healthy = LIBRARY["control-healthy"]
    fault = {"kind": "phantom_ranks", "ranks": [256, 4100], "from_step": 10, "to_step": 20, "slowdown": 3.0}
    sc = Scenario.parse({**healthy.model_dump(mode="json"), "steps": 30, "faults": [fault]})
    c = make_cluster(sc)  # validate=True: every event through pydantic
    events = run(c)
    phantoms = [e for e in events if e.rank >= sc.world_size]
    assert len(phantoms) == c.phantom_records == 2 * 2 * 10
    assert {(e.rank, e.node) for e in phantoms} == {(256, "node-phantom"), (4100, "node-phantom")}
    assert sorted({e.step for e in phantoms}) == list(range(10, 20))
    timings = [e for e in of(StepTiming, phantoms)]
    median = statistics.median(e.compute_s for e in of(StepTiming, events) if e.rank < sc.world_size)
    assert all(e.compute_s > 2.5 * median for e in timings)  # accepted, they would straggle
    assert [(f.kind, f.rank, f.step) for f in c.fired] == [("phantom_ranks", 256, 10)]
    assert c.phase is Phase.FINISHED


def test_mixed_scenarios_hold_several_faults_and_phantoms_and_say_what_must_not_happen() -> None:
    for name in MIXED:
        sc = LIBRARY[name]
        kinds = {t.kind for t in sc.truth()}
        assert {"slow", "wrong_gpu", "hang", "crash", "phantom_ranks"} <= kinds, name
        assert any(t.repeat for t in sc.truth()), f"{name}: a data fault repeating at one step"
        assert any(t.kind == "slow" and t.node is None for t in sc.truth()), f"{name}: a slow rack"
        assert sc.expect.pages == ["same_step", "facilities"] and "quarantine_innocent" in sc.expect.must_not
        data_fault = max(t.step for t in sc.truth() if t.repeat)
        assert data_fault == max(t.step for t in sc.truth()), f"{name}: its repeats end the run: last"
    assert [LIBRARY[n].world_size for n in MIXED] == [256, 2048, 2048]


# --------------------------------------------------------------------------- controls


def test_control_has_heavy_tailed_noise_and_gc_pauses_but_no_straggler() -> None:
    sc = LIBRARY["control-healthy"]
    checker = Checker(sc.world_size)
    c = make_cluster(sc, validate=False)
    events = run(c, controller=checker)
    assert c.phase is Phase.FINISHED and c.attempt == 0 and c.fired == []
    timings = of(StepTiming, events)
    compute = [t.compute_s for t in timings]
    p50 = statistics.median(compute)
    assert quantile(compute, 0.999) / p50 > 1.2  # heavy tail (a lognormal 0.03 alone: ~1.1)
    gc_pauses = sum(x > p50 + 0.05 + 0.5 * p50 for x in compute)
    assert 3 <= gc_pauses <= 60
    totals = list({t.step: t.total_s for t in timings}.values())
    assert quantile(totals, 0.99) / statistics.median(totals) > 1.4
    assert statistics.median(totals) == pytest.approx(sc.step_time_s, rel=0.1)
    # Nobody is over 3 robust sigma for anywhere near 100 consecutive steps.
    assert max(straggler_streaks(timings).values()) < 20
    health = of(GpuHealth, events)
    assert all(
        h.temperature_c < 80 and not h.thermal_throttle and not h.power_capped and h.nic_utilization < 0.6
        for h in health
    )
    assert all(h.nvlink_width == h.nvlink_expected_width and h.nvlink_retries == 0 for h in health)
    stats = [s for s in of(StepStats, events) if s.rank == 0]
    assert all(s.finite for s in stats)
    grads = [s.grad_norm for s in stats]
    assert all(g < 10 * quantile(grads[: i + 1], 0.99) for i, g in enumerate(grads) if i >= 20)
    # Every commanded check answers, and passes.
    assert len(of(SdcSelfCheck, events)) == 6 and all(s.passed for s in of(SdcSelfCheck, events))
    crosses = of(CrossRankCheck, events)
    assert len(crosses) == 6
    assert all(abs(x.values[0] - x.values[1]) / x.values[1] < 1e-6 for x in crosses)


def test_control_16k_starts_and_steps_at_its_step_time() -> None:
    sc = LIBRARY["control-16k"]
    c = make_cluster(sc, validate=False)
    t = c.now
    events: list[Envelope] = []
    while c.last_completed < 4:
        t += 1.0
        events += c.advance(t)
    timings = of(StepTiming, events)
    assert {x.step for x in timings} >= set(range(5)) and len({x.rank for x in timings}) == 16_384
    totals = {x.step: x.total_s for x in timings}
    assert statistics.median(totals.values()) == pytest.approx(2.0, rel=0.1)
