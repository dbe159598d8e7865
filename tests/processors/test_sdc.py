"""The SDC detector on the pure core (seed §7 failure 3, R3, R6): no broker, no clock.

Streams come from :mod:`.sdc_streams`: a synchronous job with a decaying, noisy loss and
grad norm, answering the check commands the core sends it (closed loop)."""

from __future__ import annotations

import math
import statistics

import pytest
from pydantic import ValidationError

from trainguard.processors.core import RunPhase
from trainguard.processors.core.detectors.sdc import SELF_CHECK_SCHEDULED, SdcPolicy
from trainguard.processors.core.detectors.sdc_checks import bisect_three, cross_pair, third_rank
from trainguard.schemas import (
    Abort,
    CrossRankCheck,
    GradSpike,
    Interruption,
    InterruptionCause,
    QuarantineNode,
    ReasonCode,
    RunCrossRankCheck,
    RunNodeSelfTest,
    RunSelfCheck,
    SdcMismatch,
    SdcSelfCheck,
    SkipUpdate,
    StepStats,
)

from .sdc_streams import Pipeline, SdcJob, closed_loop

ALARMS = (Interruption, Abort, GradSpike, SkipUpdate, SdcMismatch, QuarantineNode, RunNodeSelfTest)


def of(outputs: list, kind: type) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def self_check(job: SdcJob, rank: int, step: int, ok: bool, event_id: str | None = None) -> SdcSelfCheck:
    job.step = step
    env = job._env(rank)
    if event_id is not None:
        env["event_id"] = event_id
    return SdcSelfCheck(
        **env,
        microbatch_id=f"mb-{step}-r{rank}",
        digest_first="ab" * 8,
        digest_second="ab" * 8 if ok else "ab" * 7 + "aa",
    )


# --------------------------------------------------------------------------- policy


def test_policy_defaults_are_the_seeds_numbers_and_frozen() -> None:
    policy = SdcPolicy()
    assert policy.self_check_every == 100  # R6 change 3
    assert policy.grad_spike_multiplier == 10.0  # §7a
    assert policy.cross_check_interval() == 10_000 and policy.cross_check_sigma == 5.0  # R3
    with pytest.raises(ValidationError):
        SdcPolicy(grad_spike_multiplier=0.5)
    with pytest.raises(ValidationError):
        setattr(policy, "self_check_every", 5)  # noqa: B010 (frozen)


# --------------------------------------------------------------------------- non-finite


def test_nan_burst_across_64_ranks_is_one_interruption_and_one_abort_per_attempt() -> None:
    burst = {s: set(range(64)) for s in (125, 126, 127)}  # every rank, three steps running
    job = SdcJob(world_size=64, ranks_per_node=8, nan_steps=burst).start()
    pipe = Pipeline()
    out = closed_loop(job, pipe, 131)
    assert [type(o) for o in out if isinstance(o, ALARMS)] == [Interruption, Abort]
    interruption, abort = of(out, Interruption)[0], of(out, Abort)[0]
    assert interruption.cause == InterruptionCause.NON_FINITE and interruption.detected_by == "sdc"
    assert interruption.reason.code == ReasonCode.NON_FINITE_LOSS
    assert interruption.rank == 0 and interruption.node == "node-000" and interruption.step == 125
    assert interruption.last_checkpoint_step == 120 and interruption.lost_steps == 5
    assert abort.stack_dump and abort.ranks is None and abort.caused_by == [interruption.event_id]
    assert pipe.run().phase == RunPhase.INTERRUPTED
    assert pipe.state().non_finite_reports == 3 * 64
    assert of(out, GradSpike) == []  # a NaN grad norm is the non-finite path, not a spike

    # The data fault comes back at the same step after the restart: once more, for attempt 1.
    job.restart(resumed_from_step=120)
    again = closed_loop(job, pipe, 10)
    (second,) = of(again, Interruption)
    assert second.attempt == 1 and second.step == 125 and len(of(again, Abort)) == 1
    assert second.event_id != interruption.event_id


def test_unmeasured_grad_norm_is_neither_a_spike_nor_non_finite() -> None:
    job = SdcJob(world_size=4, ranks_per_node=2).start()
    pipe = Pipeline()
    closed_loop(job, pipe, 60)
    job.step += 1
    out = pipe.feed([StepStats(**job._env(0), loss=3.1, grad_norm=None, finite=True)])
    assert out == [] and pipe.state().non_finite_reports == 0


# --------------------------------------------------------------------------- grad spikes


def test_grad_spike_skips_the_update_and_counts() -> None:
    job = SdcJob(world_size=16, grad_spikes={400: 50.0, 3000: 50.0}).start()
    pipe = Pipeline()
    out = closed_loop(job, pipe, 3100)
    spikes, skips = of(out, GradSpike), of(out, SkipUpdate)
    assert [s.step for s in spikes] == [400, 3000] and [s.anomalies for s in spikes] == [1, 2]
    assert [s.step for s in skips] == [400, 3000]
    for spike, skip in zip(spikes, skips, strict=True):
        assert spike.reason.code == ReasonCode.GRAD_SPIKE and spike.rank == -1
        assert skip.ranks is None and skip.caused_by == [spike.event_id]
        # threshold = 10 x p99 of the (up to) 1000 earlier steps, spikes excluded
        earlier = [g for s, g in enumerate(job.grad_norms[: spike.step]) if s not in job.grad_spikes][-1000:]
        ordered = sorted(earlier)
        p99 = ordered[math.ceil(0.99 * len(ordered)) - 1]
        assert spike.threshold == pytest.approx(10 * p99)
        assert (
            spike.grad_norm == pytest.approx(job.grad_norms[spike.step]) and spike.grad_norm > spike.threshold
        )
    assert pipe.state().grad_spikes == 2
    assert max(pipe.state().grad_norms.values()) < spikes[1].grad_norm  # never inflates its own bar


def test_no_spike_is_judged_before_min_samples() -> None:
    job = SdcJob(world_size=4, ranks_per_node=2, grad_spikes={20: 100.0}).start()
    out = closed_loop(job, Pipeline(), 60)
    assert of(out, GradSpike) == []


def test_normal_noisy_run_over_5000_steps_raises_nothing() -> None:
    job = SdcJob(world_size=8, ranks_per_node=4, planned_steps=5000).start()
    pipe = Pipeline()
    out = closed_loop(job, pipe, 5000)
    assert [o for o in out if isinstance(o, ALARMS)] == []
    norms = sorted(job.grad_norms)
    assert norms[-1] / norms[len(norms) // 2] > 3  # the noise is heavy-tailed, not tame
    state = pipe.state()
    assert len(state.grad_norms) == SdcPolicy().grad_norm_window  # the p99 path ran all along
    assert len(of(out, RunSelfCheck)) == 49  # steps 100 .. 4900
    assert state.last_passing_check_step == 4901  # the last check ran at the step after 4900


# --------------------------------------------------------------------------- self-check


def test_self_check_schedule_rotates_over_all_ranks_once_per_world_size_checks() -> None:
    job = SdcJob(world_size=16, ranks_per_node=4).start()
    pipe = Pipeline()
    out = closed_loop(job, pipe, 3300)  # steps 0 .. 3299
    checks = of(out, RunSelfCheck)
    assert [c.step for c in checks] == list(range(100, 3201, 100))  # exactly one per interval
    assert [c.ranks for c in checks] == [[k % 16] for k in range(32)]
    for block in (checks[:16], checks[16:]):
        assert sorted(c.ranks[0] for c in block) == list(range(16))  # every rank, once each
    assert all(c.reason.code == SELF_CHECK_SCHEDULED and c.attempt == 0 for c in checks)
    assert len({c.command_id for c in checks}) == 32

    # A restart from step 3200 does not re-issue that interval; the rotation carries on.
    job.restart(resumed_from_step=3200)
    more = of(closed_loop(job, pipe, 250), RunSelfCheck)
    assert [(c.step, c.ranks, c.attempt) for c in more] == [(3300, [0], 1), (3400, [1], 1)]


def test_transient_bit_flip_names_the_node_and_quarantines_within_the_check_interval() -> None:
    onset = 1250
    job = SdcJob(world_size=16, ranks_per_node=4, flaky={5: onset}).start()
    pipe = Pipeline()
    out = closed_loop(job, pipe, 2400)
    (found,) = of(out, SdcMismatch)
    assert found.method == "self_check" and found.reason.code == ReasonCode.SELF_CHECK_MISMATCH
    assert found.rank == 5 and found.node == "node-001" and "node-001" in found.reason.text
    assert onset < found.step <= onset + 16 * 100  # every rank is checked once per 16 x 100 steps
    quarantine = out[out.index(found) + 1]  # acted on at once, on the same event
    assert isinstance(quarantine, QuarantineNode) and quarantine.node == "node-001"
    assert quarantine.caused_by == [found.event_id] and quarantine.reason == found.reason
    selftest = out[out.index(found) + 2]  # and the node proves itself before it returns (§SDC c)
    assert isinstance(selftest, RunNodeSelfTest) and selftest.node == "node-001"
    assert selftest.ranks == [4, 5, 6, 7] and selftest.tests == ["gemm", "collective"]
    assert selftest.caused_by == [found.event_id] and selftest.reason.code == ReasonCode.NODE_SELF_TEST
    assert [c.node for c in of(out, RunNodeSelfTest)] == ["node-001"]  # not the good ranks' nodes
    state = pipe.state()
    assert state.suspect_since_step == found.step == 2201
    assert state.last_passing_check_step == 2101  # the check before; 2301 passed but is after the fault


def test_watermark_advances_on_passes_only_and_a_rollback_clears_suspicion() -> None:
    job = SdcJob(world_size=4, ranks_per_node=2).start()
    pipe = Pipeline()
    closed_loop(job, pipe, 1)
    state = pipe.state()
    pipe.feed([self_check(job, 0, 100, ok=True), self_check(job, 1, 200, ok=True)])
    assert state.last_passing_check_step == 200
    out = pipe.feed([self_check(job, 2, 300, ok=False)])
    assert [type(o) for o in out] == [SdcMismatch, QuarantineNode, RunNodeSelfTest]
    assert state.last_passing_check_step == 200 and state.suspect_since_step == 300
    pipe.feed([self_check(job, 3, 400, ok=True)])
    assert state.last_passing_check_step == 200  # corruption is in the weights: 400 verifies nothing
    late = pipe.feed([self_check(job, 3, 150, ok=False)])  # reordered: an older failure arrives late
    assert of(late, SdcMismatch) and of(late, QuarantineNode) == []  # node-001 already quarantined
    assert of(late, RunNodeSelfTest) == []  # ... and tested: once per node and attempt
    assert state.last_passing_check_step == 100 and state.suspect_since_step == 150

    job.restart(resumed_from_step=100)  # rollback to the clean ancestor
    closed_loop(job, pipe, 5)
    assert state.suspect_since_step is None and state.last_passing_check_step == 100
    pipe.feed([self_check(job, 0, 200, ok=True)])
    assert state.last_passing_check_step == 200


def test_resent_self_check_is_judged_once() -> None:
    job = SdcJob(world_size=4, ranks_per_node=2).start()
    pipe = Pipeline()
    closed_loop(job, pipe, 1)
    bad = self_check(job, 2, 300, ok=False)
    resent = self_check(job, 2, 300, ok=False, event_id="resent-by-agent")
    out = pipe.feed([bad, bad, resent])
    assert [type(o) for o in out] == [SdcMismatch, QuarantineNode, RunNodeSelfTest]
    assert pipe.state().mismatches == 1


def test_node_self_test_is_commanded_once_per_node_and_attempt() -> None:
    job = SdcJob(world_size=8, ranks_per_node=4).start()
    pipe = Pipeline()
    closed_loop(job, pipe, 1)
    first = pipe.feed([self_check(job, 5, 300, ok=False), self_check(job, 6, 310, ok=False)])
    (test,) = of(first, RunNodeSelfTest)  # two bad ranks of node-001: one test for the node
    assert test.node == "node-001" and test.ranks == [4, 5, 6, 7] and test.attempt == 0
    job.restart(resumed_from_step=100)
    closed_loop(job, pipe, 2)
    again = pipe.feed([self_check(job, 5, 200, ok=False)])
    (retest,) = of(again, RunNodeSelfTest)  # a new attempt: the node is tested again
    assert retest.attempt == 1 and retest.command_id != test.command_id


# --------------------------------------------------------------------------- cross-rank check

CROSS = SdcPolicy(cross_check_every=1000, cross_check_calibration_every=100)


def test_a_wrong_gpu_caught_in_calibration_does_not_inflate_the_tolerance() -> None:
    job = SdcJob(world_size=16, ranks_per_node=4, wrong={9: (0, 1e-3)}).start()
    pipe = Pipeline(policy=CROSS)
    out = closed_loop(job, pipe, 300)
    polluted = [g for g in pipe.state().ring_spread.values() if g > 1e-4]
    assert len(polluted) == 2  # rank 9's two comparisons in the first ring check, unjudged
    found = of(out, SdcMismatch)[0]
    assert found.rank == 9 and found.step == 201 and (found.tolerance or 1) < 1e-6
    # A mean/std estimate of the same samples would have set the bar above the bias itself.
    assert 5 * statistics.pstdev(pipe.state().ring_spread.values()) > 1e-4


def test_a_pair_check_of_an_older_log_is_still_bisected_and_names_the_liar() -> None:
    job = SdcJob(world_size=12, ranks_per_node=4).start()
    pipe = Pipeline(policy=CROSS)
    _calibrated(pipe, job)
    job.step = 700
    pair = CrossRankCheck(**job._env(1), microbatch_id="old", ranks=[1, 9], values=[2.5, 2.5025])
    (bisect,) = pipe.feed([pair])
    assert isinstance(bisect, RunCrossRankCheck) and bisect.ranks == [1, 9, 5]
    assert bisect.reason.code == ReasonCode.CROSS_RANK_MISMATCH  # "one of them is lying"
    three = CrossRankCheck(**job._env(1), microbatch_id="old", ranks=[1, 9, 5], values=[2.5, 2.5025, 2.5])
    found, quarantine, selftest = pipe.feed([three])
    assert isinstance(found, SdcMismatch) and found.method == "cross_rank" and found.rank == 9
    assert isinstance(quarantine, QuarantineNode) and quarantine.node == "node-002"
    assert isinstance(selftest, RunNodeSelfTest) and 9 in (selftest.ranks or [])
    assert "No cross-rank check that covered rank 9 ever passed" in found.reason.text  # its own watermark
    assert pipe.state().cross_watermark(1) == 700 and pipe.state().cross_watermark(9) == -1


def _calibrated(pipe: Pipeline, job: SdcJob, n: int = 20) -> None:
    closed_loop(job, pipe, 1)
    for k in range(n):
        job.step = k
        noise = 1e-7 * ((k * 37) % 11 - 5) / 5
        pipe.feed(
            [CrossRankCheck(**job._env(0), microbatch_id=f"cal-{k}", ranks=[0, 4], values=[2.5, 2.5 + noise])]
        )


def test_cross_rank_outcomes_that_name_nobody_still_say_so() -> None:
    job = SdcJob(world_size=12, ranks_per_node=4).start()
    pipe = Pipeline(policy=CROSS)
    assert of(closed_loop(job, pipe, 1), SdcMismatch) == []
    # Before calibration a large gap is recorded, not judged.
    early = CrossRankCheck(**job._env(0), microbatch_id="early", ranks=[0, 4], values=[2.5, 2.6])
    assert pipe.feed([early]) == []
    _calibrated(pipe, job, 19)
    tolerance = pipe.state().tolerance(CROSS)
    assert tolerance is not None and tolerance < 1e-6

    job.step = 500
    three = CrossRankCheck(**job._env(0), microbatch_id="x", ranks=[0, 4, 8], values=[2.5, 2.5001, 2.5002])
    (found,) = pipe.feed([three])
    assert isinstance(found, SdcMismatch) and found.rank == -1 and "all three disagree" in found.reason.text
    assert all(f"node-00{n}" in found.reason.text for n in range(3))  # the nodes are named in the text

    pair = CrossRankCheck(**job._env(0), microbatch_id="y", ranks=[0, 4], values=[2.5, 2.5001])
    (bisect,) = pipe.feed([pair])
    assert isinstance(bisect, RunCrossRankCheck) and bisect.ranks == [0, 4, 8]
    again = CrossRankCheck(**job._env(0), microbatch_id="y", ranks=[0, 4, 8], values=[2.5, 2.5, 2.5])
    (transient,) = pipe.feed([again])
    assert (
        isinstance(transient, SdcMismatch)
        and transient.rank == -1
        and "did not reproduce" in transient.reason.text
    )
    assert transient.caused_by == [again.event_id, pair.event_id]
    assert pipe.state().suspect_since_step == 500


def test_a_pair_disagreement_at_the_noise_tail_that_does_not_reproduce_is_refuted() -> None:
    job = SdcJob(world_size=12, ranks_per_node=4).start()
    pipe = Pipeline(policy=CROSS)
    closed_loop(job, pipe, 1)
    _calibrated(pipe, job, CROSS.cross_check_min_samples)
    tolerance = pipe.state().tolerance(CROSS)
    assert tolerance is not None
    job.step = 500
    pair = CrossRankCheck(**job._env(0), microbatch_id="y", ranks=[0, 4], values=[2.5, 2.5 + 1.5 * tolerance])
    (bisect,) = pipe.feed([pair])
    assert isinstance(bisect, RunCrossRankCheck) and bisect.ranks == [0, 4, 8]
    again = CrossRankCheck(**job._env(0), microbatch_id="y", ranks=[0, 4, 8], values=[2.5, 2.5, 2.5])
    assert pipe.feed([again]) == []  # 1.5 tolerances, not reproduced: the noise tail, refuted
    assert pipe.state().suspect_since_step is None and pipe.state().held_steps == []


def test_check_rank_choice_and_bisection_verdicts() -> None:
    world, per_node = 64, 8
    pairs = [cross_pair(world, per_node, k) for k in range(64)]
    assert all(p is not None and p[0] // per_node != p[1] // per_node for p in pairs)
    assert {r for p in pairs if p for r in p} == set(range(64))  # the rotation sweeps every rank
    assert cross_pair(1, 1, 0) is None and cross_pair(4, 8, 0) == [0, 1]  # one node: any two ranks
    third = third_rank(world, per_node, [3, 35])
    assert third is not None and third // per_node not in (0, 4)
    assert third_rank(2, 1, [0, 1]) is None and third_rank(8, 4, [0, 4]) in {1, 2, 3, 5, 6, 7}

    assert bisect_three([1.0, 1.0, 1.5], 1e-6).liar == 2
    assert bisect_three([1.0, math.nan, 1.0], 1e-6).liar == 1
    chain = bisect_three([1.0, 1.0 + 8e-7, 1.0 + 1.6e-6], 1e-6)
    assert chain.liar is None and len(chain.agreeing) == 2
    assert bisect_three([1.0, 1.0, 1.0], 1e-6).all_agree


# --------------------------------------------------------------------------- replay properties


def _spike_stream() -> list:
    job = SdcJob(world_size=8, ranks_per_node=4, grad_spikes={300: 80.0, 450: 80.0}).start()
    job.train(500)
    return job.events


def test_duplicates_and_reordering_do_not_double_count() -> None:
    events = _spike_stream()
    base = Pipeline()
    baseline = of(base.feed(events), GradSpike)
    assert [s.step for s in baseline] == [300, 450]

    # Redelivery (every event twice), each step's reports reversed, and a rank re-sending
    # its stats under a new event id: still one decision per step.
    by_step: dict[int, list] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    shuffled = []
    for step in sorted(by_step):
        batch = list(reversed(by_step[step]))
        shuffled += [e for e in batch for _ in (0, 1)]
        resent = [
            e.model_copy(update={"event_id": e.event_id + "-again"})
            for e in batch
            if isinstance(e, StepStats)
        ]
        shuffled += resent[:1]
    pipe = Pipeline()
    spikes = of(pipe.feed(shuffled), GradSpike)
    assert [(s.event_id, s.step, s.anomalies) for s in spikes] == [
        (s.event_id, s.step, s.anomalies) for s in baseline
    ]
    assert [s.threshold for s in spikes] == pytest.approx([s.threshold for s in baseline])
    assert pipe.state().grad_spikes == 2 and len(of(pipe.outputs, SkipUpdate)) == 2


def test_same_events_give_the_same_outputs_and_ids() -> None:
    def once() -> list[dict]:
        job = SdcJob(
            world_size=16, ranks_per_node=4, flaky={3: 200}, wrong={9: (0, 1e-3)}, grad_spikes={700: 60.0}
        )
        out = closed_loop(job.start(), Pipeline(policy=CROSS), 3100)
        return [o.model_dump() for o in out]

    first, second = once(), once()
    assert first == second
    kinds = {d.get("method") for d in first if "method" in d}
    assert kinds == {"self_check", "ring"}
