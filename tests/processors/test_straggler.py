"""The straggler detector on the pure core (seed §7 "Failure 2"): realistic synchronous
streams with jitter, faults declared, no broker, no clock."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from harness.straggler_streams import Harness, Slow, SyncJob, of_kind
from trainguard.processors.core.detectors.straggler import observe_step
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy, StragglerState
from trainguard.processors.core.state import RunState
from trainguard.schemas import (
    Derived,
    Envelope,
    RanksMissing,
    ReasonCode,
    RunStarted,
    StepTiming,
    StragglerCleared,
    StragglerFlagged,
)

ONSET = 150


def flags(outputs: list[Derived]) -> list[StragglerFlagged]:
    return of_kind(outputs, StragglerFlagged)


def straggler_view(outputs: list[Derived]) -> list[tuple[object, ...]]:
    """What a straggler decision is, without the ts/caused_by of the event that happened
    to complete the step (those follow delivery order)."""
    return [
        (
            o.KIND,
            o.event_id,
            o.rank,
            o.node,
            o.step,
            getattr(o, "onset_step", None),
            getattr(o, "robust_z", None),
            getattr(o, "slowdown", None),
            getattr(o, "ranks", None),
        )
        for o in outputs
    ]


@pytest.mark.parametrize(("factor", "seed"), [(1.18, 1), (1.21, 2), (1.25, 3)])
def test_thermal_straggler_is_flagged_within_110_steps_naming_node_rank_and_slowdown(
    factor: float, seed: int
) -> None:
    job = SyncJob(seed=seed, slow=[Slow(rank=21, factor=factor, from_step=ONSET)]).start()
    job.steps(ONSET + 130)
    harness = Harness()
    outputs = harness.feed(job.events)

    (flag,) = flags(outputs)
    latency = flag.step - ONSET + 1
    assert latency <= 110, f"flagged {latency} steps after onset"
    assert flag.onset_step == ONSET
    assert (flag.rank, flag.node) == (21, job.node(21)) == (21, "node-002")
    assert flag.slowdown == pytest.approx(factor, abs=0.02)
    assert flag.robust_z > harness.straggler_policy.sigma
    assert flag.consecutive_steps == harness.straggler_policy.consecutive_steps
    assert flag.reason.code == ReasonCode.STRAGGLER
    assert "rank 21 on node-002" in flag.reason.text
    assert flag.attempt == 0 and flag.run_id == job.run_id
    # The flag's cause is the straggler's own report of the step that completed the streak.
    (cause,) = flag.caused_by
    report = next(e for e in job.events if e.event_id == cause)
    assert isinstance(report, StepTiming) and (report.rank, report.step) == (21, flag.step)


def test_one_noisy_step_does_not_restart_a_slow_streak() -> None:
    # An 18% straggler at 3% jitter dips under 3 sigma on ~1% of steps. The literal rule
    # (max_gap_steps=0) restarts its 100-step count at every dip: flagged late, or never.
    job = SyncJob(seed=101, slow=[Slow(rank=21, factor=1.18, from_step=50)]).start().steps(300)
    literal = flags(Harness(straggler_policy=StragglerPolicy(max_gap_steps=0)).feed(job.events))
    assert [(f.onset_step, f.step) for f in literal] == [(109, 208)]  # 159 steps after onset
    (flag,) = flags(Harness().feed(job.events))
    assert (flag.onset_step, flag.step) == (50, 151) and flag.consecutive_steps == 100


def test_post_collective_slowness_never_flags() -> None:
    # Rank 9 spends 0.6 s after the all-reduce (a slow optimizer step, a logging stall):
    # its total_s is the worst of the job by far, its compute_s is normal.
    job = SyncJob(seed=4, post_collective_s={9: 0.6}).start().steps(400)
    timings = [e for e in job.events if isinstance(e, StepTiming)]
    for step in range(400):
        reports = timings[step * 64 : (step + 1) * 64]
        worst = max(reports, key=lambda e: e.total_s)
        assert worst.rank == 9 and worst.total_s > 1.2 * min(e.total_s for e in reports)

    assert Harness().feed(job.events) == []


def test_a_compute_straggler_is_invisible_after_the_collective_and_visible_before_it() -> None:
    job = SyncJob(seed=5, slow=[Slow(rank=40, factor=1.3)]).start().steps(120)
    step_100 = [e for e in job.events if isinstance(e, StepTiming) and e.step == 100]
    assert len({e.total_s for e in step_100}) == 1  # everyone waited for rank 40
    assert max(step_100, key=lambda e: e.compute_s).rank == 40
    (flag,) = flags(Harness().feed(job.events))
    assert flag.rank == 40


def test_uniformly_slow_job_flags_nobody() -> None:
    job = SyncJob(seed=6).start().steps(100)
    job.uniform = 2.0  # everyone twice as slow: a bigger batch, a slower kernel, a hot datacenter
    job.steps(300)
    assert Harness().feed(job.events) == []


def test_recovered_straggler_is_cleared() -> None:
    job = SyncJob(seed=7, slow=[Slow(rank=21, factor=1.2, from_step=50, to_step=250)]).start()
    job.steps(320)
    harness = Harness()
    outputs = harness.feed(job.events)
    (flag,) = flags(outputs)
    (cleared,) = of_kind(outputs, StragglerCleared)
    clear_steps = harness.straggler_policy.clear_steps
    assert (cleared.rank, cleared.node) == (21, "node-002")
    assert 250 + clear_steps - 1 <= cleared.step <= 250 + clear_steps + 2
    assert cleared.flagged_steps == cleared.step - flag.step
    assert cleared.reason.code == ReasonCode.STRAGGLER_RECOVERED
    assert cleared.caused_by[0] == flag.event_id
    assert harness.straggler.flagged == {}


def test_a_straggler_that_comes_back_is_flagged_again_with_a_new_onset() -> None:
    slow = [Slow(21, 1.2, from_step=0, to_step=150), Slow(21, 1.2, from_step=200)]
    job = SyncJob(seed=8, slow=slow).start().steps(320)
    outputs = Harness().feed(job.events)
    assert [o.KIND for o in outputs if not o.KIND.endswith("diagnosed")] == [
        "straggler_flagged",
        "straggler_cleared",
        "straggler_flagged",
    ]
    first, second = flags(outputs)
    assert (first.onset_step, second.onset_step) == (0, 200)
    assert first.event_id != second.event_id


def test_heavy_tailed_jitter_and_gc_pauses_raise_nothing_over_2000_steps() -> None:
    job = SyncJob(seed=9, heavy_tail=True, gc_pause_p=0.002).start().steps(2000)
    timings = [e for e in job.events if isinstance(e, StepTiming)]
    pauses = sum(e.compute_s > 2.5 * job.compute_fraction * job.step_s for e in timings)
    assert pauses > 150  # the stream really is noisy: ~0.2% of 128,000 reports are 3x pauses
    harness = Harness()
    assert harness.feed(job.events) == []
    assert harness.straggler.evaluated == 2000 and harness.straggler.pending == {}


def test_missing_ranks_are_reported_once_and_not_again() -> None:
    job = SyncJob(seed=10, slow=[Slow(rank=21, factor=1.2, from_step=100)]).start()
    job.steps(100).steps(200, exclude={13})  # rank 13's telemetry stops at step 100
    harness = Harness()
    outputs = harness.feed(job.events)

    (missing,) = of_kind(outputs, RanksMissing)
    after = harness.straggler_policy.missing_after_steps
    assert missing.ranks == [13] and missing.step == 100 + after - 1
    assert missing.reason.code == ReasonCode.MISSING_RANKS
    assert "rank 13 on node-001" in missing.reason.text
    assert (missing.rank, missing.node) == (-1, "")
    # Evaluation does not wait for a rank known to be missing: the straggler is still on time.
    (flag,) = flags(outputs)
    assert flag.rank == 21 and flag.step - 100 + 1 <= 110
    assert harness.straggler.evaluated == 300 and harness.straggler.pending == {}

    # Back, then gone again: that is a change, reported again (with a new id).
    fed = len(job.events)
    job.steps(20).steps(20, exclude={13})
    more = of_kind(harness.feed(job.events[fed:]), RanksMissing)
    assert [m.ranks for m in more] == [[13]] and more[0].event_id != missing.event_id


def test_one_lost_report_is_not_a_missing_rank() -> None:
    job = SyncJob(seed=11).start().steps(50).steps(1, exclude={13}).steps(50)
    harness = Harness()
    assert harness.feed(job.events) == []
    assert harness.straggler.evaluated == 101


def test_duplicated_and_reordered_events_do_not_double_count() -> None:
    job = SyncJob(seed=12, slow=[Slow(rank=33, factor=1.22, from_step=40)]).start().steps(260)
    clean = Harness().feed(job.events)
    assert len(flags(clean)) == 1

    rng = random.Random(0)
    # Per-node batches interleave: reorder within windows of three steps' worth of reports;
    # 5% of reports are delivered twice (at-least-once), and another 5% are reported again
    # later under a new id with a different number (an agent restarted and re-sent its queue).
    window = 3 * job.world_size
    reordered: list[Envelope] = job.events[:1]
    assert isinstance(reordered[0], RunStarted)
    redelivered = re_reported = 0
    for start in range(1, len(job.events), window):
        chunk = job.events[start : start + window]
        again: list[Envelope] = []
        for event in list(chunk):
            assert isinstance(event, StepTiming)
            roll = rng.random()
            if roll < 0.05:
                chunk.append(event)
                redelivered += 1
            elif roll < 0.10:
                update = {"event_id": event.event_id + "-again", "compute_s": 9.9, "ts": event.ts + 30.0}
                again.append(event.model_copy(update=update))
                re_reported += 1
        rng.shuffle(chunk)
        reordered += chunk + again

    harness = Harness()
    noisy = harness.feed(reordered)
    assert straggler_view(noisy) == straggler_view(clean)
    state = harness.straggler
    assert state.evaluated == 260
    assert state.duplicates + state.late == redelivered + re_reported


def test_an_earlier_report_delivered_after_its_repeat_still_wins() -> None:
    job = SyncJob(world_size=8, ranks_per_node=4, seed=17).start().steps(1)
    first = next(e for e in job.events if isinstance(e, StepTiming) and e.rank == 3)
    repeat = first.model_copy(update={"event_id": "re-sent", "ts": first.ts + 30.0, "compute_s": 50.0})
    others = [e for e in job.events if isinstance(e, StepTiming) and e.rank != 3]
    harness = Harness(straggler_policy=StragglerPolicy(consecutive_steps=1, clear_steps=1, max_gap_steps=0))
    outputs = harness.feed([job.events[0], repeat, *others[:3], first, *others[3:]])
    assert outputs == [] and harness.straggler.duplicates == 1  # 50 s never counted


def test_a_new_attempt_resets_streaks_and_the_old_attempt_is_ignored() -> None:
    job = SyncJob(seed=13, slow=[Slow(rank=21, factor=1.2)]).start().steps(80)
    stale = [e for e in job.events if isinstance(e, StepTiming) and e.step >= 70]
    job.restart(resumed_from_step=60).steps(130)  # the same slow GPU, a fresh attempt
    harness = Harness()
    outputs = harness.feed([*job.events, *stale])  # old-attempt reports arriving late
    (flag,) = flags(outputs)
    assert flag.attempt == 1 and flag.onset_step == 61  # not 80 steps of attempt 0 + 20
    assert flag.step - flag.onset_step + 1 <= 110


def test_too_few_ranks_compute_no_statistics() -> None:
    job = SyncJob(world_size=3, ranks_per_node=1, slow=[Slow(rank=1, factor=2.0)]).start().steps(200)
    harness = Harness()
    assert harness.feed(job.events) == []
    assert harness.straggler.evaluated == 200


def test_mad_floor_keeps_a_near_perfect_job_from_flagging_noise() -> None:
    # 0.1% jitter: without a floor a 2% difference would be a 13-sigma outlier.
    job = SyncJob(seed=14, jitter=0.001, slow=[Slow(5, 1.02), Slow(50, 1.10)]).start().steps(150)
    (flag,) = flags(Harness().feed(job.events))
    assert flag.rank == 50 and flag.slowdown == pytest.approx(1.10, abs=0.005)


def test_unknown_world_size_evaluates_steps_by_age() -> None:
    job = SyncJob(seed=15, slow=[Slow(rank=7, factor=1.2, from_step=20)]).start().steps(150)
    events = [e for e in job.events if not isinstance(e, RunStarted)]  # the launcher's record is lost
    harness = Harness()
    (flag,) = flags(harness.feed(events))
    assert flag.rank == 7 and flag.step - 20 + 1 <= 100 + harness.straggler_policy.max_pending_steps


def test_a_16384_rank_step_is_evaluated_and_its_straggler_found() -> None:
    # Scale, not speed (bench/bench_straggler.py measures the cost).
    policy = StragglerPolicy(consecutive_steps=5, clear_steps=3)
    job = SyncJob(world_size=16_384, ranks_per_node=8, seed=16, slow=[Slow(rank=12_345, factor=1.2)])
    job.start().steps(8)
    harness = Harness(straggler_policy=policy)
    outputs = harness.feed(job.events)
    (flag,) = flags(outputs)
    assert (flag.rank, flag.node, flag.step) == (12_345, job.node(12_345), 4)
    assert not of_kind(outputs, RanksMissing)
    assert harness.straggler.evaluated == 8


def test_observe_step_is_usable_without_the_harness() -> None:
    run = RunState("r", world_size=4)
    state = StragglerState()
    policy = StragglerPolicy(consecutive_steps=1, clear_steps=1, max_gap_steps=0)
    out: list[Derived] = []
    for rank, compute in enumerate([1.0, 1.01, 0.99, 1.6]):
        event = StepTiming(
            event_id=f"e{rank}", run_id="r", attempt=0, rank=rank, node=f"n{rank}", step=0,
            ts=10.0 + rank, compute_s=compute, total_s=2.0,
        )  # fmt: skip
        out += observe_step(state, run, event, policy)
    (flag,) = out
    assert isinstance(flag, StragglerFlagged) and flag.rank == 3 and flag.node == "n3"
    assert flag.ts == 13.0  # the ts of the report that completed the step
    assert flag.slowdown == pytest.approx(1.6 / 1.005)


def test_policy_rejects_a_gap_that_outlives_the_clear() -> None:
    with pytest.raises(ValidationError, match="max_gap_steps"):
        StragglerPolicy(max_gap_steps=10, clear_steps=10)
    with pytest.raises(ValidationError):
        StragglerPolicy(sigma=0)
