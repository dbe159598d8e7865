"""The ring cross-rank check (issue 14 items 2 and 3) on the pure core: every rank covered
at every check, a deterministically wrong GPU named at the first check after its onset
wherever it sits, nobody blamed on noise or for a dead rank's missing report, and the
rollback behind the culprit's last passing cross-rank check, not a later self-check.

Streams come from :mod:`.sdc_streams` (SdcJob answers RunRingCheck: each rank's own value
and its recomputation of its neighbour's, with float noise, a wrong GPU's bias in both).
Large worlds are fed ring reports directly (2,048 ranks x 300 steps of step stats would be
millions of events); small ones run closed loop."""

from __future__ import annotations

import math
import pickle

import pytest

from harness.devtools.stack import builtin_policy
from trainguard.processors.core.accounting.retention import RetentionPolicy, retained
from trainguard.processors.core.decisions.rollback import Bound, on_mismatch, on_validated
from trainguard.processors.core.decisions.rollback_state import RollbackState
from trainguard.processors.core.detectors.sdc_checks import cross_pair
from trainguard.processors.core.detectors.sdc_ring import ring_offset, ring_tolerance
from trainguard.processors.core.detectors.sdc_state import AttemptSdc, SdcPolicy, SdcState
from trainguard.processors.core.policy import load_policy
from trainguard.schemas import (
    CheckpointValidated,
    Interruption,
    Page,
    QuarantineNode,
    Reason,
    ReasonCode,
    Rollback,
    RunCrossRankCheck,
    RunNodeSelfTest,
    RunRingCheck,
    SdcMismatch,
)

from .sdc_streams import Pipeline, SdcJob, closed_loop

#: Self-checks off (they are tested elsewhere); the tests run the ring checks themselves.
RING = SdcPolicy(self_check_every=0, cross_check_every=10**9, cross_check_calibration_every=10**9)


def of(outputs: list, kind: type) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def ring(job: SdcJob, pipe: Pipeline, step: int, k: int) -> list:
    """Run the k-th ring check at `step` directly: the command the scheduler would send,
    every rank's report, fed to the core (a complete ring is judged on its last report)."""
    job.step = step
    job.t += 1.0
    offset = ring_offset(job.world_size, job.ranks_per_node, k)
    assert offset is not None
    command = RunRingCheck(
        command_id=f"ring-{step}",
        run_id=job.run_id,
        attempt=job.attempt,
        issued_ts=job.t,
        reason=Reason(code=ReasonCode.SDC_CHECK_SCHEDULED, text="test"),
        step=step,
        check_id=f"ring-a{job.attempt}-s{step}",
        offset=offset,
    )
    job.execute([command])
    job._answer_checks()
    out = pipe.feed(job.events[job.fed :])
    job.fed = len(job.events)
    return out


def until_judged(job: SdcJob, pipe: Pipeline) -> tuple[list, float]:
    """Step the job until no ring is pending: the outputs, and the time it was judged at."""
    out: list = []
    while (current := pipe.state().current) is not None and current.rings:
        out += closed_loop(job, pipe, 1)
    return out, job.t


def started(world: int, per_node: int = 8, **faults: object) -> tuple[SdcJob, Pipeline]:
    job = SdcJob(world_size=world, ranks_per_node=per_node, **faults).start()  # type: ignore[arg-type]
    pipe = Pipeline(policy=RING)
    closed_loop(job, pipe, 0)
    return job, pipe


# --------------------------------------------------------------------------- offsets, cadence


@pytest.mark.parametrize(("world", "per_node"), [(64, 8), (2048, 8), (16, 4), (24, 8), (16, 8)])
def test_the_ring_offset_crosses_nodes_rotates_and_never_splits_into_pairs(world: int, per_node: int) -> None:
    nodes = world // per_node
    offsets = [ring_offset(world, per_node, k) for k in range(2 * nodes)]
    assert all(o is not None and 0 < o < world and 2 * o != world for o in offsets)
    if nodes > 2:  # every rank's neighbour is on another node, a different node pairing each check
        assert all(o % per_node == 0 for o in offsets if o is not None)
        assert len(set(offsets)) == len([j for j in range(1, nodes) if 2 * j != nodes])
    assert ring_offset(1, 8, 0) is None and ring_offset(2, 8, 0) == 1 and ring_offset(5, 8, 3) == 4


def test_the_cadence_follows_from_the_cost_budget() -> None:
    # A ring check costs each rank one extra microbatch of one step; the seed's budget is 0.01%.
    assert SdcPolicy().cross_check_every is None and SdcPolicy().cross_check_interval() == 10_000
    assert SdcPolicy(microbatches_per_step=8).cross_check_interval() == 1_250
    assert SdcPolicy(microbatches_per_step=3).cross_check_interval() == 3_334  # rounded up: within budget
    assert SdcPolicy(cross_check_budget=1e-3).cross_check_interval() == 1_000
    assert SdcPolicy(cross_check_every=200).cross_check_interval() == 200  # an explicit override
    assert SdcPolicy(cross_check_every=0).cross_check_interval() == 0  # off
    assert load_policy(str(builtin_policy("evaluate"))).sdc.cross_check_interval() == 200


@pytest.mark.parametrize("world", [1024, 16_384])
def test_the_ring_reaches_every_rank_each_check_where_the_pair_needed_half_the_world(world: int) -> None:
    # The figures for docs: detection latency in checks, for the worst-placed rank.
    offset = ring_offset(world, 8, 0)
    assert offset is not None and {(r + offset) % world for r in range(world)} == set(range(world))
    first_pair = {}
    for k in range(world):
        for r in cross_pair(world, 8, k) or []:
            first_pair.setdefault(r, k)
    checks = [k + 1 for k in first_pair.values()]  # the pair check that first reaches each rank
    assert len(checks) == world and sum(checks) / world == pytest.approx(world / 2, rel=0.1)  # ~W / 2
    assert max(checks) == world * 15 // 16  # the worst-placed rank: 960 and 15,360 checks


# --------------------------------------------------------------------------- naming the culprit


@pytest.mark.parametrize(
    ("world", "wrong"), [(64, 0), (64, 63), (64, 37), (2048, 0), (2048, 2047), (2048, 1234)]
)
def test_a_wrong_gpu_anywhere_is_named_at_the_first_ring_check_after_its_onset(
    world: int, wrong: int
) -> None:
    job, pipe = started(world, wrong={wrong: (150, 1e-3)})
    assert of(ring(job, pipe, 100, 0), SdcMismatch) == []  # calibrates on its own W edges, vouches all
    assert pipe.state().cross_watermark(wrong) == 100
    out = ring(job, pipe, 200, 1)
    assert [type(o) for o in out] == [SdcMismatch, QuarantineNode, RunNodeSelfTest]  # no third rank needed
    found, quarantine, selftest = out
    node = f"node-{wrong // 8:03d}"
    assert (found.rank, found.node, found.method, found.step) == (wrong, node, "ring", 200)
    assert found.reason.code == ReasonCode.CROSS_RANK_MISMATCH
    assert "disagrees with both ring neighbours" in found.reason.text
    assert "last cross-rank check that covered it passed step 100" in found.reason.text
    assert quarantine.node == node and selftest.node == node and wrong in (selftest.ranks or [])
    assert 1e-7 < (found.tolerance or 0) < 1e-6 and (found.deviation or 0) > 1e-4
    state = pipe.state()
    assert state.cross_watermark(wrong) == 100  # frozen at the last pass
    assert all(state.cross_watermark(r) == 200 for r in range(world) if r != wrong)  # neighbours too


def test_two_wrong_gpus_adjacent_in_the_ring_are_both_named() -> None:
    offset = ring_offset(64, 8, 1)
    assert offset == 16
    job, pipe = started(64, wrong={5: (150, 1e-3), 5 + offset: (150, -2e-3)})
    ring(job, pipe, 100, 0)
    out = ring(job, pipe, 200, 1)
    assert sorted(f.rank for f in of(out, SdcMismatch)) == [5, 21]
    assert sorted(q.node for q in of(out, QuarantineNode)) == ["node-000", "node-002"]
    assert of(out, RunCrossRankCheck) == []


def test_two_adjacent_gpus_wrong_the_same_way_are_bisected_and_both_named() -> None:
    # 5 -> 21 agrees (both biased alike), so each has one failing comparison: the
    # three-rank bisection of each lone edge names them, one check interval still.
    job, pipe = started(64, wrong={5: (150, 1e-3), 21: (150, 1e-3)})
    ring(job, pipe, 100, 0)
    out = ring(job, pipe, 200, 1)
    bisect = of(out, RunCrossRankCheck)
    assert of(out, SdcMismatch) == [] and sorted(tuple(b.ranks or [])[:2] for b in bisect) == [
        (21, 37),
        (53, 5),
    ]
    assert all(
        b.reason.code == ReasonCode.CROSS_RANK_MISMATCH and "neither failed" in b.reason.text for b in bisect
    )
    job.execute(out)
    out = closed_loop(job, pipe, 1)
    assert sorted(f.rank for f in of(out, SdcMismatch)) == [5, 21]
    assert all(f.method == "cross_rank" for f in of(out, SdcMismatch))


def test_noise_only_rings_name_nobody_over_many_checks() -> None:
    job, pipe = started(2048)
    out = []
    for k in range(40):
        out += ring(job, pipe, 100 * (k + 1), k)
    assert of(out, SdcMismatch) == [] and of(out, RunCrossRankCheck) == [] and of(out, QuarantineNode) == []
    assert pipe.state().oldest_cross_watermark(2048) == 4000

    job, pipe = started(64)
    out = []
    for k in range(400):
        out += ring(job, pipe, 100 * (k + 1), k)
    assert of(out, SdcMismatch) == [] and of(out, RunCrossRankCheck) == []


def test_a_dead_ranks_missing_report_blames_nobody_and_the_ring_is_judged_on_what_it_has() -> None:
    job, pipe = started(64, silent={10})
    out = ring(job, pipe, 100, 0)
    assert out == []  # 63 of 64 reports: waiting
    reported = job.t
    out += closed_loop(job, pipe, RING.ring_wait_steps)
    # The steps are over, the seconds are not (1 s steps): other ranks' reports may still
    # be in their shippers' batches. Judged by the events' steps and times, not the clock.
    assert pipe.state().cross_verified == {}
    more, judged_at = until_judged(job, pipe)
    out += more
    assert reported + RING.ring_wait_s <= judged_at < reported + RING.ring_wait_s + 2 * job.step_s
    assert of(out, SdcMismatch) == [] and of(out, RunCrossRankCheck) == []
    state = pipe.state()
    assert state.cross_watermark(10) == -1 and state.cross_watermark(2) == 100  # 2 -> 10 not judged
    assert state.cross_watermark(18) == 100  # 10 -> 18 not judged either; 18 -> 26 passed
    assert state.oldest_cross_watermark(64) == -1  # rank 10 was never covered


def test_a_wrong_gpu_next_to_a_dead_rank_is_bisected_and_the_dead_one_is_not_blamed() -> None:
    job, pipe = started(64, silent={17}, wrong={9: (150, 1e-3)})
    ring(job, pipe, 100, 0)
    until_judged(job, pipe)
    ring(job, pipe, 200, 0)  # offset 8: 9's recomputation of 17's microbatch has nothing to compare with
    out, _ = until_judged(job, pipe)
    (bisect,) = of(out, RunCrossRankCheck)
    assert bisect.ranks is not None and bisect.ranks[:2] == [1, 9] and of(out, SdcMismatch) == []
    out = closed_loop(job, pipe, 1)
    (found,) = of(out, SdcMismatch)
    assert found.rank == 9 and [q.node for q in of(out, QuarantineNode)] == ["node-001"]


def test_a_transient_flip_in_one_recomputation_is_bisected_and_quarantines_nothing() -> None:
    job, pipe = started(64, ring_flips={30: 200})
    ring(job, pipe, 100, 0)
    out = ring(job, pipe, 200, 1)
    (bisect,) = of(out, RunCrossRankCheck)
    assert bisect.ranks is not None and bisect.ranks[:2] == [30, 46]
    assert (bisect.step, bisect.batch_rank) == (200, 46)  # the edge's microbatch: 46's at the ring's step
    job.execute(out)
    out = closed_loop(job, pipe, 1)
    (found,) = of(out, SdcMismatch)
    assert found.rank == -1 and "did not reproduce" in found.reason.text and of(out, QuarantineNode) == []


def test_a_lone_edge_at_the_noise_tail_that_does_not_reproduce_is_refuted_not_rolled_back() -> None:
    """Seen live at 2,048 ranks: one of W edges a little past the tolerance, and the third
    rank agrees with both. That is the noise tail of W comparisons (the self-check is what
    catches transient faults), so no mismatch, no rollback, and the watermark moves on."""
    job, pipe = started(64, ring_flips={30: 200})
    ring(job, pipe, 100, 0)
    tolerance = ring_tolerance(pipe.state(), RING, 64, [])
    assert tolerance is not None
    job.ring_flip = 1.3 * tolerance  # ~1.3 tolerances with the noise: inside unreproduced_margin (2)
    out = ring(job, pipe, 200, 1)
    (bisect,) = of(out, RunCrossRankCheck)
    assert bisect.ranks is not None and bisect.ranks[:2] == [30, 46]
    state = pipe.state()
    assert state.held_steps == [200]  # held below the disagreement while bisecting
    assert state.current is not None
    assert 1 < state.current.bisecting["ring-a0-s200/r46"].excess <= RING.unreproduced_margin
    job.execute(out)
    out = closed_loop(job, pipe, 1)
    assert of(out, SdcMismatch) == [] and of(out, Rollback) == [] and of(out, QuarantineNode) == []
    state = pipe.state()
    assert state.held_steps == [] and state.suspect_since_step is None
    assert state.cross_watermark(30) > 200 and state.cross_watermark(46) > 200  # the bisection vouched


def test_a_held_watermark_moves_on_when_refuted_and_freezes_when_confirmed() -> None:
    state = SdcState()
    state.passed(100)
    state.hold(150)
    state.passed(200)
    assert state.last_passing_check_step == 100  # held below the disagreement at 150
    state.release(150, confirmed=False)
    assert state.last_passing_check_step == 200  # refuted: the pass at 200 counts
    state.hold(250)
    state.passed(300)
    state.release(250, confirmed=True)
    state.passed(400)
    assert (state.last_passing_check_step, state.suspect_since_step) == (200, 250)


def test_the_scheduler_issues_ring_checks_on_the_budgets_cadence() -> None:
    job = SdcJob(world_size=16, ranks_per_node=4, wrong={9: (2500, 1e-3)}).start()
    pipe = Pipeline(policy=SdcPolicy(cross_check_every=1000, cross_check_calibration_every=100))
    out = closed_loop(job, pipe, 3100)
    rings = of(out, RunRingCheck)
    assert [r.step for r in rings] == [
        100,
        200,
        1000,
        2000,
        3000,
    ]  # calibration (16 ranks < 20 gaps), then 1,000
    assert [r.offset for r in rings] == [4, 12, 4, 12, 4]  # another node; never 8 (pairs)
    assert all(r.ranks is None and r.reason.code == ReasonCode.SDC_CHECK_SCHEDULED for r in rings)
    assert of(out, RunCrossRankCheck) == []  # the pair check is no longer scheduled
    (found,) = of(out, SdcMismatch)
    assert (found.rank, found.node, found.method, found.step) == (9, "node-002", "ring", 3001)


# --------------------------------------------------------------------------- rollback and retention


def test_the_rollback_goes_behind_the_last_passing_ring_check_not_a_later_self_check() -> None:
    # The issue's case: the wrong GPU's own self-checks keep passing after its onset; the
    # rollback must not trust them, and its reason names the checkpoints it skips.
    job = SdcJob(world_size=16, ranks_per_node=4, checkpoint_every=50, wrong={9: (1100, 1e-3)}).start()
    pipe = Pipeline(policy=SdcPolicy(self_check_every=100, cross_check_every=1000))
    pipe.core_policy = pipe.core_policy.model_copy(update={"rollback_on_sdc": True})
    out = closed_loop(job, pipe, 2050)
    assert pipe.state().last_passing_check_step >= 1900  # self-checks of the wrong GPU's era passed
    (found,) = of(out, SdcMismatch)
    (rollback,) = of(out, Rollback)
    (interruption,) = of(out, Interruption)
    assert found.rank == 9 and found.step == 2001
    assert rollback.checkpoint_step == 1000 <= 1100  # at or before the onset
    text = rollback.reason.text
    assert "at or before the last passing cross-rank check that covered rank 9 (step 1001)" in text
    assert "a self-check cannot vouch for a deterministic fault" in text
    kept = sorted(pipe.run().rollback.validated)
    newer = [s for s in kept if s > 1001]
    assert newer and newer[-1] == 2000 and min(s for s in kept if s >= 1000) == 1000  # 1000: pinned
    assert f"skipping checkpoint(s) {', '.join(map(str, newer))}: written after step 1001" in text
    assert "may hold corrupt weights" in text
    assert interruption.last_checkpoint_step == 1000 and of(out, Page) == []


def test_a_rollback_that_skips_nothing_says_so() -> None:
    state = RollbackState()
    for step in (10, 20, 30):
        on_validated(state, _validated(step), 100, RetentionPolicy())
    (rollback,) = on_mismatch(state, _found(35, "ring", 3), Bound(30, "the last ring check"))
    assert isinstance(rollback, Rollback) and rollback.checkpoint_step == 30
    assert "no newer checkpoint is skipped" in rollback.reason.text and "0 newer" not in rollback.reason.text


def test_retention_keeps_the_pinned_ancestor_of_a_deterministic_fault() -> None:
    state = RollbackState()
    for step in range(10, 310, 10):
        on_validated(state, _validated(step), 3, RetentionPolicy(), pin=125)
    assert sorted(state.validated) == [10, 120, 280, 290, 300]  # first (a milestone), pinned, 3 recent
    assert retained(state.validated.values(), 3, RetentionPolicy(), pin=None) == {10, 280, 290, 300}


def test_the_engine_pins_the_checkpoint_before_the_oldest_ring_watermark() -> None:
    job = SdcJob(world_size=16, ranks_per_node=4, checkpoint_every=10, silent={3}).start()
    policy = SdcPolicy(self_check_every=0, cross_check_every=100, cross_check_calibration_every=100)
    pipe = Pipeline(policy=policy)
    pipe.core_policy = pipe.core_policy.model_copy(update={"rollback_on_sdc": True})
    closed_loop(job, pipe, 250)
    assert pipe.state().oldest_cross_watermark(16) == -1  # rank 3 never reports: nothing pinned
    job.silent.clear()
    closed_loop(job, pipe, 1200)
    sdc, index = pipe.state(), pipe.run().rollback
    oldest = sdc.oldest_cross_watermark(16)
    assert oldest > 0 and max(s for s in index.validated if s <= oldest) == oldest // 10 * 10


# --------------------------------------------------------------------------- snapshots


def test_snapshots_from_before_the_ring_unpickle_with_empty_watermarks() -> None:
    state = SdcState()
    state.for_attempt(0, -1)
    for name in ("cross_verified", "ring_spread"):
        delattr(state, name)
    assert state.current is not None
    del state.current.rings
    restored = pickle.loads(pickle.dumps(state))
    assert restored.cross_verified == {} and len(restored.ring_spread) == 0
    assert isinstance(restored.current, AttemptSdc) and restored.current.rings == {}
    assert restored.cross_watermark(3) == -1 and math.isnan(restored.ring_spread.quantile(0.5))


def _validated(step: int) -> CheckpointValidated:
    return CheckpointValidated(
        event_id=f"v-{step}",
        run_id="run-r",
        attempt=0,
        rank=-1,
        node="",
        step=step,
        ts=1_800_000_000.0 + 60 * step,
        checkpoint_step=step,
        uri=f"mem://run-r/{step}",
        last_verified_step=step,
    )


def _found(step: int, method: str, rank: int) -> SdcMismatch:
    return SdcMismatch(
        event_id=f"m-{step}",
        run_id="run-r",
        attempt=0,
        rank=rank,
        node="node-000",
        step=step,
        ts=1_800_000_000.0 + 60 * step,
        reason=Reason(code=ReasonCode.CROSS_RANK_MISMATCH, text="test"),
        method=method,
        microbatch_id=f"mb-{step}",
    )
