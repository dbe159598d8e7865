"""The hang's stack-collection window (processors/core/detectors/stack_window.py): it opens only once
the abort can have reached the ranks, and closes as soon as the odd stack out is certain."""

from __future__ import annotations

from harness.streams import Job
from trainguard.processors.core import CorePolicy, CoreState, HangPolicy, run_all, step
from trainguard.processors.core.detectors.stack_window import odd_one_certain
from trainguard.schemas import Abort, Interruption, InterruptionCause, ReasonCode, Tick

POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))
COLLECTIVE = "collective:allreduce"
CULPRIT, CULPRIT_STACK = 37, "collective:allreduce>ncclProxyProgress>ibv_poll_cq"


def hung(world_size: int = 64) -> tuple[Job, CoreState]:
    """A job that hung after 40 steps; the core has decided the hang and sent its abort."""
    job = Job(world_size=world_size, ranks_per_node=8).start().steps(40).stall(5.0)
    state, outputs = run_all(job.events, POLICY)
    assert any(isinstance(o, Abort) and o.stack_dump for o in outputs)
    return job, state


def feed(job: Job, state: CoreState, start: int) -> list[tuple[int, Interruption]]:
    """Step the events from `start` one by one: (index, interruption) for each one declared."""
    found = []
    for i, event in enumerate(job.events[start:], start):
        state, outputs = step(state, event, POLICY)
        found += [(i, o) for o in outputs if isinstance(o, Interruption)]
    return found


def answer(job: Job, rank: int) -> None:
    stack = CULPRIT_STACK if rank == CULPRIT else COLLECTIVE
    job.exit(rank, signal=15, requested=True, stack_signature=stack, stack_dump_ref=f"dump/{rank}")


def test_heartbeats_queued_behind_the_detection_do_not_close_the_window() -> None:
    # A processor 30 s behind decides the hang late: the heartbeats sent before its abort
    # existed (every rank is alive in the collective) come next, 30 s of them, and only
    # then the dumps. Counted from the detection, the window closed on those heartbeats
    # and no rank had answered ("64 rank(s) did not answer").
    job, state = hung()
    start = len(job.events)
    job.stall(3 * POLICY.hang.stack_collect_s)
    assert feed(job, state, start) == []  # still waiting for the dumps
    start = len(job.events)
    job.t += 0.5
    for rank in range(job.world_size):
        answer(job, rank)
    ((_, interruption),) = feed(job, state, start)
    assert interruption.cause == InterruptionCause.HANG and interruption.rank == CULPRIT
    assert interruption.reason.code == ReasonCode.ODD_STACK


def test_the_window_closes_once_no_missing_answer_could_change_the_odd_stack() -> None:
    # 64 ranks: a minority is at most 6 ranks (10%). With the culprit's stack among the
    # answers, it stays the odd one out once at most 5 ranks are missing (1 + 5 <= 6):
    # the 59th answer concludes, not the 58th, and no later answer is waited for.
    job, state = hung(64)
    start = len(job.events)
    job.t += 0.5
    for rank in [CULPRIT, *(r for r in range(job.world_size) if r != CULPRIT)]:
        answer(job, rank)
    ((index, interruption),) = feed(job, state, start)
    assert index - start + 1 == 59
    assert interruption.rank == CULPRIT and interruption.reason.code == ReasonCode.ODD_STACK
    assert str(job.world_size - 1 - 5) in interruption.reason.text  # "... while 58 ranks waited"


def test_a_tick_opens_the_window_when_no_rank_answers() -> None:
    # Nobody answers: the window opens at the first tick the live driver wrote after the
    # abort, and closes stack_collect_s later, whatever the queued heartbeats said.
    job, state = hung()
    detected = job.t
    start = len(job.events)
    job.stall(3 * POLICY.hang.stack_collect_s)
    assert feed(job, state, start) == []
    job.events.append(Tick(**job._env(-1)))
    start = len(job.events)
    job.stall(POLICY.hang.stack_collect_s - 1)
    assert feed(job, state, start - 1) == []  # the tick opened it; not over yet
    start = len(job.events)
    job.stall(2.0)
    ((_, interruption),) = feed(job, state, start)
    assert interruption.cause == InterruptionCause.HANG
    assert interruption.ts <= detected  # dated at the detection, whenever it concluded


def test_odd_one_certain_needs_a_majority_of_the_whole_run_and_a_minority_that_stays_one() -> None:
    alike = {r: COLLECTIVE for r in range(60)}
    assert odd_one_certain({**alike, 60: CULPRIT_STACK}, 64)  # 1 + 3 missing <= 6
    assert not odd_one_certain({**alike, 60: CULPRIT_STACK}, 70)  # 1 + 9 missing > 7
    assert not odd_one_certain(alike, 64)  # no odd stack among the answers yet
    few = {r: COLLECTIVE for r in range(30)}
    assert not odd_one_certain({**few, 30: CULPRIT_STACK}, 64)  # 30 of 64 is no majority yet
    assert not odd_one_certain({**alike, 60: CULPRIT_STACK, 61: "x", 62: "y", 63: "z"}, 64)  # all answered


def test_a_tick_stamped_by_a_slower_clock_opens_the_window_at_the_runs_clock() -> None:
    # A simulated run played at 10x real time: the live driver stamps its ticks with the
    # wall clock, far behind the run's own. The window opens at the newest event time the
    # run has seen when the tick comes, so the dumps still get stack_collect_s.
    job, state = hung()
    start = len(job.events)
    job.stall(3 * POLICY.hang.stack_collect_s)
    job.events.append(Tick(**{**job._env(-1), "ts": job.t - 1000.0}))
    job.stall(POLICY.hang.stack_collect_s - 1)
    assert feed(job, state, start) == []
    start = len(job.events)
    job.stall(2.0)
    ((_, interruption),) = feed(job, state, start)
    assert interruption.cause == InterruptionCause.HANG
