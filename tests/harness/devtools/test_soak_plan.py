"""The chaos soak's plan, without a broker: Poisson kills at the configured rate, every
victim kind in each round of three, rank kills as crash faults in valid scenarios."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from harness.devtools.soak_plan import SoakConfig, Victim, kill_rate, plan_kills, run_scenario, step_at
from trainguard.producers.simulator.scenario import CrashFault, HangFault, SlowFault


def test_kills_arrive_at_the_rate_and_every_round_hits_every_kind() -> None:
    config = SoakConfig(minutes=60, kill_rate_per_min=6, workers=2, runs=3, seed=5)
    plan = plan_kills(config, random.Random(config.seed))
    assert 300 < len(plan) < 420  # 6/min over an hour: 354 expected (warm-up excluded)
    assert all(config.warmup_s < k.at_s < config.duration_s for k in plan)
    assert [k.at_s for k in plan] == sorted(k.at_s for k in plan)
    for i in range(0, len(plan) - 2, 3):
        assert {k.victim for k in plan[i : i + 3]} == set(Victim)
    low, high = config.restart_delay_s
    assert all(low <= k.restart_after_s <= high for k in plan if k.victim is not Victim.RANK)
    assert Counter(k.target for k in plan if k.victim is Victim.WORKER).keys() == {0, 1}


def test_the_same_seed_plans_the_same_soak() -> None:
    config = SoakConfig(minutes=5, kill_rate_per_min=4, seed=11)
    assert plan_kills(config, random.Random(11)) == plan_kills(config, random.Random(11))
    assert plan_kills(config, random.Random(11)) != plan_kills(config, random.Random(12))


def test_each_runs_rank_kills_are_crash_faults_at_the_step_it_should_be_in() -> None:
    config = SoakConfig(minutes=2, kill_rate_per_min=30, runs=2, seed=3)
    rng = random.Random(config.seed)
    plan = plan_kills(config, rng)
    scenarios = [run_scenario(config, i, plan, rng) for i in range(config.runs)]
    for i, scenario in enumerate(scenarios):
        mine = [k for k in plan if k.victim is Victim.RANK and k.target == i]
        crashes = [f for f in scenario.faults if isinstance(f, CrashFault)]
        for crash, kill in zip(crashes, mine, strict=True):  # moved on a step where two coincide
            planned = max(1, step_at(kill.at_s, config.speed))
            assert crash.rank == kill.rank and planned <= crash.at_step <= planned + len(crashes)
        assert sum(isinstance(f, HangFault) for f in scenario.faults) == 1
        assert sum(isinstance(f, SlowFault) for f in scenario.faults) == 1
        stalls = [f.at_step for f in scenario.faults if isinstance(f, CrashFault | HangFault)]
        assert len(stalls) == len(set(stalls))  # one interruption per step


@pytest.mark.parametrize(("text", "per_min"), [("6/min", 6.0), ("6", 6.0), ("0.5/s", 30.0), ("120/h", 2.0)])
def test_kill_rates_are_read_per_minute(text: str, per_min: float) -> None:
    assert kill_rate(text) == per_min


@pytest.mark.parametrize("text", ["-1/min", "3/week", "nan", "fast"])
def test_bad_kill_rates_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        kill_rate(text)
