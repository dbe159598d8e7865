"""The hang and crash detectors on the pure core: no broker, no clock."""

from __future__ import annotations

import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, CoreState, HangPolicy, RunPhase, run_all, step
from trainguard.processors.core.detectors.watchdog import step_timeout_s
from trainguard.processors.core.outputs import Forward, Reject
from trainguard.processors.core.state import IllegalTransition, RunState
from trainguard.schemas import (
    Abort,
    HangDetected,
    Heartbeat,
    Interruption,
    InterruptionCause,
    InterruptionDecided,
    InterruptionRecovered,
    Quarantine,
    QuarantineNode,
    ReasonCode,
    StepTiming,
    Tick,
    decode_batch,
    encode,
    encode_batch,
)
from trainguard.schemas.codec import RejectReason
from trainguard.schemas.sharding import route

POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))


def kinds(outputs: list) -> list[str]:
    return [o.KIND for o in outputs]


def test_healthy_run_with_jitter_raises_nothing() -> None:
    job = Job().start()
    for _ in range(20):
        job.steps(5)
        job.heartbeats()
    _, outputs = run_all(job.events, POLICY)
    assert outputs == []


def test_timeout_is_default_until_enough_samples_then_three_p99() -> None:
    job = Job(step_s=1.0).start().steps(5)
    state, _ = run_all(job.events, POLICY)
    run = state.runs["run-test"]
    assert step_timeout_s(run, POLICY.hang) == POLICY.hang.default_timeout_s
    job.steps(40)
    state, _ = run_all(job.events, POLICY)
    timeout = step_timeout_s(state.runs["run-test"], POLICY.hang)
    assert 3.0 <= timeout <= 3.6  # 3 x p99 of ~1 s steps with 5% jitter


def test_hang_inside_collective_is_detected_and_culprit_named_by_odd_stack() -> None:
    job = Job().start().steps(40)
    job.stall(5.0)  # > 3 x p99 (~3.3 s): everyone alive, nobody progresses
    state, outputs = run_all(job.events, POLICY)
    assert kinds(outputs) == ["hang_detected", "abort"]
    hang, abort = outputs
    assert isinstance(hang, HangDetected) and hang.reason.code == ReasonCode.NO_PROGRESS
    assert hang.last_step == 39 and hang.stalled_s > hang.timeout_s
    assert isinstance(abort, Abort) and abort.stack_dump and abort.ranks is None
    assert abort.caused_by == [hang.event_id]

    job.abort_all(culprit=6)
    state, more = run_all(job.events[len(job.events) - 16 :], POLICY, state)
    # every interruption updates the baseline; the culprit's node leaves the pool
    assert kinds(more) == [
        "interruption",
        "mtbf_update",
        "quarantine",
        "quarantine_node",
        "interruption_decided",
    ]
    interruption = more[0]
    assert isinstance(interruption, Interruption)
    assert interruption.cause == InterruptionCause.HANG
    assert interruption.rank == 6 and interruption.node == "node-001"
    assert interruption.reason.code == ReasonCode.ODD_STACK
    assert interruption.last_checkpoint_step == 30 and interruption.lost_steps == 9
    assert state.runs["run-test"].phase == RunPhase.INTERRUPTED


def test_hang_with_silent_rank_and_no_phases_names_nobody_and_quarantines_nothing() -> None:
    job = Job().start().steps(40).stall(5.0)
    state, _ = run_all(job.events, POLICY)
    n = len(job.events)
    job.t += 0.2
    for r in range(16):
        if r != 11:  # rank 11 is stuck in a kernel and never dumps
            job.exit(r, signal=15, requested=True, stack_signature="collective:allreduce")
    job.stall(11.0, alive=[])  # time passes (ticks would carry it in production)
    job.heartbeats([11])
    state, outputs = run_all(job.events[n:], POLICY, state)
    (interruption,) = [o for o in outputs if isinstance(o, Interruption)]
    # Not answering is no evidence: at 2,048 ranks "the first that did not answer" was rank 0.
    assert interruption.rank == -1 and interruption.node == ""
    assert interruption.reason.code == ReasonCode.CULPRIT_UNKNOWN
    assert "culprit unknown, nothing quarantined" in interruption.reason.text
    assert "1 rank(s) sent none in the window" in interruption.reason.text
    assert not [o for o in outputs if isinstance(o, Quarantine | QuarantineNode)]


def test_hang_without_any_dump_names_the_rank_whose_last_phase_differs() -> None:
    job = Job().start().steps(40).stall(5.0, stuck={11: "data"})  # rank 11 stuck loading its batch
    state, outputs = run_all(job.events, POLICY)
    hang, abort = outputs
    assert isinstance(hang, HangDetected) and isinstance(abort, Abort)
    state, _ = run_all(
        [Tick(**job._env(-1))], POLICY, state
    )  # the first tick after the abort opens the window
    job.t += POLICY.hang.stack_collect_s + 1  # no dump arrives within the window
    state, outputs = run_all([Tick(**job._env(-1))], POLICY, state)
    interruption, _mtbf, quarantine, command, decided = outputs
    assert isinstance(decided, InterruptionDecided)  # last: the launcher goes on
    assert isinstance(interruption, Interruption) and interruption.reason.code == ReasonCode.ODD_PHASE
    assert (interruption.rank, interruption.node) == (11, "node-002")
    text = interruption.reason.text
    assert "rank 11 last reported phase 'data' while 15 ranks reported 'allreduce'" in text
    assert "no stack dump (16 rank(s) sent none in the window)" in interruption.reason.text
    assert isinstance(quarantine, Quarantine) and isinstance(command, QuarantineNode)
    assert quarantine.node == command.node == "node-002"
    # One story: the detection and the abort name no rank (the culprit is not known yet);
    # the interruption names the culprit from the evidence.
    assert hang.rank == -1 and hang.node == "" and abort.ranks is None
    assert "rank" not in hang.reason.text.split(";")[0] and abort.reason == hang.reason
    assert interruption.caused_by == [hang.event_id]


def test_the_odd_stack_beats_the_phases_and_every_record_agrees_on_the_culprit() -> None:
    job = Job().start().steps(40).stall(5.0, stuck={6: "forward"})
    state, (hang, abort) = run_all(job.events, POLICY)
    job.abort_all(culprit=6)
    state, more = run_all(job.events[-16:], POLICY, state)
    interruption, _mtbf, quarantine, command, decided = more
    assert isinstance(decided, InterruptionDecided)
    assert interruption.rank == quarantine.rank == 6 and quarantine.node == command.node == "node-001"
    assert interruption.reason.code == ReasonCode.ODD_STACK
    assert hang.rank == -1 and abort.reason == hang.reason and "rank 6" not in hang.reason.text
    # The rank whose heartbeat showed the stall first is named only as the witness.
    assert hang.reason.text.endswith(
        "(witness: rank 0, whose heartbeat showed the stall first; every rank's does in a hang, "
        "so it says nothing about the cause)"
    )


def sharded(events: list, shard_ranks: int, world_size: int, state: CoreState) -> list:
    """Route each event to its shards as the driver does, and re-publish forwards to shard 0."""
    outputs: list = []
    for event in events:
        for shard in route(event, world_size, shard_ranks):
            _, out = step(state, event, POLICY, shard=shard, shard_ranks=shard_ranks)
            for o in out:
                if isinstance(o, Forward):
                    _, more = step(state, o.event, POLICY, shard=0, shard_ranks=shard_ranks)
                    outputs += more
                else:
                    outputs.append(o)
    return outputs


def test_a_sharded_run_names_the_culprit_from_phases_forwarded_by_its_shard() -> None:
    # Two shards of 8 ranks: the culprit (rank 13) lives on shard 1, whose heartbeats
    # shard 0 never sees; shard 1 forwards its stalled ranks' phases, once each.
    job = Job().start().steps(40).stall(5.0, stuck={13: "data"})
    state = CoreState()
    outputs = sharded(job.events, 8, 16, state)
    assert [o.KIND for o in outputs] == ["hang_detected", "abort"]
    forwarded = [r for r, s in state.runs["run-test"].ranks.items() if s.phase and r >= 8]
    assert sorted(forwarded) == list(range(8, 16))
    sharded([Tick(**job._env(-1))], 8, 16, state)  # opens the window
    job.t += POLICY.hang.stack_collect_s + 1
    outputs = sharded([Tick(**job._env(-1))], 8, 16, state)
    interruption = outputs[0]
    assert isinstance(interruption, Interruption) and interruption.reason.code == ReasonCode.ODD_PHASE
    assert (interruption.rank, interruption.node) == (13, "node-003")


def test_a_progressing_sharded_run_forwards_nothing() -> None:
    job = Job().start()
    for _ in range(10):
        job.steps(4)
        job.heartbeats(phases={r: "forward" for r in range(16)})
    state = CoreState()
    for event in job.events:
        for shard in route(event, 16, 8):
            _, out = step(state, event, POLICY, shard=shard, shard_ranks=8)
            assert not [o for o in out if isinstance(o, Forward)]


@pytest.mark.parametrize(
    "stuck",
    [
        {3: "forward", 12: "data"},  # two ranks out of step
        {r: "forward" for r in range(16) if r != 7},  # the one in the all-reduce is the one waiting
    ],
)
def test_phases_that_single_out_no_rank_name_nobody(stuck: dict[int, str]) -> None:
    job = Job().start().steps(40).stall(5.0, stuck=stuck)
    state, _ = run_all(job.events, POLICY)
    state, _ = run_all([Tick(**job._env(-1))], POLICY, state)  # opens the window
    job.t += POLICY.hang.stack_collect_s + 1
    state, outputs = run_all([Tick(**job._env(-1))], POLICY, state)
    (interruption, _mtbf, decided) = outputs
    assert isinstance(decided, InterruptionDecided)
    assert interruption.rank == -1 and interruption.reason.code == ReasonCode.CULPRIT_UNKNOWN
    assert "no single rank's phase stands out" in interruption.reason.text


def test_a_tick_concludes_stack_collection_when_the_job_falls_silent() -> None:
    job = Job().start().steps(40).stall(5.0)
    state, _ = run_all(job.events, POLICY)
    n = len(job.events)
    for r in range(15):  # rank 15 never answers; then silence
        job.exit(r, signal=15, requested=True, stack_signature="collective:allreduce")
    state, outputs = run_all(job.events[n:], POLICY, state)
    assert outputs == []  # still collecting
    job.t += POLICY.hang.stack_collect_s + 1
    state, outputs = run_all([Tick(**job._env(-1))], POLICY, state)
    interruption, _mtbf, _decided = outputs  # no evidence against rank 15's node: nothing quarantined
    assert isinstance(interruption, Interruption) and interruption.rank == -1
    assert interruption.reason.code == ReasonCode.CULPRIT_UNKNOWN


def test_slow_but_progressing_job_is_not_a_hang() -> None:
    job = Job(step_s=1.0).start().steps(30)
    job.step_s = 2.5  # everyone slows down (e.g. a bigger batch), still progressing
    for _ in range(10):
        job.steps(1)
        job.heartbeats()
    _, outputs = run_all(job.events, POLICY)
    assert outputs == []


def test_crash_is_an_interruption_naming_rank_and_node_and_aborts_survivors() -> None:
    job = Job().start().steps(25)
    job.exit(9, signal=9)
    job.stall(2.0, alive=[r for r in range(16) if r != 9])
    _, outputs = run_all(job.events, POLICY)
    assert kinds(outputs) == [
        "interruption",
        "abort",
        "mtbf_update",
        "quarantine",
        "quarantine_node",
        "interruption_decided",
    ]
    interruption, abort, _mtbf, quarantine, command, decided = outputs
    assert (
        isinstance(decided, InterruptionDecided) and decided.interruption_id == interruption.interruption_id
    )
    assert isinstance(quarantine, Quarantine) and isinstance(command, QuarantineNode)
    assert quarantine.node == command.node == "node-002" and quarantine.run_ids_affected == ["run-test"]
    assert quarantine.caused_by == [interruption.interruption_id] == [interruption.event_id]
    assert command.caused_by == [quarantine.event_id] and quarantine.reason.code == ReasonCode.QUARANTINE
    assert isinstance(interruption, Interruption) and isinstance(abort, Abort)
    assert interruption.cause == InterruptionCause.CRASH and interruption.detected_by == "rank_exit"
    assert (interruption.rank, interruption.node) == (9, "node-002")
    assert interruption.reason.code == ReasonCode.RANK_EXITED and "signal 9" in interruption.reason.text
    assert interruption.last_checkpoint_step == 20 and interruption.lost_steps == 4
    assert not abort.stack_dump


@pytest.mark.parametrize("skew", [{}, {"node-002": 45.0, "node-000": -20.0}], ids=["in-sync", "skewed"])
def test_a_crash_reported_after_the_watchdog_saw_its_stall_is_the_crash(skew: dict[str, float]) -> None:
    """Rank 9 dies; the other ranks stall in the collective and heartbeat, and the crash's
    report comes only after the watchdog called the stall a hang (a loaded launcher or
    broker): the interruption is rank 9's crash, its node quarantined, not a hang naming
    nobody. Whatever the hosts' clocks say."""
    job = Job(skew=skew).start().steps(25)
    died_at = job.t + 0.1
    job.stall(5.0, alive=[r for r in range(16) if r != 9])
    state, outputs = run_all(job.events, POLICY)
    assert kinds(outputs) == ["hang_detected", "abort"]
    n = len(job.events)
    job.exit(9, stamped_at=died_at, signal=9)
    _, outputs = run_all(job.events[n:], POLICY, state)
    assert kinds(outputs) == [
        "interruption",
        "mtbf_update",
        "quarantine",
        "quarantine_node",
        "interruption_decided",
    ]  # no second Abort: the hang's is out
    interruption, command = outputs[0], outputs[3]
    assert isinstance(interruption, Interruption) and interruption.cause == InterruptionCause.CRASH
    assert (interruption.rank, interruption.node) == (9, "node-002")
    assert "signal 9" in interruption.reason.text and "seen as a hang" in interruption.reason.text
    assert isinstance(command, QuarantineNode) and command.node == "node-002"


def test_a_rank_that_dies_after_the_hang_was_seen_is_its_consequence_not_its_cause() -> None:
    """A waiting rank ended by its collective's own timeout once the hang was seen: the hang's
    verdict stands (rank 11's odd stack), the dead rank's node is not quarantined."""
    job = Job().start().steps(25).stall(5.0)
    state, outputs = run_all(job.events, POLICY)
    assert kinds(outputs) == ["hang_detected", "abort"]
    n = len(job.events)
    job.t += 0.5
    job.exit(4, signal=6)
    job.abort_all(culprit=11, ranks=[r for r in range(16) if r != 4])
    _, outputs = run_all(job.events[n:], POLICY, state)
    interruption = next(o for o in outputs if isinstance(o, Interruption))
    assert interruption.cause == InterruptionCause.HANG and interruption.rank == 11
    assert [o.node for o in outputs if isinstance(o, QuarantineNode)] == ["node-002"]


def test_restart_closes_the_interruption_with_restart_seconds_and_ignores_stale_attempt() -> None:
    job = Job().start().steps(25).exit(9, signal=9).abort_all()
    old_attempt_heartbeat = Heartbeat(**job._env(3))
    job.restart(resumed_from_step=20, delay_s=42.0).steps(3)
    events = [*job.events, old_attempt_heartbeat]
    state, outputs = run_all(events, POLICY)
    recovered = [o for o in outputs if isinstance(o, InterruptionRecovered)]
    assert len(recovered) == 1
    interruption = next(o for o in outputs if isinstance(o, Interruption))
    assert recovered[0].interruption_id == interruption.interruption_id
    assert 42.0 < recovered[0].restart_s < 44.0
    run = state.runs["run-test"]
    assert run.attempt == 1 and run.phase == RunPhase.TRAINING and run.stale == 1
    assert run.useful_steps == 25  # steps 0..24; the repeated 21..23 do not count twice


def test_clean_exit_of_every_rank_finishes_the_run() -> None:
    job = Job(world_size=4).start().steps(5)
    for r in range(4):
        job.exit(r, exit_code=0)
    state, outputs = run_all(job.events, POLICY)
    assert outputs == [] and state.runs["run-test"].phase == RunPhase.FINISHED


def test_the_launchers_second_report_of_an_exit_after_the_run_finished_is_ignored() -> None:
    """Each rank reports its own exit, and its launcher reports it again (another event
    id, no stack): the run is finished once, not a second time (that raised, and the
    stream stalled on it)."""
    job = Job(world_size=4).start().steps(5)
    for r in range(4):
        job.exit(r, exit_code=0)
    for r in range(4):
        job.exit(r, exit_code=0, requested=False)
    state, outputs = run_all(job.events, POLICY)
    assert outputs == [] and state.runs["run-test"].phase == RunPhase.FINISHED


def test_duplicates_are_dropped_and_outputs_have_stable_ids() -> None:
    job = Job().start().steps(25).exit(9, signal=9)
    _, first = run_all(job.events, POLICY)
    state, second = run_all(job.events + job.events, POLICY)
    assert [o.model_dump() for o in first] == [o.model_dump() for o in second]
    assert state.runs["run-test"].duplicates == len(job.events)
    # A fresh core re-processing the same log decides the same ids (idempotent consumers).
    _, again = run_all(job.events, POLICY)
    assert [o.model_dump() for o in again] == [o.model_dump() for o in first]


def test_the_dedupe_window_forgets_exactly_its_oldest_ids() -> None:
    """The window keeps the newest `dedupe_window` ids: a redelivery inside it is a
    duplicate, one older than it is folded again (and becomes the newest id)."""
    policy = CorePolicy(dedupe_window=1000)
    job = Job().start().steps(80)
    ids = [e.event_id for e in job.events]
    assert len(ids) > 1100 and len(set(ids)) == len(ids)
    state, _ = run_all(job.events, policy)
    run = state.runs["run-test"]
    assert list(run.seen) == ids[-1000:] and len(run.seen) == 1000
    inside, forgotten = job.events[-7:], job.events[:5]
    for event in inside + forgotten:
        step(state, event, policy)
    assert run.duplicates == len(inside)
    assert list(run.seen) == ids[-995:] + ids[:5]
    assert all(e.event_id in run.seen for e in forgotten) and ids[5] not in run.seen


def test_clock_skew_between_nodes_neither_fakes_nor_hides_a_hang() -> None:
    skewed = Job(skew={"node-001": -120.0, "node-002": +300.0}).start().steps(40)
    skewed.heartbeats()
    _, outputs = run_all(skewed.events, POLICY)
    assert outputs == []  # a node whose clock is 5 min ahead is not "stalled"
    skewed.stall(5.0)
    _, outputs = run_all(skewed.events, POLICY)
    assert kinds(outputs)[:2] == ["hang_detected", "abort"]


def test_reordered_heartbeat_older_than_progress_is_harmless() -> None:
    job = Job().start().steps(40)
    late = Heartbeat(**{**job._env(2), "ts": job.t - 30.0})
    state, outputs = run_all([*job.events, late], POLICY)
    assert outputs == []


def test_lifecycle_rejects_illegal_transitions() -> None:
    run = RunState("r")
    run.move_to(RunPhase.TRAINING)
    run.move_to(RunPhase.INTERRUPTED)
    with pytest.raises(IllegalTransition):
        run.move_to(RunPhase.TRAINING)


def test_step_accepts_unregistered_run_with_world_size_hint() -> None:
    job = Job(world_size=4)
    job.steps(1)
    state, _ = step(CoreState(), job.events[0], POLICY, world_size_hint=4)
    assert state.runs["run-test"].world_size == 4


def test_a_rank_outside_the_world_is_rejected_like_the_decoder_rejects_it() -> None:
    """Records from ranks that do not exist (issue 14): no RankState, no clock, no decision;
    a Reject the driver dead-letters with the decoder's reason and words, and a counter."""
    job = Job(world_size=8, ranks_per_node=4).start().steps(30)
    phantom = next(e for e in job.events if isinstance(e, StepTiming) and e.step == 29)
    phantom = phantom.model_copy(update={"event_id": "phantom-1", "rank": 4100, "compute_s": 9.0, "ts": 2e9})
    state, _ = run_all(job.events, POLICY)
    run = state.runs[job.run_id]
    last_ts = run.last_ts
    _, outputs = step(state, phantom, POLICY)
    (reject,) = outputs
    assert isinstance(reject, Reject) and reject.event is phantom
    assert reject.reason is RejectReason.RANK_OUT_OF_RANGE
    assert reject.detail == f"rank 4100 is outside world size 8 of run {job.run_id}"
    assert 4100 not in run.ranks and run.rejected == 1 and run.last_ts == last_ts
    header = dict(run_id=job.run_id, node=phantom.node, world_size=8, producer_id="p", seq=0)
    (dead,) = decode_batch(encode_batch(header, [encode(phantom)])).rejections  # the live path
    assert (dead.reason, dead.detail) == (reject.reason, reject.detail)


def test_a_rank_outside_the_hinted_world_is_rejected_before_the_run_registers() -> None:
    job = Job(world_size=4).start().steps(1)
    first = next(e for e in job.events if isinstance(e, StepTiming))
    state, outputs = step(CoreState(), first.model_copy(update={"rank": 4}), POLICY, world_size_hint=4)
    assert [type(o) for o in outputs] == [Reject] and state.runs[job.run_id].ranks == {}
