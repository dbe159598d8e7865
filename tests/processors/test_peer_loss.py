"""A crash that every survivor reports (processors/core/detectors/peer_loss.py): a whole host lost
is named from the silence of its ranks, never from the first survivor's exit; a rank's
own crash is still its own; with no host silent, nobody is quarantined."""

from __future__ import annotations

import random

import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, HangPolicy, run_all
from trainguard.processors.core.policy import CrashPolicy
from trainguard.schemas import HangDetected, Interruption, InterruptionCause, QuarantineNode, ReasonCode, Tick

POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0), crash=CrashPolicy(peer_loss_window_s=10.0))


def survivors_die(job: Job, lost: set[str], seed: int = 7, spread_s: float = 1.5) -> Job:
    """Every rank not on a lost host dies of the lost peer (its collective reset), in the
    order their launchers' reports happen to arrive, over `spread_s` seconds."""
    survivors = [r for r in range(job.world_size) if job.node(r) not in lost]
    random.Random(seed).shuffle(survivors)
    for r in survivors:
        job.t += spread_s / len(survivors)
        job.exit(r, exit_code=1, peer_lost=True)
    return job


def tick(job: Job, seconds: float) -> Job:
    job.t += seconds
    job.events.append(Tick(**job._env(-1)))
    return job


def decided(job: Job) -> tuple[list[Interruption], list[QuarantineNode]]:
    _, outputs = run_all(job.events, POLICY)
    return (
        [o for o in outputs if isinstance(o, Interruption)],
        [o for o in outputs if isinstance(o, QuarantineNode)],
    )


def test_a_lost_host_is_named_when_the_next_world_forms_without_it_not_the_first_survivor() -> None:
    job = Job().start().steps(25)
    survivors_die(job, {"node-002"})
    job.replace("node-002")  # the spare host takes its ranks
    job.restart(resumed_from_step=20, delay_s=4.0).steps(3)
    (interruption,), (command,) = decided(job)
    assert interruption.cause == InterruptionCause.CRASH and interruption.detected_by == "peer_loss"
    assert interruption.reason.code == ReasonCode.HOST_LOST and "node-002" in interruption.reason.text
    assert (interruption.rank, interruption.node) == (8, "node-002")
    assert interruption.lost_steps == 4 and interruption.attempt == 0
    assert command.node == "node-002"


def test_without_a_next_world_the_window_names_the_silent_host() -> None:
    job = Job().start().steps(25)
    survivors_die(job, {"node-001"})
    tick(job, 5.0)
    assert decided(job) == ([], [])  # still waiting: the culprit's own exit may come
    tick(job, 6.0)
    (interruption,), (command,) = decided(job)
    assert interruption.node == command.node == "node-001" and interruption.rank == 4


def test_two_hosts_lost_at_once_are_both_quarantined_and_nobody_else() -> None:
    job = Job().start().steps(25)
    survivors_die(job, {"node-001", "node-003"})
    tick(job, 11.0)
    (interruption,), commands = decided(job)
    assert interruption.node == "node-001" and "node-003" in interruption.reason.text
    assert sorted(c.node for c in commands) == ["node-001", "node-003"]


def test_a_ranks_own_crash_among_the_survivors_exits_is_the_culprit() -> None:
    """Rank 5's exception killed the job; the others' exits (some arriving first) say they
    lost a peer. Rank 5 is named at once; node-001 (its host) only is quarantined."""
    job = Job().start().steps(25)
    for r in (0, 12, 9):
        job.exit(r, exit_code=1, peer_lost=True)
    job.exit(5, exit_code=1)
    survivors_die(job, {"node-001"})
    tick(job, 20.0)
    (interruption,), (command,) = decided(job)
    assert interruption.detected_by == "rank_exit" and interruption.rank == 5 and command.node == "node-001"


def test_every_rank_died_of_a_lost_peer_names_nobody() -> None:
    """A network partition: every host reported its ranks' exits, each of a lost peer."""
    job = Job().start().steps(25)
    survivors_die(job, set())
    (interruption,), commands = decided(job)
    assert interruption.rank == -1 and interruption.reason.code == ReasonCode.PEER_LOST
    assert commands == []


def test_a_slow_host_is_not_lost_when_it_is_in_the_next_world() -> None:
    """node-003's launcher is slow to report (its exits never arrive before the restart) and
    node-000 was really lost; the next world names node-003 among its hosts, so it is not
    taken for a lost one."""
    job = Job().start().steps(25)
    survivors_die(job, {"node-000", "node-003"})
    job.replace("node-000")
    job.restart(resumed_from_step=20, delay_s=3.0).steps(2)
    (interruption,), (command,) = decided(job)
    assert interruption.node == command.node == "node-000"


def test_the_decision_is_the_same_on_replay_and_with_duplicates() -> None:
    job = Job().start().steps(25)
    survivors_die(job, {"node-002"})
    tick(job, 11.0)
    _, first = run_all(job.events, POLICY)
    _, again = run_all(job.events + job.events, POLICY)
    assert [o.model_dump() for o in first] == [o.model_dump() for o in again]


def test_a_host_whose_ranks_this_state_never_heard_is_placed_by_the_run_started() -> None:
    """A sharded run's coordinator hears another shard's ranks only through their exits:
    node-003 (ranks 12-15) is known from the attempt's placement alone, and named."""
    job = Job().start().steps(25, exclude={12, 13, 14, 15})
    survivors_die(job, {"node-003"})
    tick(job, 11.0)
    (interruption,), (command,) = decided(job)
    assert (interruption.rank, interruption.node, command.node) == (12, "node-003", "node-003")


@pytest.mark.parametrize("named_by", ["next world", "window"])
def test_a_lost_host_the_watchdog_saw_first_as_a_hang_is_still_named(named_by: str) -> None:
    """node-002 is lost and its ranks stop; on a loaded machine the survivors' collectives
    fail late, so the watchdog declares a hang first and asks for stacks. The survivors then
    die of the lost peer (no dump): the stacks name nobody, node-002 stayed silent, and the
    peer-loss wait names it (the next world forms without it, or its window ends)."""
    lost = "node-002"
    job = Job().start().steps(25)
    job.stall(8.0, alive=[r for r in range(job.world_size) if job.node(r) != lost])
    survivors_die(job, {lost})
    if named_by == "next world":
        job.replace(lost)
        job.restart(resumed_from_step=20, delay_s=4.0).steps(3)
    else:
        tick(tick(job, 1.0), POLICY.hang.stack_collect_s)  # the processor's ticks: the windows end
    _, outputs = run_all(job.events, POLICY)
    assert len([o for o in outputs if isinstance(o, HangDetected)]) == 1
    (interruption,) = [o for o in outputs if isinstance(o, Interruption)]
    (command,) = [o for o in outputs if isinstance(o, QuarantineNode)]
    assert interruption.reason.code == ReasonCode.HOST_LOST and interruption.cause == InterruptionCause.CRASH
    assert interruption.node == command.node == lost


def test_a_hang_whose_stacks_name_the_culprit_stays_a_hang_when_survivors_died_of_the_teardown() -> None:
    """Rank 5 hangs in its forward; tearing the attempt down, ranks 0 and 9 die of the lost
    peer before they dump. Every host reports, the stacks name rank 5: a hang, rank 5's."""
    job = Job().start().steps(25).stall(8.0, stuck={5: "forward"})
    for r in (0, 9):
        job.exit(r, exit_code=1, peer_lost=True)
    job.abort_all(culprit=5)
    (interruption,), (command,) = decided(job)
    assert (interruption.cause, interruption.rank, interruption.reason.code) == (
        InterruptionCause.HANG, 5, ReasonCode.ODD_STACK
    )  # fmt: skip
    assert command.node == job.node(5)


def survivors_aborted(job: Job, lost: str) -> Job:
    """The hang's Abort reached the survivors before their collectives failed: each dumps its
    stack (waiting in the all-reduce) and ends as asked; none says it lost a peer."""
    return job.abort_all(ranks=[r for r in range(job.world_size) if job.node(r) != lost])


@pytest.mark.parametrize("named_by", ["next world, stacks still due", "next world", "window"])
def test_a_lost_host_seen_as_a_hang_is_named_when_the_abort_ended_the_survivors_first(named_by: str) -> None:
    """node-002 is lost; the watchdog's hang Abort ends the survivors before any of them
    reports the lost peer. The stacks name nobody, node-002 never answered: it is named
    (the next world forms without it, even while its stacks are still awaited; or the
    wait's window ends), and it alone is quarantined."""
    lost = "node-002"
    job = Job().start().steps(25)
    job.stall(8.0, alive=[r for r in range(job.world_size) if job.node(r) != lost])
    survivors_aborted(job, lost)
    if named_by == "window":
        tick(tick(job, POLICY.hang.stack_collect_s), POLICY.crash.peer_loss_window_s)
    else:
        if named_by == "next world":
            tick(job, POLICY.hang.stack_collect_s)  # the stack window closes first
        job.replace(lost)
        job.restart(resumed_from_step=20, delay_s=1.0).steps(3)
    (interruption,), commands = decided(job)
    assert (interruption.cause, interruption.reason.code) == (InterruptionCause.CRASH, ReasonCode.HOST_LOST)
    assert interruption.node == lost and "answered the hang's stack dump" in interruption.reason.text
    assert [c.node for c in commands] == [lost]


def test_a_hang_whose_stacks_name_nobody_stays_a_hang_when_the_silent_host_was_only_slow() -> None:
    """Every rank waits in the all-reduce (the stacks name nobody); node-002's launcher has
    not reported its ranks' ends when the next world forms, with node-002 in it: not lost.
    The hang's verdict stands (no rank reported a lost peer) and nobody is quarantined."""
    job = Job().start().steps(25).stall(8.0)
    survivors_aborted(job, "node-002")
    job.restart(resumed_from_step=20, delay_s=2.0).steps(3)
    (interruption,), commands = decided(job)
    assert (interruption.cause, interruption.rank, interruption.detected_by) == (
        InterruptionCause.HANG, -1, "progress_watchdog",
    )  # fmt: skip
    assert commands == []


def test_a_next_attempt_that_starts_while_a_hangs_stacks_are_collected_keeps_the_hangs_verdict() -> None:
    """The launchers restart before the hang's stack window closes (rank 5's stack never
    came): the next attempt's start concludes the hang on the stacks in hand (rank 5's
    phase names it), never an undeclared restart that names nobody."""
    job = Job().start().steps(25).stall(8.0, stuck={5: "forward"})
    job.abort_all(ranks=[r for r in range(job.world_size) if r != 5])
    job.restart(resumed_from_step=20, delay_s=1.0).steps(3)
    (interruption,), (command,) = decided(job)
    assert (interruption.cause, interruption.rank) == (InterruptionCause.HANG, 5)
    assert command.node == job.node(5)
