"""Rollback to the clean ancestor (seed R6): an SDC mismatch sends the run back to the
newest validated checkpoint at or before the last passing check, as an interruption with
its lost work; with no such checkpoint left, a page says so."""

from __future__ import annotations

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.decisions.rollback import retention_count
from trainguard.schemas import (
    Interruption,
    Page,
    QuarantineNode,
    ReasonCode,
    Rollback,
    SdcMismatch,
    SdcSelfCheck,
)

POLICY = CorePolicy()


def self_check(job: Job, rank: int, step: int, ok: bool) -> SdcSelfCheck:
    env = {**job._env(rank), "step": step}
    digest = "ab" * 8
    return SdcSelfCheck(
        **env,
        microbatch_id=f"mb-{step}-{rank}",
        digest_first=digest,
        digest_second=digest if ok else "cd" * 8,
    )


def of(kind: type, outputs: list) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def test_a_mismatch_rolls_back_to_the_newest_checkpoint_before_the_last_passing_check() -> None:
    job = Job(checkpoint_every=10).start().steps(100)  # validated checkpoints 10, 20, ..., 90
    job.events += [self_check(job, 2, 35, ok=True), self_check(job, 7, 62, ok=True)]
    job.events.append(self_check(job, 5, 88, ok=False))  # rank 5 (node-001) computed wrong at 88
    _, outputs = run_all(job.events, POLICY)
    (found,) = of(SdcMismatch, outputs)
    (rollback,) = of(Rollback, outputs)
    (interruption,) = of(Interruption, outputs)
    assert rollback.checkpoint_step == 60 and rollback.uri == "mem://run-test/60"  # 70-90 may be corrupt
    assert rollback.reason.code == ReasonCode.ROLLBACK
    assert "at or before the verification watermark (step 62)" in rollback.reason.text
    assert "skipping checkpoint(s) 70, 80, 90" in rollback.reason.text
    assert rollback.caused_by == [found.event_id]
    assert interruption.cause.value == "sdc" and (interruption.rank, interruption.node) == (5, "node-001")
    assert interruption.last_checkpoint_step == 60 and interruption.lost_steps == 99 - 60
    assert [q.node for q in of(QuarantineNode, outputs)] == ["node-001"]
    assert of(Page, outputs) == []


def test_a_second_mismatch_in_the_same_attempt_does_not_roll_back_again() -> None:
    job = Job(checkpoint_every=10).start().steps(100)
    job.events += [self_check(job, 2, 35, ok=True), self_check(job, 5, 88, ok=False)]
    job.events.append(self_check(job, 9, 95, ok=False))
    _, outputs = run_all(job.events, POLICY)
    assert len(of(SdcMismatch, outputs)) == 2 and len(of(Rollback, outputs)) == 1
    assert of(Rollback, outputs)[0].checkpoint_step == 30


def test_no_clean_ancestor_left_pages_instead_of_rolling_back() -> None:
    job = Job(checkpoint_every=10).start().steps(100)
    job.events.append(self_check(job, 5, 88, ok=False))  # no check ever passed: nothing is verified
    _, outputs = run_all(job.events, POLICY)
    assert of(Rollback, outputs) == [] and of(Interruption, outputs) == []
    (page,) = of(Page, outputs)
    assert page.rule == "no_clean_ancestor" and page.reason.code == ReasonCode.NO_CLEAN_ANCESTOR
    assert "newest is step 90" in page.reason.text


def test_rollback_can_be_left_to_a_human() -> None:
    job = Job(checkpoint_every=10).start().steps(100)
    job.events += [self_check(job, 2, 35, ok=True), self_check(job, 5, 88, ok=False)]
    _, outputs = run_all(job.events, POLICY.model_copy(update={"rollback_on_sdc": False}))
    assert of(SdcMismatch, outputs) and of(Rollback, outputs) == [] and of(Interruption, outputs) == []


def test_retention_keeps_enough_checkpoints_for_a_late_detection() -> None:
    # 3 x (check interval / checkpoint interval) + 2: a clean ancestor survives a mismatch
    # found up to a full check interval late.
    assert retention_count(100, 50) == 8
    assert retention_count(1000, 300) == 14
    assert retention_count(10, 100) == 5
