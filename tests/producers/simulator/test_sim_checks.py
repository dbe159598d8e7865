"""Commanded SDC checks (RunSelfCheck, RunCrossRankCheck, RunRingCheck), the verification watermark
(R6), SkipUpdate, the launcher's restart limit, NaN bursts and the noise model."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from trainguard.producers.simulator import CommandRefused, Phase, Scenario, ScenarioError, SimulatedCluster
from trainguard.producers.simulator import scenario as scenario_module
from trainguard.producers.simulator.workload import apply_noise
from trainguard.schemas import (
    Abort,
    CheckpointValidated,
    CrossRankCheck,
    Envelope,
    QuarantineNode,
    RingCheck,
    RunCrossRankCheck,
    RunRingCheck,
    RunSelfCheck,
    RunStarted,
    SdcSelfCheck,
    SkipUpdate,
    StepStats,
    StepTiming,
)

from .simkit import command, make_cluster, of, quantile

BASE: dict[str, Any] = {
    "name": "t",
    "world_size": 16,
    "ranks_per_node": 8,
    "nodes_per_rack": 4,
    "step_time_s": 0.2,
    "steps": 200,
    "checkpoint_every": 25,
    "checkpoint_write_s": 0.2,
    "checkpoint_validate_s": 0.2,
    "heartbeat_interval_s": 1.0,
    "restart_delay_s": 2.0,
    "seed": 11,
}


def scenario(**changes: Any) -> Scenario:
    return Scenario.parse({**BASE, **changes})


def until_step(c: SimulatedCluster, step: int) -> list[Envelope]:
    """Advance until `step` has completed (and no further than the tick it completes in)."""
    out: list[Envelope] = []
    t = c.now
    while c.last_completed < step and not c.done:
        t += 0.05
        out += c.advance(t)
    return out


def until_restarted(c: SimulatedCluster) -> list[Envelope]:
    """Advance until the next attempt has completed its first step."""
    out: list[Envelope] = []
    attempt, t = c.attempt, c.now
    while c.attempt == attempt or c.last_completed <= c.resumed_from_step:
        t += 0.05
        out += c.advance(t)
    return out


def self_check(c: SimulatedCluster, step: int, ranks: list[int] | None, cid: str = "") -> str:
    return c.apply(command(RunSelfCheck, c, step=step, ranks=ranks, command_id=cid)).detail


def cross_check(c: SimulatedCluster, step: int, ranks: list[int] | None, mb: str = "mb") -> str:
    return c.apply(command(RunCrossRankCheck, c, step=step, microbatch_id=mb, ranks=ranks)).detail


# --------------------------------------------------------------------------- self-checks


def test_a_commanded_self_check_runs_at_the_first_step_at_or_after_the_commanded_one() -> None:
    c = make_cluster(scenario())
    until_step(c, 5)
    assert "1 ranks self-check at the first step >= 20" in self_check(c, 20, [7])
    events = until_step(c, 30)
    [check] = of(SdcSelfCheck, events)
    assert (check.rank, check.node, check.step, check.passed) == (7, "node-0000", 20, True)
    assert check.microbatch_id == "mb-000020-r7"
    # A step already past runs at the next step; None means every rank.
    self_check(c, 3, None)
    checks = of(SdcSelfCheck, until_step(c, 33))
    assert {s.rank for s in checks} == set(range(16)) and {s.step for s in checks} == {c.last_completed - 2}
    assert c.self_checks_run == 17


def test_self_check_commands_are_refused_when_no_step_can_run() -> None:
    c = make_cluster(scenario(faults=[{"kind": "crash", "rank": 1, "at_step": 10}]))
    until_step(c, 3)
    with pytest.raises(CommandRefused, match="outside world size"):
        self_check(c, 5, [16])
    with pytest.raises(CommandRefused, match="2 or 3 distinct ranks"):
        cross_check(c, 5, None)
    until_step(c, 9)
    c.advance(c.now + 5)
    assert c.phase is Phase.STALLED
    with pytest.raises(CommandRefused, match="no step will run"):
        self_check(c, 12, [2])


def test_a_bit_flip_fails_the_first_check_at_or_after_its_step_once() -> None:
    c = make_cluster(scenario(faults=[{"kind": "bitflip", "rank": 3, "at_step": 20}]))
    until_step(c, 1)
    for step in (10, 25, 40, 55):
        self_check(c, step, [3], cid=f"sc-{step}")
    self_check(c, 25, [4], cid="other")  # another rank, same step: clean
    events = until_step(c, 60)
    checks = {(s.rank, s.step): s.passed for s in of(SdcSelfCheck, events)}
    assert checks == {(3, 10): True, (3, 25): False, (4, 25): True, (3, 40): True, (3, 55): True}
    assert [(f.kind, f.rank, f.step) for f in c.fired] == [("bitflip", 3, 25)]


def test_a_bit_flip_never_checked_never_shows() -> None:
    c = make_cluster(scenario(faults=[{"kind": "bitflip", "rank": 3, "at_step": 20}]), validate=False)
    until_step(c, 1)
    self_check(c, 30, [2])
    events = until_step(c, 199)
    assert all(s.passed for s in of(SdcSelfCheck, events)) and c.fired == []


def test_a_wrong_gpu_passes_self_checks_and_an_sdc_gpu_fails_both() -> None:
    sc = scenario(faults=[
        {"kind": "wrong_gpu", "rank": 5, "at_step": 0, "bias": 1e-3},
        {"kind": "sdc", "rank": 9, "at_step": 0},
    ])  # fmt: skip
    c = make_cluster(sc)
    until_step(c, 1)
    self_check(c, 10, [5, 9])
    cross_check(c, 10, [5, 0], mb="a")
    cross_check(c, 10, [9, 0], mb="b")
    cross_check(c, 10, [1, 2, 0], mb="c")
    events = until_step(c, 12)
    checks = {s.rank: s.passed for s in of(SdcSelfCheck, events)}
    assert checks == {5: True, 9: False}
    xs = {x.microbatch_id: x for x in of(CrossRankCheck, events)}
    assert set(xs) == {"a", "b", "c"} and all(x.step == 10 for x in xs.values())
    a, b, good = xs["a"], xs["b"], xs["c"]
    assert (a.rank, a.node, a.ranks) == (5, "node-0000", [5, 0])
    assert a.values[0] / a.values[1] == pytest.approx(1.001, rel=1e-6)
    assert abs(b.values[0] / b.values[1] - 1) > 1e-4
    assert len(good.values) == 3 and max(good.values) / min(good.values) - 1 < 2e-6
    assert sorted(f.kind for f in c.fired) == ["sdc", "wrong_gpu"]


def test_good_hardware_cross_rank_spread_is_the_scenario_noise() -> None:
    c = make_cluster(scenario(world_size=64, cross_rank_noise=1e-7), validate=False)
    until_step(c, 1)
    for i in range(200):
        cross_check(c, 5, [i % 64, (i * 7 + 1) % 64] if i % 64 != (i * 7 + 1) % 64 else [0, 1], mb=f"m{i}")
    xs = of(CrossRankCheck, until_step(c, 6))
    assert len(xs) == 200
    rel = [x.values[0] / x.values[1] - 1 for x in xs]
    assert statistics.pstdev(rel) == pytest.approx(math.sqrt(2) * 1e-7, rel=0.2)
    assert abs(statistics.fmean(rel)) < 3e-8
    # The same microbatch at the same step on the same rank: the same value (deterministic).
    again = make_cluster(scenario(world_size=64, cross_rank_noise=1e-7), validate=False)
    until_step(again, 1)
    cross_check(again, 5, [xs[0].ranks[0], xs[0].ranks[1]], mb="m0")
    [x0] = of(CrossRankCheck, until_step(again, 6))
    assert x0.values == xs[0].values


def test_a_ring_check_runs_on_every_live_rank_and_a_wrong_gpu_is_wrong_in_both_of_its_values() -> None:
    c = make_cluster(scenario(faults=[{"kind": "wrong_gpu", "rank": 5, "at_step": 0, "bias": 1e-3}]))
    until_step(c, 1)
    detail = c.apply(command(RunRingCheck, c, step=10, check_id="ring-a0-s10", offset=3)).detail
    assert "(r + 3) mod 16" in detail
    rings = {x.rank: x for x in of(RingCheck, until_step(c, 12))}
    assert sorted(rings) == list(range(16)) and all(
        x.step == 10 and x.check_id == "ring-a0-s10" for x in rings.values()
    )
    assert all(x.peer_rank == (r + 3) % 16 for r, x in rings.items())

    def gap(r: int) -> float:  # the edge r -> r + 3: r's recomputation against the peer's own value
        return rings[r].peer_value / rings[rings[r].peer_rank].own_value - 1

    assert gap(2) == pytest.approx(-1e-3 / 1.001, rel=1e-3)  # 5's own value is off ...
    assert gap(5) == pytest.approx(1e-3, rel=1e-3)  # ... and so is its recomputation of 8's
    assert all(abs(gap(r)) < 2e-6 for r in rings if r not in (2, 5))  # good hardware: the noise
    assert c.ring_checks_run == 1 and [f.kind for f in c.fired] == ["wrong_gpu"]
    with pytest.raises(CommandRefused):
        c.apply(command(RunRingCheck, c, step=20, check_id="bad", offset=16))


def test_a_wrong_gpu_moved_to_a_spare_is_clean() -> None:
    c = make_cluster(scenario(faults=[{"kind": "wrong_gpu", "rank": 9, "at_step": 0}]))
    until_step(c, 30)
    c.apply(command(QuarantineNode, c, node="node-0001"))
    c.apply(command(Abort, c, stack_dump=False))
    until_restarted(c)
    cross_check(c, 40, [9, 1])
    [x] = of(CrossRankCheck, until_step(c, 41))
    assert x.node == "spare-0000" and abs(x.values[0] / x.values[1] - 1) < 1e-6


# --------------------------------------------------------------------------- watermark (R6)


def _validated(events: list[Envelope]) -> dict[int, int]:
    return {v.checkpoint_step: v.last_verified_step for v in of(CheckpointValidated, events)}


def test_watermark_is_the_checkpoint_step_until_a_check_runs_then_the_last_passing_check() -> None:
    c = make_cluster(scenario(faults=[{"kind": "bitflip", "rank": 2, "at_step": 60}]))
    events = until_step(c, 30)
    self_check(c, 40, [1], cid="a")
    events += until_step(c, 55)
    self_check(c, 70, [2], cid="b")  # the flip: freezes the watermark at 40
    events += until_step(c, 80)
    self_check(c, 90, [3], cid="c")  # passes, but the attempt is suspect: still 40
    events += until_step(c, 110)
    assert _validated(events) == {25: 25, 50: 40, 75: 40, 100: 40}


def test_watermark_after_a_restart_is_the_resumed_checkpoints() -> None:
    c = make_cluster(scenario())
    events = until_step(c, 1)
    self_check(c, 10, [1], cid="a")
    events += until_step(c, 60)
    c.apply(command(Abort, c, stack_dump=False))
    events += until_restarted(c) + until_step(c, 80)
    assert [s.resumed_from_step for s in of(RunStarted, events)] == [-1, 50]
    assert _validated(events) == {25: 10, 50: 10, 75: 10}
    self_check(c, 85, [4], cid="b")
    events += until_step(c, 105)
    assert _validated(events)[100] == 85


def test_with_sdc_check_every_the_scenario_rotation_sets_the_watermark() -> None:
    c = make_cluster(scenario(sdc_check_every=20))
    events = until_step(c, 60)
    assert _validated(events) == {25: 20, 50: 40}


# --------------------------------------------------------------------------- other commands


def test_skip_update_is_counted() -> None:
    c = make_cluster(scenario())
    until_step(c, 3)
    assert "(1 skipped so far" in c.apply(command(SkipUpdate, c, step=3, command_id="s1")).detail
    assert "(2 skipped so far" in c.apply(command(SkipUpdate, c, step=4, command_id="s2")).detail
    assert c.skipped_updates == [3, 4]


def test_the_launcher_gives_up_after_max_restarts() -> None:
    sc = scenario(max_restarts=1, orphan_restart_after_s=5, faults=[
        {"kind": "crash", "rank": 4, "at_step": 30, "repeat": True},
    ])  # fmt: skip
    c = make_cluster(sc)
    t = c.now
    while not c.done:
        t += 0.5
        c.advance(t)
    assert c.phase is Phase.FAILED and c.attempt == 1
    assert [f.attempt for f in c.fired] == [0, 1] and "giving up after 1 restarts" in c.notes[-1].text
    with pytest.raises(CommandRefused, match="no step will run"):
        self_check(c, 40, [1])
    assert "nothing to abort" in c.apply(command(Abort, c)).detail


# --------------------------------------------------------------------------- NaN bursts


def test_a_single_rank_nan_burst_poisons_the_gradient_everywhere() -> None:
    c = make_cluster(scenario(faults=[{"kind": "nan", "rank": 6, "at_step": 40, "steps": 3}]))
    stats = of(StepStats, until_step(c, 50))
    bad = [s for s in stats if not s.finite]
    assert {s.step for s in bad} == {40, 41, 42} and len(bad) == 3 * 16
    assert all(math.isnan(s.grad_norm) for s in bad)
    assert {s.rank for s in bad if math.isnan(s.loss)} == {6}
    assert (
        scenario(faults=[{"kind": "nan", "rank": 6, "at_step": 40, "steps": 3}]).truth()[0].until_step == 43
    )


# --------------------------------------------------------------------------- noise


def test_noise_validates() -> None:
    with pytest.raises(ScenarioError, match="gc_pause_s"):
        scenario(noise={"gc_pause_s": [0.3, 0.05]})
    with pytest.raises(ScenarioError, match="tail_max"):
        scenario(noise={"tail_min": 0.5, "tail_max": 0.2})
    with pytest.raises(ScenarioError, match="noise.tail_prob"):
        scenario(noise={"tail_prob": 2})
    with pytest.raises(ScenarioError, match="repeat"):
        scenario(faults=[{"kind": "bitflip", "rank": 1, "at_step": 5, "repeat": True}])
    assert not scenario().noise.active and scenario(noise={"gc_pause_prob": 0.1}).noise.active


def test_tail_events_happen_at_the_configured_rate_with_a_pareto_tail() -> None:
    import random

    sc = scenario(noise={"tail_prob": 0.01, "tail_alpha": 2.0, "tail_min": 0.1, "tail_max": 5.0})
    rng = random.Random(3)
    ratios: list[float] = []
    for _ in range(2_000):
        compute = [1.0] * 500
        apply_noise(compute, sc.noise, rng)
        ratios += [x - 1 for x in compute if x != 1.0]
    assert len(ratios) / 1_000_000 == pytest.approx(0.01, rel=0.05)
    assert min(ratios) >= 0.1 and max(ratios) <= 5.0
    # Pareto(0.1, 2): P(x > 0.2) = 1/4, P(x > 0.4) = 1/16.
    assert sum(r > 0.2 for r in ratios) / len(ratios) == pytest.approx(0.25, abs=0.02)
    assert sum(r > 0.4 for r in ratios) / len(ratios) == pytest.approx(1 / 16, abs=0.01)


def test_gc_pauses_and_rank_spread_show_in_compute_and_are_deterministic() -> None:
    noisy = scenario(steps=300, noise={"gc_pause_prob": 0.1, "gc_pause_s": [0.05, 0.3], "rank_spread": 0.02})
    runs = []
    for _ in range(2):
        c = make_cluster(noisy, validate=False)
        runs.append(of(StepTiming, until_step(c, 299)))
    assert [t.compute_s for t in runs[0]] == [t.compute_s for t in runs[1]]
    compute = [t.compute_s for t in runs[0]]
    median = statistics.median(compute)
    pauses = [x - median for x in compute if x > median + 0.04]
    assert 15 <= len(pauses) <= 50 and max(pauses) < 0.32
    # Persistent per-rank speed: each rank's own median differs, steadily.
    per_rank = {r: statistics.median(t.compute_s for t in runs[0] if t.rank == r) for r in range(16)}
    assert max(per_rank.values()) / min(per_rank.values()) > 1.02
    assert statistics.median({t.step: t.total_s for t in runs[0]}.values()) == pytest.approx(0.2, rel=0.05)
    plain = of(StepTiming, until_step(make_cluster(scenario(steps=300), validate=False), 299))
    assert quantile([t.compute_s for t in plain], 1.0) / statistics.median(t.compute_s for t in plain) < 1.2


def test_library_names_must_match_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "one.yaml").write_text("name: two\nworld_size: 8\nstep_time_s: 1\nsteps: 5\n")
    monkeypatch.setattr(scenario_module, "LIBRARY_DIR", tmp_path)
    with pytest.raises(ScenarioError, match="differs from the file name"):
        Scenario.library()
    (tmp_path / "one.yaml").write_text("name: one\nworld_size: 8\nstep_time_s: 1\nsteps: 5\n")
    assert list(Scenario.library()) == ["one"]


def test_fast_construction_of_check_events_matches_validated() -> None:
    from trainguard.schemas import encode

    sc = scenario(noise={"tail_prob": 0.01, "gc_pause_prob": 0.1, "rank_spread": 0.01}, faults=[
        {"kind": "wrong_gpu", "rank": 5, "at_step": 0},
        {"kind": "bitflip", "rank": 2, "at_step": 0},
        {"kind": "nan", "rank": 1, "at_step": 12, "steps": 2, "all_ranks": True},
    ])  # fmt: skip
    streams = []
    for validate in (False, True):
        c = make_cluster(sc, validate=validate)
        events = until_step(c, 3)
        self_check(c, 5, [2, 5])
        cross_check(c, 5, [5, 0, 9])
        streams.append([encode(e) for e in events + until_step(c, 20)])
    assert streams[0] == streams[1]
    kinds = {e.split(b'"')[3].split(b"/")[0] for e in streams[0]}
    assert {b"cross_rank_check", b"sdc_self_check", b"step_stats"} <= kinds
