"""Settings and state of the SDC detector (seed §7 failure 3, R3, R6).

Kept apart from the handlers in :mod:`.sdc` and free of imports from the rest of the
core, so that ``RunState`` can embed an :class:`SdcState` and ``CorePolicy`` an
:class:`SdcPolicy` without an import cycle.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

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
    cross_check_every: int = Field(
        10_000, ge=0, description="Steps between cross-rank checks once calibrated (R3); 0 disables."
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
    cross_check_min_tolerance: float = Field(
        0.0,
        ge=0,
        description="Floor on the cross-rank tolerance (absolute). 0 trusts the measured spread "
        "even when good hardware agrees bitwise.",
    )


class RunningQuantile:
    """The last `window` values, kept sorted as well, for O(log n) nearest-rank quantiles."""

    def __init__(self) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float, window: int) -> None:
        self._order.append(value)
        insort(self._sorted, value)
        while len(self._order) > window:
            del self._sorted[bisect_left(self._sorted, self._order.popleft())]

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (the same definition as the watchdog's p99)."""
        n = len(self._sorted)
        if n == 0:
            return math.nan
        return self._sorted[min(n - 1, max(0, math.ceil(q * n) - 1))]

    def values(self) -> list[float]:
        return list(self._order)


@dataclass
class AttemptSdc:
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
    #: microbatch_id -> event_id of the two-rank check whose mismatch is being bisected.
    bisecting: dict[str, str] = field(default_factory=dict)


@dataclass
class SdcState:
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
    #: The verification watermark (R6): newest step at which an SDC check passed with no
    #: mismatch at or before it since. The clean-ancestor bound for rollback.
    last_passing_check_step: int = -1
    #: Step of the first unresolved mismatch. While set, passing checks at later steps do
    #: not advance the watermark (the corruption is already in the weights); cleared when
    #: an attempt resumes from a step at or before the watermark (a rollback).
    suspect_since_step: int | None = None
    #: Recent passing check steps, sorted: lets a late-arriving mismatch pull the watermark back.
    passing_steps: list[int] = field(default_factory=list)
    current: AttemptSdc | None = None

    def for_attempt(self, attempt: int, resumed_from_step: int) -> AttemptSdc:
        """The per-attempt memory, renewed when the run moves to a new attempt. An attempt
        resumes from `resumed_from_step`: the watermark never lies past it, and an attempt
        resuming at or before the watermark (a rollback to the clean ancestor) clears suspicion."""
        if self.current is not None and self.current.attempt == attempt:
            return self.current
        if self.current is not None:
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
        self.last_passing_check_step = max(self.last_passing_check_step, step)

    def suspect(self, step: int) -> None:
        """A mismatch at `step`: freeze the watermark below it (a late-arriving mismatch
        pulls it back below passes already counted)."""
        if self.suspect_since_step is None or step < self.suspect_since_step:
            self.suspect_since_step = step
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
