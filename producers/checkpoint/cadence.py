"""When a rank checkpoints: the interval in force (seconds) turned into steps.

The core publishes the checkpoint interval in seconds (processors/core/decisions/interval.py: Young's
or Daly's T* from the measured C and M), and the launcher hands the last one to every new
attempt (TRAINGUARD_CHECKPOINT_INTERVAL_S). A checkpoint is collective, so the decision is
taken at a step boundary, in steps: every ``round(interval_s / step_s)`` steps, where
step_s is the median wall-clock time from one step's start to the next's over the latest
`window` steps (data loading and checkpoint blocking included: what the interval is spent
on). Counting steps rather than seconds keeps the saves on a regular grid of steps while
the step time is steady, and the ranks agree on the step anyway (the Supervisor
all-reduces the decision: the first rank due decides for all, then every rank counts
again from that save).

Before `min_samples` step times are measured (a fresh process: the first steps are slow)
the interval counts in wall-clock seconds since the last save (or the first step).

Until an interval is in force (offline, where no processor ever sends one, and online
before its first SetCheckpointInterval), the cadence derives its own from `prior_mtbf_s`,
the MTBF expected of the run's world size (trainguard/common/checkpoint_interval.py): the
first checkpoint is taken as soon as the step time is measured, which measures its cost C
(how much longer than the median the step that saved took: the blocking part, whatever
the loop's saving code); from then on T* = Young's or Daly's (C, M), clamped to
[min_s, max_s] (seed §6), re-derived as C samples come. So a run always has a cadence;
only ``prior_mtbf_s=None`` with no interval saves nothing on time (a CheckpointNow still
saves). An explicit fixed cadence,
`every_steps`, replaces the interval: a save after every step s with (s + 1) % N == 0, as a
loop that saves every N steps does (tests whose bitwise comparisons depend on which steps
are saved).

Pure: no clock of its own (times are passed in), no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from ...common.checkpoint_interval import MAX_S, MIN_S, optimal_s, prior_mtbf_s

#: Checkpoint cost samples the derived interval takes its median over.
COST_SAMPLES = 20


@dataclass
class CheckpointCadence:
    """One rank's checkpoint cadence. Not thread-safe: the training thread owns it (the
    actuator thread's SetCheckpointInterval goes through RankControl)."""

    #: Seconds between checkpoints in force; None: none on time.
    interval_s: float | None = None
    #: A fixed cadence in steps that replaces the interval (None: follow the interval).
    every_steps: int | None = None
    #: Step times the median is taken over.
    window: int = 50
    #: Step times measured before the interval is counted in steps.
    min_samples: int = 5
    #: The MTBF the interval is derived from while none is in force (None: no derivation).
    prior_mtbf_s: float | None = None
    min_s: float = MIN_S
    max_s: float = MAX_S
    _step_s: deque[float] = field(default_factory=deque)
    _costs: deque[float] = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))
    _said: bool = False  # derived_note() said the derived interval
    _begun: tuple[int, float] | None = None  # (step, time) of the latest step begun
    _saved: tuple[int, float] | None = None  # (step, time) of the latest save, or the start

    @classmethod
    def for_run(
        cls, interval_s: float | None, every_steps: int | None, mtbf_prior_s: float | None, world_size: int
    ) -> CheckpointCadence:
        """A rank's cadence: the interval in force, a fixed one, or the one derived from
        `mtbf_prior_s` (None: the seed's prior for `world_size`)."""
        return cls(interval_s, every_steps=every_steps, prior_mtbf_s=mtbf_prior_s or prior_mtbf_s(world_size))

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        self._step_s = deque(maxlen=self.window)

    def begin(self, step: int, now: float) -> None:
        """`step` starts at `now`: a step-time sample if it follows the previous one, and a
        checkpoint cost sample if the previous one saved (its excess over the median)."""
        if self._begun is not None and step == self._begun[0] + 1 and now >= self._begun[1]:
            took = now - self._begun[1]
            median = self.step_s()
            # a real save: the start's stand-in (the first step - 1) never precedes a later begin
            if self._saved is not None and self._saved[0] == step - 1 and median is not None:
                self._costs.append(max(0.0, took - median))
            self._step_s.append(took)
        self._begun = (step, now)
        if self._saved is None:  # this process counts from its first step
            self._saved = (step - 1, now)

    def set_interval(self, interval_s: float | None) -> None:
        self.interval_s = interval_s

    def step_s(self) -> float | None:
        """Median measured step time, None until `min_samples` are measured."""
        if len(self._step_s) < self.min_samples:
            return None
        return statistics.median(self._step_s)

    def cost_s(self) -> float | None:
        """Median measured checkpoint cost (blocking seconds), None before a save's next step."""
        return statistics.median(self._costs) if self._costs else None

    def derived(self) -> tuple[float, str] | None:
        """(T*, formula) from the measured cost and the prior MTBF; None while no interval
        is derived (an interval in force, no prior, or no cost measured yet)."""
        cost = self.cost_s()
        if self.interval_s is not None or self.prior_mtbf_s is None or cost is None:
            return None
        return optimal_s(cost, self.prior_mtbf_s, self.min_s, self.max_s)

    def interval(self) -> float | None:
        """The interval counted: the one in force, else the derived one."""
        if self.interval_s is not None:
            return self.interval_s
        derived = self.derived()
        return derived[0] if derived is not None else None

    def steps_per_checkpoint(self) -> int | None:
        """The interval in steps (at least 1); None without an interval or a measured step time."""
        step_s, interval = self.step_s(), self.interval()
        if interval is None or step_s is None:
            return None
        return max(1, round(interval / step_s)) if step_s > 0 else 1

    def due(self, step: int, now: float) -> bool:
        """True when a checkpoint after `step` is due."""
        if self.every_steps is not None:
            return (step + 1) % self.every_steps == 0
        interval = self.interval()
        if interval is None:  # deriving: the first save, once the step time is measured
            return self.measuring_cost() and self.step_s() is not None
        saved_step, saved_t = self._saved if self._saved is not None else (step - 1, now)
        steps = self.steps_per_checkpoint()
        if steps is None:  # no step time yet: count the seconds
            return now - saved_t >= interval
        return step - saved_step >= steps

    def measuring_cost(self) -> bool:
        """No interval in force and no cost measured yet: the next save measures C (again,
        if the step after the last one did not follow it)."""
        return self.interval_s is None and self.prior_mtbf_s is not None and not self._costs

    def opening_note(self, world_size: int) -> str | None:
        """What a run starting with no interval in force is told (None: one is in force)."""
        if not self.measuring_cost() or self.every_steps is not None or self.prior_mtbf_s is None:
            return None
        return (
            "no checkpoint interval in force yet (offline, or before the processor sends one): the "
            "first checkpoint once the step time is measured, then Young/Daly from its cost and the "
            f"prior MTBF ({self.prior_mtbf_s / 3600:.4g} h for {world_size} ranks)"
        )

    def follow(self, interval_s: float | None) -> str | None:
        """Take the interval in force (the last SetCheckpointInterval, else the launcher's);
        what is worth saying now: a new interval, or the derived one the first time."""
        if interval_s != self.interval_s:
            self.set_interval(interval_s)
            return self.describe()
        return self.derived_note()

    def derived_note(self) -> str | None:
        """The derived interval, the first time there is one (None after, or before)."""
        if self._said or self.derived() is None:
            return None
        self._said = True
        return self.describe()

    def saved(self, step: int, now: float) -> None:
        """A checkpoint of `step` was taken: count again from it."""
        self._saved = (step, now)

    def describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} steps (fixed)"
        if self.interval_s is None and self.prior_mtbf_s is not None:
            derived = self.derived()
            if derived is None:
                return "derived from the prior MTBF once the first checkpoint's cost is measured"
            (t, formula), hours = derived, self.prior_mtbf_s / 3600
            return (
                f"every {t:g}s ({formula}: C={self.cost_s():.3g}s measured, M={hours:.4g} h prior, "
                f"clamped to [{self.min_s:g}, {self.max_s:g}] s; until an interval is sent)"
            )
        interval = self.interval()
        if interval is None:
            return "none on time"
        steps = self.steps_per_checkpoint()
        if steps is None:
            return f"every {interval:g}s (step time not measured yet)"
        return f"every {interval:g}s = {steps} steps of {self.step_s():.3g}s"
