"""When a rank checkpoints: the interval in force (seconds) turned into steps.

The core publishes the checkpoint interval in seconds (processors/core/interval.py: Young's
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
the interval counts in wall-clock seconds since the last save (or the first step). No
interval at all: no save on time (a CheckpointNow still saves). An explicit fixed cadence,
`every_steps`, replaces the interval: a save after every step s with (s + 1) % N == 0, as a
loop that saves every N steps does (tests whose bitwise comparisons depend on which steps
are saved).

Pure: no clock of its own (times are passed in), no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
    _step_s: deque[float] = field(default_factory=deque)
    _begun: tuple[int, float] | None = None  # (step, time) of the latest step begun
    _saved: tuple[int, float] | None = None  # (step, time) of the latest save, or the start

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {self.every_steps}")
        self._step_s = deque(maxlen=self.window)

    def begin(self, step: int, now: float) -> None:
        """`step` starts at `now`: a step-time sample if it follows the previous one."""
        if self._begun is not None and step == self._begun[0] + 1 and now >= self._begun[1]:
            self._step_s.append(now - self._begun[1])
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

    def steps_per_checkpoint(self) -> int | None:
        """The interval in steps (at least 1); None without an interval or a measured step time."""
        step_s = self.step_s()
        if self.interval_s is None or step_s is None:
            return None
        return max(1, round(self.interval_s / step_s)) if step_s > 0 else 1

    def due(self, step: int, now: float) -> bool:
        """True when a checkpoint after `step` is due."""
        if self.every_steps is not None:
            return (step + 1) % self.every_steps == 0
        if self.interval_s is None:
            return False
        saved_step, saved_t = self._saved if self._saved is not None else (step - 1, now)
        steps = self.steps_per_checkpoint()
        if steps is None:  # no step time yet: count the seconds
            return now - saved_t >= self.interval_s
        return step - saved_step >= steps

    def saved(self, step: int, now: float) -> None:
        """A checkpoint of `step` was taken: count again from it."""
        self._saved = (step, now)

    def describe(self) -> str:
        if self.every_steps is not None:
            return f"every {self.every_steps} steps (fixed)"
        if self.interval_s is None:
            return "none on time"
        steps = self.steps_per_checkpoint()
        if steps is None:
            return f"every {self.interval_s:g}s (step time not measured yet)"
        return f"every {self.interval_s:g}s = {steps} steps of {self.step_s():.3g}s"
