"""Retention of validated checkpoints (seed R6 change 1): 3 x (check interval /
checkpoint interval) + 2 recent ones plus a milestone every 6 h, applied to the rollback
index, so that the rollback chooses among what is really kept."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.retention import (
    RetentionPolicy,
    keep_count_for,
    retained,
    watermark_interval_steps,
)
from trainguard.processors.core.decisions.rollback import (
    Bound,
    keep_count,
    on_mismatch,
    on_validated,
    retention_count,
)
from trainguard.processors.core.decisions.rollback_state import KEEP_ALL, RollbackState, Validated
from trainguard.processors.core.detectors.sdc_state import SdcPolicy
from trainguard.processors.core.state import RunState
from trainguard.schemas import (
    CheckpointValidated,
    Page,
    Reason,
    ReasonCode,
    Rollback,
    SdcMismatch,
    SdcSelfCheck,
)

POLICY = RetentionPolicy()
MINUTE, HOUR, DAY = 60.0, 3600.0, 86_400.0
T0 = 1_800_000_000.0


def validated(step: int, ts: float, n: int = 0) -> CheckpointValidated:
    return CheckpointValidated(
        event_id=f"v-{step}-{n}",
        run_id="run-r",
        attempt=0,
        rank=-1,
        node="",
        step=step,
        ts=ts,
        checkpoint_step=step,
        uri=f"mem://run-r/{step}",
        last_verified_step=step,
    )


def mismatch(step: int) -> SdcMismatch:
    return SdcMismatch(
        event_id=f"m-{step}",
        run_id="run-r",
        attempt=0,
        rank=5,
        node="node-001",
        step=step,
        ts=T0 + step,
        reason=Reason(code=ReasonCode.SELF_CHECK_MISMATCH, text="test"),
        method="self_check",
        microbatch_id=f"mb-{step}",
    )


# --------------------------------------------------------------------------- how many


def test_the_seeds_arithmetic_rounds_the_ratio_up() -> None:
    # R6: checks every 1,000 steps (~33 min), checkpoints every 13.6 min. The seed writes
    # 3 x 2.43 + 2 ~ 9; up to three checkpoints fit in one check interval (the seed's own
    # words), so the ratio is rounded up: 3 x 3 + 2 = 11, two checkpoints of insurance.
    assert round(3 * (33 / 13.6) + 2, 2) == 9.28
    assert keep_count_for(33 * MINUTE, 13.6 * MINUTE) == 11
    # R6 change 3: self-checks every 100 steps (~3.3 min) leave at most one unverified.
    assert keep_count_for(3.3 * MINUTE, 13.6 * MINUTE) == 5
    # An exact multiple is not rounded past itself (float slack): 20 s / 10 s is 2.
    assert keep_count_for(20.0, 10.0) == 8
    assert keep_count_for(0.0, 600.0) == 2  # no SDC check: nothing to roll back to
    with pytest.raises(ValueError, match="positive"):
        keep_count_for(60.0, 0.0)


@pytest.mark.parametrize(("check", "ckpt"), [(100, 50), (1000, 300), (10, 100), (1000, 408)])
def test_in_time_it_is_the_same_rule_as_in_steps(check: int, ckpt: int) -> None:
    step_s = 1.983
    assert keep_count_for(check * step_s, ckpt * step_s) == retention_count(check, ckpt)


def test_the_watermark_goes_stale_by_one_self_check_interval() -> None:
    # The self-check rotates over the ranks, but every passing one advances the watermark.
    assert watermark_interval_steps(SdcPolicy()) == 100
    assert watermark_interval_steps(SdcPolicy(self_check_every=0)) == 10_000  # cross-rank only
    assert watermark_interval_steps(SdcPolicy(self_check_every=0, cross_check_every=0)) == 0


def test_the_run_keeps_more_when_the_launcher_checkpoints_more_often_than_configured() -> None:
    policy = CorePolicy()
    run = RunState("run-r")
    assert keep_count(run, policy) == KEEP_ALL  # no step time yet: prune nothing
    run.step_times.extend([2.0] * 50)  # W = 100 steps x 2 s = 200 s
    assert keep_count(run, policy) == 3 * 1 + 2  # T = the launcher's 1,800 s
    run.interval.current_s = 100.0  # the core published 100 s
    assert keep_count(run, policy) == 3 * 2 + 2
    run.rollback.gaps_s.extend([60.0, 61.0, 59.0])  # ... but checkpoints come every ~60 s
    assert keep_count(run, policy) == 3 * 4 + 2
    off = policy.model_copy(update={"sdc": SdcPolicy(self_check_every=0, cross_check_every=0)})
    assert keep_count(run, off) == 2


def test_policy_is_frozen_strict_and_documented() -> None:
    assert POLICY.milestone_every_s == 6 * HOUR and POLICY.min_keep == 2
    assert CorePolicy().retention == POLICY
    with pytest.raises(ValidationError):
        RetentionPolicy(milestone_every_s=0)
    with pytest.raises(ValidationError):
        RetentionPolicy(keep=3)  # type: ignore[call-arg]
    assert all(f.description for f in RetentionPolicy.model_fields.values())


# --------------------------------------------------------------------------- which ones


def test_thirty_days_of_checkpoints_keep_a_milestone_every_6_hours_plus_the_recent_ones() -> None:
    every = 13.6 * MINUTE
    keep = keep_count_for(33 * MINUTE, every)  # 11
    state = RollbackState()
    n = math.floor(30 * DAY / every) + 1  # 3,177 checkpoints, the last at 29.99 days
    dropped: list[int] = []
    for i in range(n):
        dropped += on_validated(state, validated(10 * (i + 1), T0 + i * every), keep, POLICY)
        assert len(state.validated) <= keep + 1 + (i * every) // (6 * HOUR)
    kept = sorted(state.validated)
    recent = [10 * (i + 1) for i in range(n - keep, n)]
    milestones = [s for s in kept if s not in recent]
    assert len(milestones) == 120  # 30 days / 6 h, the first period's being the run's first checkpoint
    for k, step in enumerate(milestones):  # each period's first checkpoint
        ts = state.validated[step].ts - T0
        assert k * 6 * HOUR <= ts < k * 6 * HOUR + every
    assert kept == milestones + recent and len(kept) == 120 + 11
    # Each checkpoint is pruned once, oldest first, and the record is kept for reports.
    assert sorted(dropped) == dropped and len(dropped) == n - len(kept)
    assert set(dropped) | set(kept) == {10 * (i + 1) for i in range(n)}
    assert [v.step for v in state.pruned] == dropped


def test_pruning_is_idempotent_under_redelivery() -> None:
    state = RollbackState()
    events = [validated(100 * (i + 1), T0 + i * 2 * HOUR) for i in range(40)]  # 80 h
    first = [on_validated(state, e, 4, POLICY) for e in events]
    assert sum(map(len, first)) == 40 - len(state.validated) > 0
    index, pruned = dict(state.validated), list(state.pruned)
    again = [on_validated(state, e, 4, POLICY) for e in events]  # every event delivered twice
    assert again == [[]] * 40
    assert state.validated == index and state.pruned == pruned


def test_a_milestone_is_never_displaced_by_a_later_checkpoint_of_its_period() -> None:
    points = [Validated(s, "", s, T0 + s) for s in (0, 100, 21_600, 21_700, 30_000, 43_300)]
    one = RetentionPolicy(min_keep=1)
    assert retained(points[:4], 1, one) == {0, 21_600, 21_700}
    assert retained(points, 1, one) == {0, 21_600, 43_300}  # 43,300 s opens the third period
    assert retained(points, 1, POLICY) == {0, 21_600, 30_000, 43_300}  # min_keep 2 is a floor
    assert retained(points, 1, RetentionPolicy(min_keep=4)) == {0, 21_600, 21_700, 30_000, 43_300}
    assert retained(points[1:], 1, one, origin_ts=T0) == {100, 21_600, 43_300}  # periods from the run's first
    assert retained([], 5, POLICY) == set()


# --------------------------------------------------------------------------- the rollback


def test_a_6h_milestone_is_the_clean_ancestor_when_the_recent_ones_are_all_after_the_watermark() -> None:
    state = RollbackState()
    every = 20 * MINUTE  # checkpoint steps 10, 20, ...: one every 20 minutes
    for i in range(60):  # 20 h
        on_validated(state, validated(10 * (i + 1), T0 + i * every), 5, POLICY)
    assert sorted(state.validated) == [10, 190, 370, 550, 560, 570, 580, 590, 600]  # 0, 6, 12, 18 h
    (rollback,) = on_mismatch(state, mismatch(600), Bound(400, "test"))  # 400 itself was dropped
    assert isinstance(rollback, Rollback) and rollback.checkpoint_step == 370  # the 12 h milestone
    assert "checkpoint 370" in rollback.reason.text
    assert "skipping checkpoint(s) 550, 560, 570, 580, 590, 600" in rollback.reason.text


def test_no_clean_ancestor_when_retention_dropped_it() -> None:
    # The validator finished checkpoint 10 after 20 and 30 (a slow shard): 20 opened the run's
    # first milestone period, 10 was only ever a recent one, and retention dropped it.
    state = RollbackState()
    order = [(20, 0.0), (30, 600.0), (10, 700.0)] + [(10 * k, 600.0 * (k - 1)) for k in range(4, 12)]
    for step, dt in order:
        on_validated(state, validated(step, T0 + dt), 3, POLICY)
    assert 10 in {v.step for v in state.pruned} and min(state.validated) == 20
    (page,) = on_mismatch(state, mismatch(110), Bound(15, "test"))
    assert isinstance(page, Page) and page.reason.code == ReasonCode.NO_CLEAN_ANCESTOR
    assert "retention already dropped step 10" in page.reason.text


def self_check(job: Job, rank: int, ok: bool) -> SdcSelfCheck:
    digest = "ab" * 8
    return SdcSelfCheck(
        **job._env(rank),
        microbatch_id=f"mb-{job.step}-{rank}",
        digest_first=digest,
        digest_second=digest if ok else "cd" * 8,
    )


def test_the_engine_prunes_the_index_and_rolls_back_to_a_surviving_milestone() -> None:
    # One step a minute, a checkpoint every ~10 minutes (jittered): W = 100 min, T ~ 10 min,
    # keep 3 x 10 + 2 = 32, or 35 while the measured interval is a hair under 10 min.
    job = Job(world_size=2, ranks_per_node=1, step_s=60.0, checkpoint_every=10).start().steps(431)
    job.events.append(self_check(job, 0, ok=True))  # the watermark: step 430
    job.steps(370)
    job.events.append(self_check(job, 1, ok=False))  # step 800: node-001 computes wrong
    state, outputs = run_all(job.events, CorePolicy())
    index = state.runs["run-test"].rollback
    kept = sorted(index.validated)
    recent = [s for s in kept if s > 430]
    assert recent == list(range(800 - 10 * (len(recent) - 1), 801, 10)) and 32 <= len(recent) <= 35
    milestones = [s for s in kept if s <= 430]  # the run's first checkpoint, then ~6 h in
    assert milestones[0] == 10 and len(milestones) == 2 and 360 <= milestones[1] <= 390
    assert 430 in {v.step for v in index.pruned}  # the newest clean one did not survive ...
    (rollback,) = [o for o in outputs if isinstance(o, Rollback)]
    assert rollback.checkpoint_step == milestones[1]  # ... the 6 h milestone did
