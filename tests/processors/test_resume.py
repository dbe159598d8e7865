"""Issue 15 items 1 and 4 on the pure core: a checkpoint refused at resume is its own
event and no node's fault; an interruption's lost steps count from the newest step any
rank completed, even when the survivors' last StepTimings have not arrived yet."""

from __future__ import annotations

import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, HangPolicy, run_all
from trainguard.schemas import (
    CheckpointRejected,
    Interruption,
    InterruptionRecovered,
    Page,
    QuarantineNode,
    ReasonCode,
    ResumeRejected,
    Rollback,
)

POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))


def rejected(job: Job, step: int, resumed: int, error: str) -> Job:
    """Rank 0 found checkpoint `step` corrupt at load and resumed from `resumed`."""
    job.events.append(
        CheckpointRejected(
            **job._env(0),
            checkpoint_step=step,
            uri=f"mem://{job.run_id}/{step}",
            error=error,
            resumed_from_step=resumed,
        )
    )
    return job


def stopped_and_resumed_past_a_corrupt_checkpoint() -> Job:
    """Attempt 0 runs to step 34 (validated 10, 20, 30) and its ranks stop on request; attempt
    1 was told to resume from 30, whose shard rank 0 finds flipped: it resumes from 20."""
    job = Job(world_size=4).start().steps(35)
    for r in range(4):
        job.exit(r, signal=15, requested=True)
    job.restart(resumed_from_step=30)
    rejected(job, 30, 20, "re-verification before resume failed: digest mismatch in shard __2_0.distcp")
    job.step = 20
    return job.steps(12)


def test_a_checkpoint_rejected_at_resume_is_its_own_event_in_the_restarts_timeline() -> None:
    state, outputs = run_all(stopped_and_resumed_past_a_corrupt_checkpoint().events, POLICY)
    (restart,) = [o for o in outputs if isinstance(o, Interruption)]  # the operator's restart
    (rejection,) = [o for o in outputs if isinstance(o, ResumeRejected)]
    assert rejection.reason.code == ReasonCode.CHECKPOINT_REJECTED
    assert "checkpoint step 30 failed verification before resume" in rejection.reason.text
    assert "digest mismatch in shard __2_0.distcp" in rejection.reason.text
    assert "attempt 1 resumes from step 20" in rejection.reason.text
    assert (rejection.checkpoint_step, rejection.resumed_from_step, rejection.attempt) == (30, 20, 1)
    assert rejection.interruption_id == restart.interruption_id in rejection.caused_by
    assert not [o for o in outputs if isinstance(o, QuarantineNode | Page)]
    run = state.runs["run-test"]
    assert run.resumed_from_step == 20
    # step 30 was re-done and its new checkpoint validated in attempt 1: that one counts
    assert run.rollback.validated[30].ts > rejection.ts and run.last_validated_step == 30


def test_a_crash_after_the_fallback_counts_lost_steps_from_the_step_resumed_from() -> None:
    job = Job(world_size=4).start().steps(35)
    for r in range(4):
        job.exit(r, signal=15, requested=True)
    job.restart(resumed_from_step=30)
    rejected(job, 30, 20, "missing shard __1_0.distcp")
    job.step = 20
    job.steps(5).exit(3, signal=9)  # steps 21..25, then a crash
    _, outputs = run_all(job.events, POLICY)
    crash = [o for o in outputs if isinstance(o, Interruption)][-1]
    assert (crash.step, crash.last_checkpoint_step, crash.lost_steps) == (25, 20, 5)


def test_a_rollback_never_targets_a_checkpoint_rejected_at_resume() -> None:
    job = stopped_and_resumed_past_a_corrupt_checkpoint()
    state, _ = run_all(job.events, POLICY)
    assert sorted(state.runs["run-test"].rollback.validated) == [10, 20, 30]  # 30: the new one
    job2 = Job(world_size=4, run_id="run-2").start().steps(35)
    job2.restart(resumed_from_step=30)
    rejected(job2, 30, 20, "missing shard __1_0.distcp")
    state2, outputs = run_all(job2.events, POLICY)
    assert sorted(state2.runs["run-2"].rollback.validated) == [10, 20]
    assert not [o for o in outputs if isinstance(o, Rollback | QuarantineNode)]


def test_with_no_valid_checkpoint_left_the_ranks_exits_quarantine_no_node() -> None:
    job = Job(world_size=4).start().steps(35)
    for r in range(4):
        job.exit(r, signal=15, requested=True)
    job.restart(resumed_from_step=30)
    rejected(job, 30, -1, "digest mismatch in shard __0_0.distcp")
    job.exit(0, exit_code=1)
    _, outputs = run_all(job.events, POLICY)
    crash = [o for o in outputs if isinstance(o, Interruption)][-1]
    assert crash.rank == -1 and crash.reason.code == ReasonCode.CHECKPOINT_REJECTED
    assert "no valid checkpoint was left" in crash.reason.text
    assert not [o for o in outputs if isinstance(o, QuarantineNode | Page)]
    (rejection,) = [o for o in outputs if isinstance(o, ResumeRejected)]
    assert "has no valid checkpoint left" in rejection.reason.text


def test_lost_steps_are_exact_when_the_survivors_reports_are_still_in_their_shippers() -> None:
    """The ranks completed step 36; the core has seen StepTimings up to 24 only. The
    launcher's RankExit carries job_step (the ranks' progress files): the interruption
    says after step 36, 16 lost since checkpoint 20."""
    job = Job(world_size=4).start().steps(25)
    job.step = 36
    job.exit(3, signal=9, job_step=36)
    _, outputs = run_all(job.events, POLICY)
    (crash,) = [o for o in outputs if isinstance(o, Interruption)]
    assert (crash.step, crash.last_checkpoint_step, crash.lost_steps) == (36, 20, 16)
    assert "after step 36" in crash.reason.text


def test_lost_steps_reach_the_recovery_record() -> None:
    job = Job(world_size=4).start().steps(25)
    job.step = 36
    job.exit(3, signal=9, job_step=36)
    job.restart(resumed_from_step=20).steps(2)
    _, outputs = run_all(job.events, POLICY)
    (recovered,) = [o for o in outputs if isinstance(o, InterruptionRecovered)]
    assert "16 steps" in recovered.reason.text


def test_a_checkpoint_validated_after_the_crash_moves_the_restarts_lost_work() -> None:
    """Checkpoint 30's validation lands after rank 3's crash (rank 0 flushed it as the
    attempt ended): the interruption counts back to 20, the newest validated it knew; the
    launcher resumes from 30. The recovery, and the goodput, count the 6 steps re-done."""
    job = Job(world_size=4, checkpoint_every=0).start().steps(21).validated(20).steps(16)
    job.exit(3, signal=9)
    job.validated(30)
    job.restart(resumed_from_step=30).steps(2)
    state, outputs = run_all(job.events, POLICY)
    (crash,) = [o for o in outputs if isinstance(o, Interruption)]
    assert (crash.step, crash.last_checkpoint_step, crash.lost_steps) == (36, 20, 16)
    (recovered,) = [o for o in outputs if isinstance(o, InterruptionRecovered)]
    assert (recovered.resumed_from_step, recovered.lost_steps) == (30, 6)
    assert "6 steps" in recovered.reason.text
    assert recovered.lost_s == pytest.approx(6 * job.step_s)
    assert state.runs["run-test"].goodput.totals.lost == pytest.approx(6 * job.step_s)


def test_a_checkpoint_rejected_at_resume_moves_the_restarts_lost_work_back() -> None:
    """Told to resume from 30, rank 0 finds it corrupt and resumes from 20: the crash
    after step 34 re-does 14 steps, not the 4 counted at detection."""
    job = Job(world_size=4).start().steps(35)
    job.exit(3, signal=9)
    job.restart(resumed_from_step=30)
    rejected(job, 30, 20, "digest mismatch in shard __0_0.distcp")
    job.step = 20
    job.steps(2)
    state, outputs = run_all(job.events, POLICY)
    (crash,) = [o for o in outputs if isinstance(o, Interruption)]
    assert (crash.step, crash.last_checkpoint_step, crash.lost_steps) == (34, 30, 4)
    (recovered,) = [o for o in outputs if isinstance(o, InterruptionRecovered)]
    assert (recovered.resumed_from_step, recovered.lost_steps) == (20, 14)
    assert state.runs["run-test"].goodput.totals.lost == pytest.approx(14 * job.step_s)
