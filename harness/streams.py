"""Builds realistic telemetry streams for core tests: a synchronous job whose ranks
step together with lognormal jitter, heartbeat in between, and checkpoint
periodically; faults are declared (crash, hang) rather than hand-set numbers."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from trainguard.schemas import (
    CheckpointValidated,
    CheckpointWritten,
    Envelope,
    GpuHealth,
    Heartbeat,
    RankExit,
    RunStarted,
    StepTiming,
)


@dataclass
class Job:
    run_id: str = "run-test"
    world_size: int = 16
    ranks_per_node: int = 4
    step_s: float = 1.0
    heartbeat_s: float = 0.5
    checkpoint_every: int = 10
    #: Seconds a checkpoint blocks training (the seed's C); 0: no CheckpointWritten events.
    checkpoint_blocking_s: float = 0.0
    seed: int = 1
    #: Per-node clock offset (seconds): emitter clocks disagree in real clusters.
    skew: dict[str, float] = field(default_factory=dict)
    attempt: int = 0
    t: float = 1_800_000_000.0
    step: int = -1
    events: list[Envelope] = field(default_factory=list)
    #: Nodes a launcher swapped for spares (quarantine): node -> its replacement.
    replaced: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._ids = itertools.count()

    def node(self, rank: int) -> str:
        node = f"node-{rank // self.ranks_per_node:03d}"
        return self.replaced.get(node, node)

    def replace(self, node: str) -> str:
        """The launcher swaps `node` for a spare from the next attempt on (a quarantine)."""
        spare = f"spare-{len(self.replaced):03d}"
        self.replaced[node] = spare
        return spare

    def _env(self, rank: int, **extra: object) -> dict[str, object]:
        node = self.node(rank) if rank >= 0 else ""
        return dict(
            event_id=f"{self.run_id}-{next(self._ids)}",
            run_id=self.run_id,
            attempt=self.attempt,
            rank=rank,
            node=node,
            step=self.step,
            ts=self.t + self.skew.get(node, 0.0),
            **extra,
        )

    def start(self, resumed_from_step: int = -1) -> Job:
        nodes = sorted({self.node(r) for r in range(self.world_size)})
        self.step = resumed_from_step
        self.events.append(
            RunStarted(
                **self._env(-1),
                world_size=self.world_size,
                ranks_per_node=self.ranks_per_node,
                nodes=nodes,
                resumed_from_step=resumed_from_step,
            )
        )
        return self

    def heartbeats(self, ranks: list[int] | None = None, phases: dict[int, str] | None = None) -> None:
        """One heartbeat per rank; `phases`: rank -> the training phase it reports (none: '')."""
        for r in ranks if ranks is not None else range(self.world_size):
            self.events.append(Heartbeat(**self._env(r), phase=(phases or {}).get(r, "")))

    def steps(self, n: int, exclude: set[int] | None = None) -> Job:
        """n synchronous steps: everyone finishes when the slowest does."""
        for _ in range(n):
            self.t += self.step_s * self._rng.lognormvariate(0, 0.05)
            self.step += 1
            for r in range(self.world_size):
                if exclude and r in exclude:
                    continue
                compute = 0.7 * self.step_s * self._rng.lognormvariate(0, 0.03)
                self.events.append(StepTiming(**self._env(r), compute_s=compute, total_s=self.step_s))
            if self.checkpoint_every and self.step % self.checkpoint_every == 0 and self.step > 0:
                if self.checkpoint_blocking_s > 0:
                    self.checkpoint_written(self.checkpoint_blocking_s * self._rng.lognormvariate(0, 0.1))
                self.validated(self.step)
        return self

    def validated(self, step: int) -> Job:
        """Checkpoint `step` reported validated now (with the steps: at once; called alone,
        late, as a validation that finishes after later steps, or after a crash)."""
        self.events.append(
            CheckpointValidated(
                **self._env(-1),
                checkpoint_step=step,
                uri=f"mem://{self.run_id}/{step}",
                last_verified_step=step,
            )
        )
        return self

    def checkpoint_written(self, blocking_s: float, rank: int = 0) -> Job:
        """Rank `rank` reports the checkpoint of the current step durable; training was
        blocked for `blocking_s` (it shows in the clock)."""
        self.t += blocking_s
        self.events.append(
            CheckpointWritten(
                **self._env(rank),
                checkpoint_step=self.step,
                uri=f"mem://{self.run_id}/{self.step}",
                shards=self.world_size,
                digest=f"sha256:{self.step:064x}",
                bytes=self.world_size << 30,
                blocking_s=blocking_s,
                write_s=4 * blocking_s,
            )
        )
        return self

    def stall(
        self, seconds: float, alive: list[int] | None = None, stuck: dict[int, str] | None = None
    ) -> Job:
        """No step completes for `seconds`; live ranks keep heartbeating (stuck in a collective).
        With `stuck` (rank -> phase), heartbeats report phases: those ranks stuck in theirs,
        every other rank waiting in the all-reduce."""
        end = self.t + seconds
        phases = None
        if stuck is not None:
            phases = {r: stuck.get(r, "allreduce") for r in range(self.world_size)}
        while self.t < end:
            self.t += self.heartbeat_s
            self.heartbeats(alive, phases)
        return self

    def health(self, rank: int, **fields: object) -> Job:
        """Rank `rank` reports its GPU's health now (present, with `fields`)."""
        self.events.append(GpuHealth(**self._env(rank), present=True, **fields))
        return self

    def exit(self, rank: int, stamped_at: float | None = None, **fields: object) -> Job:
        """Rank `rank` ends; `stamped_at`: when it did, for a report delivered only now."""
        env = self._env(rank, **fields)
        if stamped_at is not None:
            env["ts"] = stamped_at + self.skew.get(self.node(rank), 0.0)
        self.events.append(RankExit(**env))
        return self

    def abort_all(
        self,
        culprit: int | None = None,
        culprit_stack: str = "compute:matmul",
        ranks: list[int] | None = None,
    ) -> Job:
        """What ranks do on an Abort(stack_dump): dump, report, exit (`ranks`: those that
        still can; every rank by default)."""
        self.t += 0.2
        for r in range(self.world_size) if ranks is None else ranks:
            sig = culprit_stack if r == culprit else "collective:allreduce"
            self.exit(r, signal=15, requested=True, stack_signature=sig, stack_dump_ref=f"dump/{r}")
        return self

    def restart(self, resumed_from_step: int, delay_s: float = 30.0) -> Job:
        self.t += delay_s
        self.attempt += 1
        return self.start(resumed_from_step)
