"""Which checkpoint the next attempt resumes from.

Resume selection never loops (issue 15). The resume step is the newest checkpoint with a
VALIDATED marker and no REJECTED one (:mod:`.checkpoints`). The ranks verify the named
checkpoint before they load it (producers/checkpoint/manager.py); one that fails is
marked REJECTED and the attempt resumes from the newest validated one older than it, so
the next attempt's choice, read from the same markers, never names it again. When every
checkpoint was rejected the run stops with status "failed" and a message that says so,
unless ``restart_from_scratch``.

A Rollback or ResumeFrom names the step instead; after a rollback to S, the checkpoints
newer than S validated before the rollback (the suspect lineage) are never chosen again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .checkpoints import rejected_steps, validated_steps
from .config import LauncherConfig
from .records import RestartCause
from .run_state import LauncherState, StopRequest


class ResumeChoice:
    def __init__(self, config: LauncherConfig, state: LauncherState, clock: Callable[[], float]) -> None:
        self.config = config
        self.state = state
        self.clock = clock
        self._listed: tuple[float, dict[int, float]] | None = None  # (monotonic time, steps)

    def eligible(self, ignore_rollbacks: bool = False, max_age_s: float = 0.0) -> list[int]:
        """The validated steps, less those a rollback barred (unless `ignore_rollbacks`).
        `max_age_s`: a listing that recent will do (a poll loop on an object store)."""
        now = time.monotonic()
        if self._listed is None or now - self._listed[0] > max_age_s:
            self._listed = (now, validated_steps(self.config.checkpoint_dir))
        steps = self._listed[1]
        rules = [] if ignore_rollbacks else list(self.state.rollbacks)
        return [s for s, mtime in steps.items() if all(s <= bound or mtime >= ts for bound, ts in rules)]

    def newest(self, max_age_s: float = 0.0) -> int:
        return max(self.eligible(max_age_s=max_age_s), default=-1)

    def take(self, request: StopRequest) -> None:
        """Under the lock: the next attempt resumes from the named step (journaled: a
        successor neither loses the rollback nor takes it twice)."""
        assert request.resume_step is not None
        state = self.state
        ts = self.clock()
        rollback = request.cause is RestartCause.ROLLBACK
        state.journal.append(
            "take", key=request.command_id, step=request.resume_step, rollback=rollback, ts=ts
        )
        state.taken.add(request.command_id)
        state.forced_resume = request.resume_step
        if rollback:
            state.rollbacks.append((request.resume_step, ts))
        state.request = None

    def none_left(self, resume: int) -> str:
        """Why the run stops before an attempt from scratch: every checkpoint it had was
        rejected at load ('' when there is nothing to stop for, or the config allows a
        start from step 0)."""
        if resume >= 0 or self.config.restart_from_scratch:
            return ""
        rejected = rejected_steps(self.config.checkpoint_dir)
        if not rejected:
            return ""  # no checkpoint was ever made: step 0 is the run's own start
        why = "; ".join(f"step {step}: {reason}" for step, reason in sorted(rejected.items(), reverse=True))
        return (
            f"no valid checkpoint left in {self.config.checkpoint_dir}: every one was rejected "
            f"({why[:1500]}); not restarting from step 0 (--restart-from-scratch allows it)"
        )
