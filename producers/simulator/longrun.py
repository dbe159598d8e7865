"""A month-long run at run level: failures drawn from the Llama 3 rates, checkpoints and
restarts, fed through the same policy core, with the core's commands applied (issue 4).

The per-rank simulator (cluster.py) emits every rank's telemetry in real time; 30 days at
16,384 ranks would be ~10^11 events. What the decision layer needs from a long run is the
run's course: when each attempt launches and reaches its first step, every step of the
job, every checkpoint, and every failure with its culprit. So this simulator emits what
the launcher and ONE reporting rank see:

- ``RunStarted`` per attempt (the whole world size, nodes and racks, the step resumed from);
- one ``StepTiming`` per job step, from the reporting rank;
- ``CheckpointWritten`` (blocking C seconds) and ``CheckpointValidated`` at each interval;
- a ``RankExit`` of the failed rank at each failure (a crash: the dying rank reports itself,
  so detection is immediate; hangs and SDC are scored by the per-rank library instead).

Failures are a Poisson process in wall-clock time at the Llama 3 rate: 419 unexpected
interruptions in 54 days on 16,384 GPUs (MTBF ~3.09 h), MTBF scaling inversely with the
world size (~49.5 h at 1,024). A failure can strike during a restart too (the restart then
starts over), as in the Llama 3 count, which is over calendar time. Each failure costs
R seconds from detection to the next attempt's first step (`reschedule_fraction` of it
before the launch), and the work since the last checkpoint is re-done.

The core's commands are applied: set-checkpoint-interval changes the interval, quarantine
replaces the node with a spare before the restart. `Truth` keeps what really happened, so
a test can check the core's goodput accounting against it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ...schemas import (
    Command,
    Envelope,
    RankExit,
    StepTiming,
)
from .runlevel import DAY_S as _DAY
from .runlevel import LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS, RunLevel, llama3_mtbf_s

__all__ = [
    "LLAMA3_DAYS",
    "LLAMA3_GPUS",
    "LLAMA3_INTERRUPTIONS",
    "Core",
    "LongRun",
    "Truth",
    "llama3_mtbf_s",
    "simulate",
]


@dataclass(frozen=True)
class LongRun:
    """One long run. The defaults are the seed's: C = 30 s, R = 600 s."""

    run_id: str = "longrun"
    world_size: int = 16_384
    ranks_per_node: int = 8
    nodes_per_rack: int = 32
    days: float = 30.0
    step_s: float = 10.0
    checkpoint_s: float = 30.0
    restart_s: float = 600.0
    reschedule_fraction: float = 0.5
    mtbf_s: float | None = None  # None: the Llama 3 rate at this world size
    start_ts: float = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    seed: int = 0

    @property
    def failure_mtbf_s(self) -> float:
        return self.mtbf_s if self.mtbf_s is not None else llama3_mtbf_s(self.world_size)

    @property
    def end_ts(self) -> float:
        return self.start_ts + self.days * _DAY

    def expected_interruptions(self) -> float:
        return self.days * _DAY / self.failure_mtbf_s


@dataclass
class Truth:
    """What the simulated run really spent its time on (seconds), and what the core did."""

    elapsed_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0
    checkpoints: int = 0
    steps: int = 0  # useful steps (the high-water step at the end)
    #: (ts, interval in seconds) each time the interval in force changed.
    intervals: list[tuple[float, float]] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        return (self.checkpoint_s + self.lost_s + self.restart_s) / self.elapsed_s


#: Receives each telemetry event and returns the commands the core issued for it.
Core = Callable[[Envelope], list[Command]]


class _Sim(RunLevel):
    def __init__(self, run: LongRun, interval_s: float) -> None:
        super().__init__(
            run.run_id, run.world_size, run.ranks_per_node, run.nodes_per_rack, interval_s, run.start_ts
        )
        self.run = run
        self.rng = random.Random(run.seed)
        self.step = -1  # last completed step of the job
        self.ckpt_step = -1  # newest validated checkpoint
        self.ckpt_done_ts = run.start_ts
        self.high_water = -1
        self.truth = Truth(intervals=self.intervals, quarantined=self.quarantined)

    def next_failure(self, after: float) -> float:
        return after + self.rng.expovariate(1.0 / self.run.failure_mtbf_s)


def simulate(run: LongRun, core: Core, interval_s: float = 1800.0) -> Truth:
    """Drive `core` with the run's events for `run.days`; return what really happened."""
    sim = _Sim(run, interval_s)
    truth = sim.truth
    for event in _events(sim):
        sim.apply(core(event), event.ts)
    truth.elapsed_s = run.end_ts - run.start_ts
    truth.steps = sim.high_water + 1
    return truth


def _events(sim: _Sim) -> Iterator[Envelope]:
    """The run's events in time order; reads sim.interval_s, which `apply` may change."""
    run, truth = sim.run, sim.truth
    t = run.start_ts
    failure = sim.next_failure(t)
    launch_ts, first_step_ts = t, t + run.step_s
    while True:
        # ---- launch an attempt (a failure before it launches strikes right after).
        yield sim.run_started(launch_ts, sim.ckpt_step)
        failure = max(failure, launch_ts)
        restarting = sim.attempt > 0  # the first launch is not a restart
        sim.step = sim.ckpt_step  # an attempt starts from its checkpoint (a failed launch too)
        if failure < first_step_ts and failure < run.end_ts:  # the launch itself failed
            truth.restart_s += (failure - launch_ts) if restarting else 0.0
            t = failure
            yield _crash(sim, t)
        elif first_step_ts >= run.end_ts:
            truth.restart_s += (run.end_ts - launch_ts) if restarting else 0.0
            return
        else:
            truth.restart_s += (first_step_ts - launch_ts) if restarting else 0.0
            t = first_step_ts - run.step_s
            sim.ckpt_done_ts = t
            since_ckpt = 0.0
            # ---- train until the next failure or the end of the run.
            while True:
                checkpointing = since_ckpt >= sim.interval_s
                done = t + (run.checkpoint_s if checkpointing else run.step_s)
                if failure < done and failure < run.end_ts:
                    # The step in progress and everything since the last checkpoint is re-done
                    # (a checkpoint cut short counts as checkpoint time: it was spent writing).
                    if checkpointing:
                        truth.checkpoint_s += failure - t
                        truth.lost_s += t - sim.ckpt_done_ts
                    else:
                        truth.lost_s += failure - sim.ckpt_done_ts
                    t = failure
                    break
                if done >= run.end_ts:  # the run ends here; nothing is re-done
                    if checkpointing:
                        truth.checkpoint_s += run.end_ts - t
                    return
                t = done
                if checkpointing:
                    truth.checkpoint_s += run.checkpoint_s
                    truth.checkpoints += 1
                    sim.ckpt_step, sim.ckpt_done_ts, since_ckpt = sim.step, t, 0.0
                    yield from _checkpoint(sim, t)
                    continue
                sim.step += 1
                sim.high_water = max(sim.high_water, sim.step)
                since_ckpt += run.step_s
                yield StepTiming(
                    **sim.envelope(0, sim.step, t), compute_s=0.7 * run.step_s, total_s=run.step_s
                )
            yield _crash(sim, t)
        # ---- restart: R seconds from detection to the next attempt's first step.
        sim.attempt += 1
        sim.relaunch_nodes()
        launch_ts = t + run.reschedule_fraction * run.restart_s
        first_step_ts = t + run.restart_s
        truth.restart_s += launch_ts - t
        failure = sim.next_failure(t)
        if launch_ts >= run.end_ts:
            truth.restart_s -= launch_ts - run.end_ts
            return


def _crash(sim: _Sim, ts: float) -> RankExit:
    sim.truth.failures += 1
    rank = sim.rng.randrange(sim.run.world_size)
    return RankExit(**sim.envelope(rank, max(sim.step, sim.ckpt_step), ts), exit_code=1, signal=None)


def _checkpoint(sim: _Sim, ts: float) -> Iterator[Envelope]:
    yield from sim.checkpoint(sim.step, ts, sim.run.checkpoint_s)
