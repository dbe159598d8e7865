"""Streams for the group slowdown tests: a synchronous job's per-step pre-collective compute
times for every rank at once (numpy: 16,384 ranks x hundreds of steps in a second), with the
noise of the scenario library (lognormal jitter, persistent per-GPU speed, a Pareto tail, GC
pauses) and declared faults (a slow rack, a slow node, a slow placement group), never
hand-set per-step numbers.

`GroupHarness` feeds each step to the group detector the way the engine does once the
straggler detector has evaluated the step: `on_local_step` per shard, a shard's
GroupComputeTimes to shard 0's `on_summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainguard.processors.core.detectors.diagnosis_state import DiagnosisPolicy
from trainguard.processors.core.detectors.group_slowdown import on_local_step, on_run_started, on_summary
from trainguard.processors.core.detectors.group_state import GroupSlowdownPolicy, GroupState
from trainguard.processors.core.state import RunState
from trainguard.schemas import Derived, GroupComputeTimes, RunStarted, StepTiming


@dataclass(frozen=True)
class SlowGroup:
    """Ranks of `rack` (or `node`, or the nodes of placement group `group`) compute `factor`
    times slower from `from_step`."""

    factor: float
    rack: int | None = None
    node: int | None = None
    nodes: tuple[int, ...] = ()
    from_step: int = 0


@dataclass
class RackJob:
    world_size: int = 2048
    ranks_per_node: int = 8
    nodes_per_rack: int = 16
    compute_s: float = 1.4
    jitter: float = 0.03
    rank_spread: float = 0.01
    tail_prob: float = 6e-5
    tail_alpha: float = 1.5
    tail_min: float = 0.1
    tail_max: float = 1.0
    gc_pause_prob: float = 0.2
    gc_pause_s: tuple[float, float] = (0.05, 0.3)
    slow: list[SlowGroup] = field(default_factory=list)
    placement_groups: dict[str, list[int]] = field(default_factory=dict)  # name -> node indices
    seed: int = 14

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.speed = self.rng.lognormal(0.0, self.rank_spread, self.world_size) if self.rank_spread else 1.0
        self.step = -1

    @property
    def n_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def node_name(self, i: int) -> str:
        return f"node-{i:04d}"

    def run_started(self, run_id: str = "run-groups") -> RunStarted:
        nodes = [self.node_name(i) for i in range(self.n_nodes)]
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
            racks={n: f"rack-{i // self.nodes_per_rack:02d}" for i, n in enumerate(nodes)},
            placement_groups={
                name: [self.node_name(i) for i in idx] for name, idx in self.placement_groups.items()
            },
        )

    def next_step(self) -> np.ndarray:
        """Every rank's compute_s of the next step."""
        self.step += 1
        n, rng = self.world_size, self.rng
        x = self.compute_s * self.speed * rng.lognormal(0.0, self.jitter, n)
        if self.tail_prob:
            hit = np.flatnonzero(rng.random(n) < self.tail_prob)
            tail = np.minimum(self.tail_max, self.tail_min * (1 + rng.pareto(self.tail_alpha, hit.size)))
            x[hit] *= 1 + tail
        if self.gc_pause_prob and rng.random() < self.gc_pause_prob:
            x[rng.integers(n)] += rng.uniform(*self.gc_pause_s)
        rpn, npr = self.ranks_per_node, self.nodes_per_rack
        for fault in self.slow:
            if self.step < fault.from_step:
                continue
            if fault.rack is not None:
                x[fault.rack * npr * rpn : (fault.rack + 1) * npr * rpn] *= fault.factor
            if fault.node is not None:
                x[fault.node * rpn : (fault.node + 1) * rpn] *= fault.factor
            for node in fault.nodes:
                x[node * rpn : (node + 1) * rpn] *= fault.factor
        return x


def _trigger(run_id: str, shard: int, step: int) -> StepTiming:
    return StepTiming(
        event_id=f"{run_id}-{shard}-{step}",
        run_id=run_id,
        attempt=0,
        rank=0,
        node="node-0000",
        step=step,
        ts=1000.0 + 2.0 * step,
        compute_s=1.0,
        total_s=2.0,
    )


@dataclass
class GroupHarness:
    """The group detector as the engine drives it, unsharded or cut into shards of
    `shard_ranks` (shard 0 coordinates; the others' summaries are forwarded to it)."""

    job: RackJob
    policy: GroupSlowdownPolicy = field(default_factory=GroupSlowdownPolicy)
    diagnosis_policy: DiagnosisPolicy = field(default_factory=DiagnosisPolicy)
    shard_ranks: int = 0
    runs: list[RunState] = field(default_factory=list)
    forwarded: int = 0

    def __post_init__(self) -> None:
        world = self.job.world_size
        shards = 1 if not self.shard_ranks else -(-world // self.shard_ranks)
        started = self.job.run_started()
        for k in range(shards):
            run = RunState(started.run_id, world_size=world, shard=k, shard_ranks=self.shard_ranks)
            on_run_started(run.groups, run, started, self.policy)
            self.runs.append(run)

    @property
    def state(self) -> GroupState:
        return self.runs[0].groups

    def steps(self, n: int) -> list[Derived]:
        outputs: list[Derived] = []
        for _ in range(n):
            values = self.job.next_step()
            for run in self.runs:
                trigger = _trigger(run.run_id, run.shard, self.job.step)
                for made in on_local_step(
                    run.groups, run, self.job.step, values, trigger, self.policy, self.diagnosis_policy
                ):
                    if isinstance(made, GroupComputeTimes):
                        self.forwarded += 1
                        coordinator = self.runs[0]
                        outputs += on_summary(
                            coordinator.groups, coordinator, made, self.policy, self.diagnosis_policy
                        )
                    else:
                        outputs.append(made)
        return outputs
