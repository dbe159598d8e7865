"""The chaos soak's plan (issue 7 scenario 6), drawn from one seed before anything
starts, so that a soak is reproducible up to the machine's timing: when each kill
strikes, whom, how long the victim stays down, and the simulated runs with their
faults.

Kills arrive as a Poisson process at the configured rate. Victim kinds are drawn in
rounds without replacement (each run of three kills hits a worker, the archive writer
and a rank, in a random order), so even a short soak hits every kind. A rank kill is a
crash fault in its run's scenario at the step the run is expected to be in at that
moment: the simulator injects faults from its scenario only, and one SIGKILLed rank of
a synchronous job is what a crash fault models. A run falls behind that schedule by
each restart, so a crash may strike a little later than planned (the report counts the
crashes that struck).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

from trainguard.producers.simulator.scenario import CrashFault, HangFault, Scenario, SlowFault


class Victim(StrEnum):
    WORKER = "worker"
    ARCHIVE = "archive"
    RANK = "rank"


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    kill_rate_per_min: float
    workers: int = 2
    runs: int = 3
    seed: int = 0
    world_size: int = 16
    #: Simulated time compression; events carry simulated time.
    speed: float = 1.0
    #: A killed process is restarted after a delay drawn uniformly from this range.
    restart_delay_s: tuple[float, float] = (1.0, 5.0)
    #: No kill in the first seconds: the pipeline is warming up.
    warmup_s: float = 5.0
    snapshot_interval_s: float = 3.0
    #: The simulated job's healthy step and node size (the defaults: STEP_TIME_S, RANKS_PER_NODE).
    step_time_s: float = 0.2
    ranks_per_node: int = 4

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0


@dataclass(frozen=True)
class Kill:
    at_s: float  # seconds after the load started
    victim: Victim
    #: The worker slot, or the run (for a rank kill); the archive writer has one slot.
    target: int
    rank: int = -1
    restart_after_s: float = 0.0


#: The simulated job of every run by default: 0.2 s steps, 4 ranks per node, 2 nodes per rack.
STEP_TIME_S = SoakConfig.step_time_s
RANKS_PER_NODE = SoakConfig.ranks_per_node


def plan_kills(config: SoakConfig, rng: random.Random) -> list[Kill]:
    kills: list[Kill] = []
    rounds: list[Victim] = []
    rate_per_s = config.kill_rate_per_min / 60.0
    t = config.warmup_s
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        if t >= config.duration_s:
            break
        if not rounds:
            rounds = list(Victim)
            rng.shuffle(rounds)
        victim = rounds.pop()
        delay = rng.uniform(*config.restart_delay_s)
        if victim is Victim.WORKER:
            kills.append(Kill(t, victim, rng.randrange(config.workers), restart_after_s=delay))
        elif victim is Victim.ARCHIVE:
            kills.append(Kill(t, victim, 0, restart_after_s=delay))
        else:
            kills.append(Kill(t, victim, rng.randrange(config.runs), rank=rng.randrange(config.world_size)))
    return kills


def step_at(t_s: float, speed: float, step_time_s: float = STEP_TIME_S) -> int:
    """The step a run is expected to be in `t_s` wall seconds after its start."""
    return int(t_s * speed / step_time_s)


def run_scenario(config: SoakConfig, index: int, kills: list[Kill], rng: random.Random) -> Scenario:
    """Run `index`'s job: its planned rank crashes, plus a hang in the middle third and a
    thermal straggler from early on (so hang aborts, straggler flags and evictions flow
    as well as the crash's interruption and quarantine)."""
    steps = (
        step_at(config.duration_s, config.speed, config.step_time_s) + 500
    )  # room for the restarts' re-runs
    taken: set[int] = set()

    def free_step(step: int) -> int:
        while step in taken:  # one stall fault per step: each one is an interruption of its own
            step += 1
        taken.add(step)
        return step

    faults: list[CrashFault | HangFault | SlowFault] = []
    for kill in kills:
        if kill.victim is Victim.RANK and kill.target == index:
            step = free_step(max(1, step_at(kill.at_s, config.speed, config.step_time_s)))
            faults.append(CrashFault(kind="crash", rank=kill.rank, at_step=step))
    last = step_at(config.duration_s, config.speed, config.step_time_s)
    hang_step = free_step(rng.randrange(max(1, last // 3), max(2, 2 * last // 3)))
    faults.append(HangFault(kind="hang", rank=rng.randrange(config.world_size), at_step=hang_step))
    slow_from = min(steps - 2, 20 + rng.randrange(30))
    faults.append(
        SlowFault(kind="slow", rank=rng.randrange(config.world_size), from_step=slow_from,
                  to_step=min(steps - 1, slow_from + 400), factor=1.3, cause="thermal")
    )  # fmt: skip
    return Scenario(
        name=f"soak-{index}",
        description=f"chaos soak run {index}: planned rank crashes, a hang, a thermal straggler",
        world_size=config.world_size,
        ranks_per_node=config.ranks_per_node,
        nodes_per_rack=2,
        step_time_s=config.step_time_s,
        steps=steps,
        checkpoint_every=25,
        checkpoint_blocking_s=0.02,
        checkpoint_write_s=0.2,
        checkpoint_validate_s=0.2,
        heartbeat_interval_s=max(1.0, 2.5 * config.step_time_s),  # 5 s (the default) at 2 s steps
        gpu_health_interval_s=2.0,
        restart_delay_s=2.0,
        # A crash while every worker is down waits for its abort; the launcher's own
        # timeout tears the attempt down after this, as torchrun's would. Not sooner than
        # a killed worker's partitions are back (~30 s down at 2,048 ranks on 2 cores):
        # given up earlier, the hang's stacks are lost with the attempt.
        orphan_restart_after_s=60.0,
        seed=config.seed * 1000 + index,
        faults=faults,
    )


def kill_rate(text: str) -> float:
    """`6/min`, `0.5/s` or a bare number (per minute) -> kills per minute."""
    value, _, unit = text.strip().partition("/")
    rate = float(value)
    per = {"": 1.0, "min": 1.0, "m": 1.0, "s": 60.0, "h": 1 / 60}.get(unit.strip().lower())
    if per is None or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"a kill rate is K/min, K/s or K/h with K >= 0, got {text!r}")
    return rate * per
