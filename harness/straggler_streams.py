"""Streams for the straggler and diagnosis tests: a synchronous job whose ranks compute
with lognormal (optionally heavy-tailed) jitter, wait in the collective for the slowest,
and report GPU health; faults are declared (a slow rank from a step, a hot node, a hot
rack, a narrow NVLink, a busy NIC), never hand-set per-step numbers.

`Harness` folds events through the two detectors the way the engine is meant to:
StepTiming -> observe_step, each StragglerFlagged -> diagnosed, GpuHealth -> observe_health.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from trainguard.processors.core.detectors.diagnosis import diagnosed, observe_health
from trainguard.processors.core.detectors.diagnosis_state import DiagnosisPolicy, HealthState
from trainguard.processors.core.detectors.straggler import observe_step
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy, StragglerState
from trainguard.processors.core.state import RunState
from trainguard.schemas import Derived, Envelope, GpuHealth, RunStarted, StepTiming, StragglerFlagged

from .streams import Job

NVLINK_WIDTH = 18


@dataclass(frozen=True)
class Slow:
    """Rank `rank` computes `factor` times slower for steps [from_step, to_step)."""

    rank: int
    factor: float
    from_step: int = 0
    to_step: int | None = None

    def at(self, step: int) -> float:
        active = self.from_step <= step and (self.to_step is None or step < self.to_step)
        return self.factor if active else 1.0


HealthKind = Literal["thermal", "power_cap", "hot_rack", "link", "nic", "absent"]


@dataclass(frozen=True)
class HealthFault:
    """What NVML shows on the target (one rank's GPU, a node's GPUs, or a rack's)."""

    kind: HealthKind
    rank: int | None = None
    node: str | None = None
    rack: str | None = None


@dataclass
class SyncJob(Job):
    """A synchronous data-parallel job: compute (pre-collective) with jitter, then an
    all-reduce that everyone leaves when the slowest arrives, then the optimizer."""

    world_size: int = 64
    ranks_per_node: int = 8
    nodes_per_rack: int = 4
    step_s: float = 2.0
    compute_fraction: float = 0.7
    jitter: float = 0.03
    slow: list[Slow] = field(default_factory=list)
    #: Every rank's compute multiplied (a bigger batch, a slower kernel): nobody straggles.
    uniform: float = 1.0
    #: Student-t (3 dof) jitter instead of lognormal: heavy tails.
    heavy_tail: bool = False
    #: Probability per rank-step of a garbage-collection pause of `gc_factor` x compute.
    gc_pause_p: float = 0.0
    gc_factor: float = 3.0
    #: Extra seconds a rank spends AFTER the collective (optimizer, logging): total_s only.
    post_collective_s: dict[int, float] = field(default_factory=dict)

    def rack(self, node: str) -> str:
        return f"rack-{int(node.split('-')[1]) // self.nodes_per_rack}"

    def nodes(self) -> list[str]:
        return sorted({self.node(r) for r in range(self.world_size)})

    def start(self, resumed_from_step: int = -1) -> SyncJob:
        self.step = resumed_from_step
        nodes = self.nodes()
        self.events.append(
            RunStarted(
                **self._env(-1),
                world_size=self.world_size,
                ranks_per_node=self.ranks_per_node,
                nodes=nodes,
                racks={n: self.rack(n) for n in nodes},
                resumed_from_step=resumed_from_step,
            )
        )
        return self

    def _noise(self) -> float:
        rng = self._rng
        if not self.heavy_tail:
            return rng.lognormvariate(0.0, self.jitter)
        chi2 = sum(rng.gauss(0, 1) ** 2 for _ in range(3))
        t3 = rng.gauss(0, 1) / math.sqrt(chi2 / 3)
        return math.exp(self.jitter * max(-10.0, min(10.0, t3)))

    def steps(self, n: int, exclude: set[int] | None = None) -> SyncJob:
        base = self.compute_fraction * self.step_s
        for _ in range(n):
            self.step += 1
            ranks = [r for r in range(self.world_size) if not exclude or r not in exclude]
            compute = {}
            for r in ranks:
                c = base * self.uniform * self._noise()
                for fault in self.slow:
                    if fault.rank == r:
                        c *= fault.at(self.step)
                if self.gc_pause_p and self._rng.random() < self.gc_pause_p:
                    c *= self.gc_factor
                compute[r] = c
            collective = (1 - self.compute_fraction) * self.step_s * self._rng.lognormvariate(0, 0.02)
            release = max(compute.values()) + collective  # everyone waits for the slowest
            self.t += release
            for r in ranks:
                total = release + self.post_collective_s.get(r, 0.0)
                self.events.append(StepTiming(**self._env(r), compute_s=compute[r], total_s=total))
        return self

    # Every rank's report at once (Job.health: one rank's); a SyncJob is never used as a Job.
    def health(self, faults: Iterable[HealthFault] = ()) -> SyncJob:  # type: ignore[override]
        """One GpuHealth report per rank, the faults' fingerprints applied (seed R2)."""
        faults = list(faults)
        for r in range(self.world_size):
            node = self.node(r)
            hit = {f.kind for f in faults if f.rank == r or f.node == node or f.rack == self.rack(node)}
            if "absent" in hit:
                self.events.append(GpuHealth(**self._env(r), present=False))
                continue
            temp = 52.0 + 6.0 * ((r * 7919) % 11) / 10 + self._rng.gauss(0, 0.8)  # per-GPU airflow
            clock, capped, throttled = 1980.0, False, False
            width, retries, nic = NVLINK_WIDTH, int(self._rng.random() * 3), 0.35 + self._rng.gauss(0, 0.03)
            if "hot_rack" in hit:
                temp += 34.0  # the aisle's inlet air is hot: every GPU in the rack runs near the limit
                throttled = temp > 87.0
            if "thermal" in hit:
                temp, clock, throttled = 91.0 + self._rng.gauss(0, 0.8), 1650.0, True
            if "power_cap" in hit:
                capped, clock = True, 1700.0
            if "link" in hit:
                width, retries = NVLINK_WIDTH // 2, 250 + int(self._rng.random() * 50)
            if "nic" in hit:
                nic = 0.97
            self.events.append(
                GpuHealth(
                    **self._env(r),
                    present=True,
                    temperature_c=round(temp, 1),
                    sm_clock_mhz=clock,
                    power_capped=capped,
                    thermal_throttle=throttled,
                    nvlink_width=width,
                    nvlink_expected_width=NVLINK_WIDTH,
                    nvlink_retries=retries,
                    ecc_corrected=0,
                    ecc_uncorrected=0,
                    nic_utilization=round(min(1.0, max(0.0, nic)), 3),
                )
            )
        return self


@dataclass
class Harness:
    """The reference wiring of the two detectors (what engine.step is meant to do)."""

    straggler_policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    diagnosis_policy: DiagnosisPolicy = field(default_factory=DiagnosisPolicy)
    run: RunState = field(default_factory=lambda: RunState("run-test"))
    straggler: StragglerState = field(default_factory=StragglerState)
    health: HealthState = field(default_factory=HealthState)

    def feed(self, events: Iterable[Envelope]) -> list[Derived]:
        outputs: list[Derived] = []
        for event in events:
            if isinstance(event, RunStarted):
                self.run.world_size = event.world_size
                self.run.ranks_per_node = event.ranks_per_node
                self.run.racks = dict(event.racks)
                self.run.attempt = max(self.run.attempt, event.attempt)
            elif isinstance(event, StepTiming):
                for out in observe_step(self.straggler, self.run, event, self.straggler_policy):
                    outputs.append(out)
                    if isinstance(out, StragglerFlagged):
                        outputs.append(diagnosed(self.health, self.run, out, self.diagnosis_policy))
            elif isinstance(event, GpuHealth):
                observe_health(self.health, self.run, event, self.diagnosis_policy)
        return outputs


D = TypeVar("D", bound=Derived)


def of_kind(outputs: list[Derived], kind: type[D]) -> list[D]:
    return [o for o in outputs if isinstance(o, kind)]
