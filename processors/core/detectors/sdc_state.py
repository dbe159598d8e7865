"""Settings and state of the SDC detector (seed §7 failure 3, R3, R6).

Kept apart from the handlers in :mod:`.sdc` and free of imports from the rest of the
core, so that ``RunState`` can embed an :class:`SdcState` and ``CorePolicy`` an
:class:`SdcPolicy` without an import cycle.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ....common.quantiles import RunningQuantile

#: For a zero-centred normal, sigma = median(|x|) / Phi^-1(0.75).
MEDIAN_ABS_TO_SIGMA = 1.4826
#: Judged steps, handled checks and passing-check steps remembered.
REMEMBERED = 4096

_K = TypeVar("_K", bound=Hashable)


def remember(seen: OrderedDict[_K, None], key: _K, limit: int = REMEMBERED) -> bool:
    """Record `key` in an insertion-ordered set of at most `limit` keys (the oldest
    forgotten first); False if it was already there."""
    if key in seen:
        return False
    seen[key] = None
    if len(seen) > limit:
        seen.popitem(last=False)
    return True


class SdcPolicy(BaseModel):
    """The SDC detector's settings; the defaults are the seed's numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    grad_spike_multiplier: float = Field(
        10.0, gt=1, description="A step's grad norm above multiplier x running p99 is a spike (§7a)."
    )
    grad_norm_window: int = Field(
        1000, ge=10, description="How many recent non-spike job steps the grad-norm p99 is taken over."
    )
    grad_norm_min_samples: int = Field(
        50, ge=1, description="Job steps with a measured grad norm needed before spikes are judged."
    )
    self_check_every: int = Field(
        100,
        ge=0,
        description="Steps between rotating self-checks (R6 change 3: 100, not 1,000); 0 disables.",
    )
    cross_check_every: int | None = Field(
        None,
        ge=0,
        description="Steps between ring cross-rank checks once calibrated (R3); 0 disables. "
        "None: from the cost budget, ceil(1 / (microbatches_per_step x cross_check_budget)) "
        "(see cross_check_interval).",
    )
    cross_check_budget: float = Field(
        1e-4,
        gt=0,
        le=1,
        description="Share of each rank's compute the cross-rank checks may cost (the seed's "
        "0.01%). A ring check costs each rank one extra microbatch of one step.",
    )
    microbatches_per_step: int = Field(
        1,
        ge=1,
        description="Microbatches each rank computes per step (gradient accumulation); a ring "
        "check's cost is 1 / this of a step. No record declares it yet: the policy does.",
    )
    ring_wait_steps: int = Field(
        3,
        ge=1,
        description="Job steps after a ring check's step before it is judged on the reports it "
        "has (a rank that died sends none; its edges are left out, nobody is blamed for them).",
    )
    ring_wait_s: float = Field(
        10.0,
        ge=0,
        description="And seconds (event time) after its first report: ranks ship telemetry in "
        "batches, so on fast steps (tens of ms) ring_wait_steps alone judges a ring before the "
        "other ranks' reports can arrive, and a wrong device's edges go unjudged.",
    )
    ring_false_edge_rate: float = Field(
        1e-3,
        gt=0,
        lt=1,
        description="Chance that any of a ring check's W comparisons fails on good hardware: the "
        "ring's tolerance is max(cross_check_sigma, the normal quantile for this rate over W "
        "edges) x the measured spread, so 16,384 edges do not raise 16,384 times the alarms of one.",
    )
    cross_check_calibration_every: int = Field(
        100,
        ge=1,
        description="Steps between cross-rank checks while fewer than cross_check_min_samples "
        "good-hardware samples exist, so that the tolerance is measured early in a run rather "
        "than after min_samples x cross_check_every steps.",
    )
    cross_check_min_samples: int = Field(
        20,
        ge=3,
        description="Passing cross-rank differences needed before the tolerance is trusted; "
        "before that a check's spread is recorded and nothing is judged.",
    )
    cross_check_sigma: float = Field(
        5.0, gt=0, description="Cross-rank tolerance = sigma x the rank-to-rank spread on good hardware."
    )
    cross_check_window: int = Field(
        1000, ge=10, description="How many recent passing cross-rank differences the spread is taken over."
    )
    unreproduced_margin: float = Field(
        2.0,
        ge=1,
        description="A cross-rank disagreement that a third rank's recomputation does not "
        "reproduce is evidence of a transient fault (roll back) only if its gap exceeded "
        "this many tolerances; within it, it is the noise tail of many comparisons (at 2, "
        "10 sigma for the pair check's 5), refuted by the bisection: no mismatch, no rollback.",
    )
    cross_check_min_tolerance: float = Field(
        0.0,
        ge=0,
        description="Floor on the cross-rank tolerance (absolute). 0 trusts the measured spread "
        "even when good hardware agrees bitwise.",
    )

    def cross_check_interval(self) -> int:
        """Steps between ring checks once calibrated: the explicit cross_check_every, else
        what the budget buys (ceil(cost / budget), the cost one microbatch of a step)."""
        if self.cross_check_every is not None:
            return self.cross_check_every
        return math.ceil(1.0 / (self.microbatches_per_step * self.cross_check_budget) - 1e-9)


class _NewFieldsDefault:
    """Unpickling a snapshot written before a field existed gives that field its default."""

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__dict__.update(saved)
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in self.__dict__:
                continue
            if f.default is not MISSING:
                setattr(self, f.name, f.default)
            elif f.default_factory is not MISSING:
                setattr(self, f.name, f.default_factory())


@dataclass
class RingReport:
    """One rank's RingCheck, as the judging needs it."""

    own: float
    peer_rank: int
    peer_value: float
    event_id: str
    ts: float


@dataclass
class PendingRing:
    """A ring check whose reports are arriving: judged once every rank reported, or
    ``ring_wait_steps`` job steps and ``ring_wait_s`` seconds after its first report on the
    reports it has."""

    step: int
    reports: dict[int, RingReport] = field(default_factory=dict)
    #: ts of its first report (-inf: a snapshot from before this field: steps alone decide).
    first_ts: float = -math.inf


@dataclass
class AttemptSdc(_NewFieldsDefault):
    """What the detector remembers about one attempt of a run; replaced when a new one starts."""

    attempt: int
    #: Steps whose grad norm was judged (one decision per job step, whatever the rank count).
    judged_steps: OrderedDict[int, None] = field(default_factory=OrderedDict)
    highest_judged_step: int = -1
    #: The attempt's non-finite interruption was declared (once per attempt).
    non_finite_declared: bool = False
    #: (kind, microbatch, ranks) of check results already handled.
    seen_checks: OrderedDict[tuple[str, str, tuple[int, ...]], None] = field(default_factory=OrderedDict)
    quarantined: set[str] = field(default_factory=set)
    #: Job step at which the latest self-check / cross-rank check was scheduled.
    last_self_check_step: int = 0
    last_cross_check_step: int = 0
    #: microbatch_id -> the disagreement being bisected with a third rank.
    bisecting: dict[str, PendingBisection] = field(default_factory=dict)
    #: check_id -> the ring check being collected (judged ones are in seen_checks).
    rings: dict[str, PendingRing] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingBisection:
    """A cross-rank disagreement (a pair check's, or a ring's lone failing edge) awaiting
    the third rank's recomputation."""

    #: The report that disagreed.
    event_id: str
    #: The step it was computed at: the watermark is held below it until the verdict.
    step: int
    #: Its gap over its tolerance (> 1): how far past the noise it was.
    excess: float
    #: A ring edge's relative tolerance (its microbatches differ in magnitude); None: the
    #: pair check's absolute spread.
    relative_tolerance: float | None = None

    def tolerance(self, state: SdcState, policy: SdcPolicy, values: list[float]) -> float | None:
        """The tolerance the three values are judged at."""
        if self.relative_tolerance is None:
            return state.tolerance(policy)
        scale = sorted(abs(v) for v in values if math.isfinite(v))
        return self.relative_tolerance * (scale[len(scale) // 2] if scale else 1.0)


@dataclass
class SdcState(_NewFieldsDefault):
    """Per-run SDC detector state. Lives with the run (``RunState``); the handlers in
    :mod:`.sdc` update it in place."""

    #: Grad norms of recent job steps, spikes excluded (they must not raise their own bar).
    grad_norms: RunningQuantile = field(default_factory=RunningQuantile)
    #: |a - b| of recent passing cross-rank checks (the good-hardware spread).
    spread: RunningQuantile = field(default_factory=RunningQuantile)
    grad_spikes: int = 0
    non_finite_reports: int = 0
    self_checks_issued: int = 0
    cross_checks_issued: int = 0
    mismatches: int = 0
    #: The self-check watermark (R6): newest step at which a self-check passed with no
    #: mismatch at or before it since. It vouches against transient faults only (a
    #: deterministically wrong GPU passes its self-check): the clean-ancestor bound for a
    #: rollback after a self-check mismatch.
    last_passing_check_step: int = -1
    #: Step of the first unresolved mismatch. While set, passing checks at later steps do
    #: not advance the watermark (the corruption is already in the weights); cleared when
    #: an attempt resumes from a step at or before the watermark (a rollback).
    suspect_since_step: int | None = None
    #: Recent passing check steps, sorted: lets a late-arriving mismatch pull the watermark back.
    passing_steps: list[int] = field(default_factory=list)
    current: AttemptSdc | None = None
    #: The cross-rank watermark, per rank: the newest step at which a cross-rank (ring or
    #: pair) check covering the rank passed. It vouches against deterministic faults: a
    #: device named by a cross-rank check computed right at its watermark, so the weights
    #: were clean there. Ranks never covered are absent (-1).
    cross_verified: dict[int, int] = field(default_factory=dict)
    #: |a - b| / |b| of recent passing ring edges (the ring's good-hardware spread: each
    #: edge is a different microbatch, so gaps are relative to its value).
    ring_spread: RunningQuantile = field(default_factory=RunningQuantile)
    #: Steps of disagreements awaiting bisection: the watermark is held below the oldest,
    #: and moves on if the bisection refutes it (see :meth:`hold`).
    held_steps: list[int] = field(default_factory=list)

    def for_attempt(self, attempt: int, resumed_from_step: int) -> AttemptSdc:
        """The per-attempt memory, renewed when the run moves to a new attempt. An attempt
        resumes from `resumed_from_step`: the watermark never lies past it, and an attempt
        resuming at or before the watermark (a rollback to the clean ancestor) clears suspicion."""
        if self.current is not None and self.current.attempt == attempt:
            return self.current
        if self.current is not None:
            for rank, step in self.cross_verified.items():  # work past the resume point is gone
                if step > resumed_from_step:
                    self.cross_verified[rank] = resumed_from_step
            for step in self.held_steps:  # never resolved: as suspect as a mismatch
                self.suspect(step)
            self.held_steps = []
            if self.suspect_since_step is not None and resumed_from_step <= self.last_passing_check_step:
                self.suspect_since_step = None
            if resumed_from_step < self.last_passing_check_step:
                self.last_passing_check_step = resumed_from_step
                del self.passing_steps[bisect_left(self.passing_steps, resumed_from_step + 1) :]
        start = max(resumed_from_step, 0)
        self.current = AttemptSdc(attempt, last_self_check_step=start, last_cross_check_step=start)
        return self.current

    def passed(self, step: int) -> None:
        """An SDC check passed at `step`: the watermark advances, unless a mismatch at or
        before `step` is unresolved (the corruption is already in the weights)."""
        if self.suspect_since_step is not None and step >= self.suspect_since_step:
            return
        insort(self.passing_steps, step)
        if len(self.passing_steps) > REMEMBERED:
            del self.passing_steps[0]
        if self.held_steps and step >= self.held_steps[0]:
            return  # kept in passing_steps: counted if the bisection refutes the disagreement
        self.last_passing_check_step = max(self.last_passing_check_step, step)

    def vouch(self, ranks: Iterable[int], step: int) -> None:
        """A cross-rank check covering `ranks` passed at `step`."""
        verified = self.cross_verified
        for rank in ranks:
            if verified.get(rank, -1) < step:
                verified[rank] = step

    def cross_watermark(self, rank: int) -> int:
        """The newest step at which a cross-rank check covering `rank` passed (-1: never)."""
        return self.cross_verified.get(rank, -1)

    def oldest_cross_watermark(self, world_size: int) -> int:
        """The oldest per-rank cross-rank watermark over the job's ranks (-1 if any rank was
        never covered): a deterministic-fault rollback never needs a checkpoint older than
        the newest one at or before it."""
        verified = self.cross_verified
        if len(verified) < world_size:  # some rank of the job was never covered
            return -1
        if len(verified) == world_size and max(verified) == world_size - 1:  # every rank: C-speed scans
            return min(verified.values(), default=-1)
        return min((verified.get(r, -1) for r in range(world_size)), default=-1)

    def suspect(self, step: int) -> None:
        """A mismatch at `step`: freeze the watermark below it (a late-arriving mismatch
        pulls it back below passes already counted)."""
        if self.suspect_since_step is None or step < self.suspect_since_step:
            self.suspect_since_step = step
        self._pull_back(step)

    def hold(self, step: int) -> None:
        """A disagreement at `step` is being bisected: hold the watermark below it (as
        :meth:`suspect` does) until :meth:`release` says what the bisection found."""
        insort(self.held_steps, step)
        self._pull_back(step)

    def release(self, step: int, confirmed: bool) -> None:
        """The bisection of the disagreement at `step` is over: a confirmed fault is a
        mismatch (:meth:`suspect`); a refuted one lets the passes since count again."""
        if step in self.held_steps:
            self.held_steps.remove(step)
        if confirmed:
            self.suspect(step)
            return
        bounds = self.held_steps[:1]
        if self.suspect_since_step is not None:
            bounds.append(self.suspect_since_step)
        passes = self.passing_steps
        below = passes[: bisect_left(passes, min(bounds))] if bounds else passes
        if below:
            self.last_passing_check_step = max(self.last_passing_check_step, below[-1])

    def _pull_back(self, step: int) -> None:
        if self.last_passing_check_step >= step:
            earlier = bisect_left(self.passing_steps, step)
            self.last_passing_check_step = self.passing_steps[earlier - 1] if earlier else -1

    def tolerance(self, policy: SdcPolicy) -> float | None:
        """sigma x the good-hardware rank-to-rank spread, or None while uncalibrated.

        The spread is estimated robustly, 1.4826 x median(|a - b|) (the MAD of the signed,
        zero-centred difference): one wrong GPU caught in calibration cannot inflate it."""
        if len(self.spread) < policy.cross_check_min_samples:
            return None
        sigma = MEDIAN_ABS_TO_SIGMA * self.spread.quantile(0.5)
        return max(policy.cross_check_min_tolerance, policy.cross_check_sigma * sigma)
