"""A fleet run's plan and ground truth (issue 46): every failure drawn before the run (when
it strikes, where, of which kind, foretold or not, and from when), every false precursor
episode, and what became of them once the core's decisions were applied.

The plan is drawn from the scenario's seed alone, apart from the health noise and from
anything the core decides, so that the same seed gives the same failures whatever the
policy: a run with prediction on and one with it off meet the same failures, except
those a drain took away.

A failure belongs to a slot of the job (the node in ``nodes[slot]``) and a GPU of it. A
foretold failure is bound to the node in its slot when its precursor begins: if that
node leaves the job before the failure strikes (drained, or quarantined for something
else), the failure never strikes. A failure with no precursor is bound when it strikes,
to whatever node is in the slot then: nothing foretold it, so no drain can take it away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .fleet_scenario import Fleet
from .precursors import Episode
from .runlevel import DAY_S

FailureOutcome = Literal["pending", "struck", "drained", "removed"]


@dataclass
class FailureTruth:
    """One planned failure and what became of it."""

    id: int
    ts: float  # when it strikes (would strike)
    slot: int
    gpu: int
    kind: str  # crash | hang | wrong_gpu
    precursor: str | None = None  # the precursor's kind; None: no precursor
    precursor_ts: float | None = None  # when the precursor began
    node: str | None = None  # the node it belongs to, once bound
    outcome: FailureOutcome = "pending"
    struck_ts: float | None = None  # when it struck (a failure while the job was down: at the launch)
    detected_ts: float | None = None
    drained_ts: float | None = None  # drained: when the core decided the drain (DrainNode.issued_ts)

    @property
    def lead_s(self) -> float:
        """The precursor's lead: its onset to the failure (0: no precursor)."""
        return self.ts - self.precursor_ts if self.precursor_ts is not None else 0.0

    @property
    def gained_s(self) -> float | None:
        """Drained: the drain's decision to when the failure would have struck."""
        return self.ts - self.drained_ts if self.drained_ts is not None else None


@dataclass
class DrainTruth:
    """One DrainNode the run executed, and whether its node would have failed."""

    node: str
    decided_ts: float  # DrainNode.issued_ts
    boundary_ts: float | None = None  # the checkpoint boundary it stopped at; None: the job was down
    failure: int | None = None  # the node's failure: the one the drain took away, or (late) met first
    failure_ts: float | None = None
    late: bool = False  # the node failed after the decision, before its boundary: right, too late
    false_episode: bool = False  # the node showed a false precursor when it was drained

    def would_fail_within(self, horizon_s: float) -> bool:
        return self.failure_ts is not None and self.failure_ts - self.decided_ts <= horizon_s


@dataclass
class FleetTruth:
    """What the run spent its time on (seconds), the plan's fate, and the drains."""

    start_ts: float = 0.0
    elapsed_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0  # work re-done: since the last good checkpoint at each failure
    restart_s: float = 0.0  # unplanned: detection to the next attempt's first step
    stall_s: float = 0.0  # a hang's stall until detected (the job is alive and makes no progress)
    drain_s: float = 0.0  # planned: a drain's checkpoint end to the next first step
    checkpoints: int = 0
    steps: int = 0  # useful steps (the high-water step at the end)
    health_reports: int = 0
    failures: list[FailureTruth] = field(default_factory=list)
    false_episodes: list[Episode] = field(default_factory=list)
    drains: list[DrainTruth] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)

    @property
    def productive_s(self) -> float:
        return self.elapsed_s - self.checkpoint_s - self.lost_s - self.restart_s - self.stall_s - self.drain_s

    @property
    def goodput(self) -> float:
        return self.productive_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def in_run(self, failure: FailureTruth) -> bool:
        """The failure strikes (would strike) before the run ends."""
        return failure.ts < self.start_ts + self.elapsed_s

    @property
    def struck(self) -> list[FailureTruth]:
        return [f for f in self.failures if f.outcome == "struck"]


def draw_plan(
    fleet: Fleet, start_ts: float, margin_s: float
) -> tuple[list[FailureTruth], list[Episode], list[Episode]]:
    """Failures over [start, end + margin) (the margin judges the last drains), their
    precursor episodes, and the false episodes over the run, from the scenario's seed alone."""
    rng = np.random.default_rng([fleet.seed, 46])
    end = start_ts + fleet.days * DAY_S + margin_s
    nodes, rpn = fleet.nodes, fleet.ranks_per_node
    gpus_last = fleet.world_size - (nodes - 1) * rpn  # the last node may be partial
    failures: list[FailureTruth] = []
    episodes: list[Episode] = []
    per_s = fleet.failures_per_day / DAY_S
    kinds: list[str] = list(fleet.failures.kinds)
    weights = np.array(list(fleet.failures.kinds.values()), dtype=float)
    weights = weights / weights.sum() if weights.sum() > 0 else weights
    p = fleet.precursors
    t = start_ts
    while per_s > 0:
        t += float(rng.exponential(1.0 / per_s))
        if t >= end:
            break
        slot = int(rng.integers(nodes))
        gpu = int(rng.integers(gpus_last if slot == nodes - 1 else rpn))
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        failure = FailureTruth(len(failures), t, slot, gpu, kind)
        if rng.random() < p.share:
            lead = p.draw_lead(rng)
            failure.precursor, failure.precursor_ts = p.draw_kind(rng), t - lead
            episodes.append(_episode(failure.precursor, slot, gpu, t - lead, t, p.draw_intensity(rng), rng))
            episodes[-1].failure = failure.id
        failures.append(failure)
    false: list[Episode] = []
    run_end = start_ts + fleet.days * DAY_S
    for _ in range(int(rng.poisson(p.false_per_node_day * fleet.node_days))):
        begin = start_ts + float(rng.random()) * (run_end - start_ts)
        duration = p.false_duration_median_s * math.exp(p.false_duration_sigma * float(rng.standard_normal()))
        slot = int(rng.integers(nodes))
        gpu = int(rng.integers(gpus_last if slot == nodes - 1 else rpn))
        false_kind, intensity = p.draw_kind(rng), p.draw_intensity(rng)
        episode = _episode(false_kind, slot, gpu, begin, begin + duration, intensity, rng)
        episode.fades = bool(rng.random() < p.fade_share)
        false.append(episode)
    return failures, episodes, sorted(false, key=lambda e: e.start_ts)


def _episode(
    kind: str, slot: int, gpu: int, start: float, end: float, intensity: float, rng: np.random.Generator
) -> Episode:
    # a remap fails in 60% of remap episodes, late in them
    fails_at = float(rng.uniform(0.5, 0.95)) if rng.random() < 0.6 else 2.0
    return Episode(kind, slot, gpu, start, end, intensity, remap_fails_at=fails_at)
