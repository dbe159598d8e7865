"""A checkpoint refused at resume (issue 15 item 1): a checkpoint fault, never a node fault.

Rank 0 verifies the checkpoint its attempt was told to resume from; one that fails (a
flipped byte, a missing shard, a load error) is marked REJECTED on storage and the attempt
resumes from the newest validated checkpoint older than it, reported as CheckpointRejected.
The core then:

- forgets the checkpoint (the rollback index, the newest validated step), so that no later
  Rollback or lost-work count names it;
- moves the attempt's resume point to the step actually resumed from, while the attempt
  has completed no step (what it re-does is counted from there);
- records the rejection as a ResumeRejected with its reason, caused by the report and by
  the interruption whose restart it belongs to (``restart_of``: so it shows in that
  timeline entry, even when another rank's first step closed the interruption first);
- quarantines nothing and pages nothing. When nothing valid is left (resumed_from_step
  -1) the ranks cannot start: their exits in that attempt name no culprit node either
  (engine._on_exit reads ``no_checkpoint_attempt``).
"""

from __future__ import annotations

from ....schemas import CheckpointRejected, Reason, ReasonCode, ResumeRejected
from ..ids import derived_id
from ..state import RunState


def on_rejected(run: RunState, event: CheckpointRejected) -> list[ResumeRejected]:
    step, resumed = event.checkpoint_step, event.resumed_from_step
    run.rollback.validated.pop(step, None)
    if run.last_validated_step >= step:
        run.last_validated_step = max((s for s in run.rollback.validated if s < step), default=resumed)
    current = event.attempt == run.attempt
    if current and run.resumed_from_step >= step:  # the attempt was started from it
        claimed, run.resumed_from_step = run.resumed_from_step, resumed
        if run.job_step <= claimed:  # its steps up to the claimed one did not count as progress
            run.job_step = max([resumed, *(r.last_step for r in run.ranks.values())])
    if current and resumed < 0:
        run.no_checkpoint_attempt = run.attempt
    restart_of = run.restart_of if current else ""
    instead = f"resumes from step {resumed}" if resumed >= 0 else "has no valid checkpoint left"
    return [
        ResumeRejected(
            event_id=derived_id("resume_rejected", event.event_id),
            run_id=run.run_id,
            attempt=event.attempt,
            rank=-1,
            node="",
            step=step,
            ts=event.ts,
            reason=Reason(
                code=ReasonCode.CHECKPOINT_REJECTED,
                text=f"checkpoint step {step} failed verification before resume ({event.error[:1200]}); "
                f"attempt {event.attempt} {instead}; a checkpoint fault: no node is quarantined",
            ),
            caused_by=[event.event_id, *([restart_of] if restart_of else [])],
            checkpoint_step=step,
            resumed_from_step=resumed,
            interruption_id=restart_of,
        )
    ]
