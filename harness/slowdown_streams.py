"""Streams for the windowed slowdown tests (issue 47): a synchronous job's per-step
pre-collective compute times for every rank at once (numpy: 16,384 ranks x hundreds of
steps in about a second), with the issue's noise (lognormal jitter 0.03-0.05, a 0.4 s GC
pause on ~0.3% of each rank's steps, about one heavy-tail event per step, optionally
persistent per-GPU speed differences) and declared faults (a slow rank, node or rack),
never hand-set per-step numbers.

`WindowHarness` drives the windowed detector the way the engine does once the straggler
detector has evaluated a step (`slowdown.on_step`), unsharded or cut into shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainguard.processors.core.decisions.eviction_state import EvictionPolicy
from trainguard.processors.core.detectors.group_slowdown import on_run_started
from trainguard.processors.core.detectors.group_state import GroupSlowdownPolicy
from trainguard.processors.core.detectors.slowdown import on_step
from trainguard.processors.core.detectors.slowdown_state import SlowdownPolicy
from trainguard.processors.core.state import RunState
from trainguard.schemas import Derived, RunStarted, StepTiming, StragglerFlagged


@dataclass(frozen=True)
class SlowUnit:
    """Ranks of `rank` (or `node`, or `rack`) compute `factor` times slower for steps
    [from_step, to_step)."""

    factor: float
    rank: int | None = None
    node: int | None = None
    rack: int | None = None
    from_step: int = 0
    to_step: int | None = None


@dataclass
class NoisyJob:
    world_size: int = 1024
    ranks_per_node: int = 8
    nodes_per_rack: int = 4
    compute_s: float = 1.05  # 1.5 s steps, 70% compute
    jitter: float = 0.04
    #: Persistent per-GPU speed (lognormal sigma): the silicon lottery; 0: none.
    rank_spread: float = 0.0
    gc_pause_p: float = 0.003  # per rank and step
    gc_pause_s: float = 0.4
    tail_per_step: float = 1.0  # heavy-tail events per step over the whole job
    tail_alpha: float = 1.5
    tail_min: float = 0.1
    tail_max: float = 1.0
    slow: list[SlowUnit] = field(default_factory=list)
    seed: int = 47

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        n = self.world_size
        self.speed = self.rng.lognormal(0.0, self.rank_spread, n) if self.rank_spread else np.ones(n)
        self.step = -1

    def node_name(self, i: int) -> str:
        return f"node-{i:04d}"

    def run_started(self, run_id: str = "run-slow") -> RunStarted:
        nodes = [self.node_name(i) for i in range(-(-self.world_size // self.ranks_per_node))]
        return RunStarted(
            event_id=f"{run_id}-start",
            run_id=run_id,
            attempt=0,
            rank=-1,
            node="",
            step=-1,
            ts=1000.0,
            world_size=self.world_size,
            ranks_per_node=self.ranks_per_node,
            nodes=nodes,
            racks={n: f"rack-{i // self.nodes_per_rack:03d}" for i, n in enumerate(nodes)},
        )

    def next_step(self) -> np.ndarray:
        """Every rank's compute_s of the next step."""
        self.step += 1
        n, rng = self.world_size, self.rng
        x = self.compute_s * self.speed * rng.lognormal(0.0, self.jitter, n)
        tails = rng.poisson(self.tail_per_step)
        if tails:
            hit = rng.integers(n, size=tails)
            x[hit] *= 1 + np.minimum(self.tail_max, self.tail_min * (1 + rng.pareto(self.tail_alpha, tails)))
        x[rng.random(n) < self.gc_pause_p] += self.gc_pause_s
        rpn, npr = self.ranks_per_node, self.nodes_per_rack
        for fault in self.slow:
            if self.step < fault.from_step or (fault.to_step is not None and self.step >= fault.to_step):
                continue
            if fault.rank is not None:
                x[fault.rank] *= fault.factor
            if fault.node is not None:
                x[fault.node * rpn : (fault.node + 1) * rpn] *= fault.factor
            if fault.rack is not None:
                x[fault.rack * npr * rpn : (fault.rack + 1) * npr * rpn] *= fault.factor
        return x


def trigger(run_id: str, step: int) -> StepTiming:
    return StepTiming(
        event_id=f"{run_id}-{step}",
        run_id=run_id,
        attempt=0,
        rank=0,
        node="node-0000",
        step=step,
        ts=1000.0 + 1.5 * step,
        compute_s=1.0,
        total_s=1.5,
    )


@dataclass
class WindowHarness:
    """The windowed detector as the engine drives it, on every shard of the run."""

    job: NoisyJob
    policy: SlowdownPolicy = field(default_factory=SlowdownPolicy)
    eviction: EvictionPolicy = field(default_factory=EvictionPolicy)
    shard_ranks: int = 0
    runs: list[RunState] = field(default_factory=list)
    #: (step, flag) of every flag, in order.
    flags: list[tuple[int, StragglerFlagged]] = field(default_factory=list)

    def __post_init__(self) -> None:
        world = self.job.world_size
        shards = 1 if not self.shard_ranks else -(-world // self.shard_ranks)
        started = self.job.run_started()
        for k in range(shards):
            run = RunState(started.run_id, world_size=world, shard=k, shard_ranks=self.shard_ranks)
            run.ranks_per_node = started.ranks_per_node
            run.nodes = tuple(started.nodes)
            run.racks = dict(started.racks)
            on_run_started(run.groups, run, started, GroupSlowdownPolicy())
            self.runs.append(run)

    def steps(self, n: int) -> list[Derived]:
        outputs: list[Derived] = []
        for _ in range(n):
            values = self.job.next_step()
            event = trigger(self.runs[0].run_id, self.job.step)
            for run in self.runs:
                owned = run.owned()
                assert owned is not None
                reported = len(owned)
                found = on_step(
                    run.slowdown, run, self.job.step, values, reported, event, self.policy, self.eviction
                )
                outputs += found
                self.flags += [(self.job.step, f) for f in found if isinstance(f, StragglerFlagged)]
        return outputs
