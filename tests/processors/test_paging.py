"""Paging on a pattern, never on an independent failure (seed R5): the same node twice,
the same step twice, a burst over 5x the baseline rate; each pattern pages once, with
its rule and the interruptions that make it."""

from __future__ import annotations

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy
from trainguard.processors.core.decisions.paging_state import PagingPolicy
from trainguard.schemas import (
    Interruption,
    Page,
    PauseRun,
    Quarantine,
    QuarantineNode,
    QuarantineReleased,
    ReasonCode,
    ReleaseNode,
    SkipUpdate,
)

#: A 16-rank test job given the seed's 16,384-GPU failure rate (MTBF 3.1 h), so that
#: "the normal rate" means what it means for a real large run.
POLICY = CorePolicy(baseline=BaselinePolicy(reference_world_size=16))
HOUR = 3600.0


def pages(outputs: list) -> list[Page]:
    return [o for o in outputs if isinstance(o, Page)]


def interruptions(outputs: list) -> list[Interruption]:
    return [o for o in outputs if isinstance(o, Interruption)]


def crash_and_restart(job: Job, rank: int, then_steps: int, resume_from: int | None = None) -> Job:
    job.exit(rank, exit_code=1)
    job.restart(resumed_from_step=job.step if resume_from is None else resume_from)
    return job.steps(then_steps)


def test_independent_failures_at_the_normal_rate_restart_silently() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(150)  # 2.5 h per attempt
    for rank in (3, 9, 14, 6):  # four nodes, four different steps, ~3 h apart
        crash_and_restart(job, rank, 180)
    _, outputs = run_all(job.events, POLICY)
    assert len(interruptions(outputs)) == 4 and pages(outputs) == []


def test_the_same_node_twice_pages_once_with_both_interruptions() -> None:
    job = Job(step_s=60.0).start().steps(150)
    crash_and_restart(job, 1, 150)  # node-000
    crash_and_restart(job, 2, 150)  # node-000 again: its quarantine did not hold
    crash_and_restart(job, 3, 150)  # and again: already paged
    _, outputs = run_all(job.events, POLICY)
    (page,) = pages(outputs)
    first, second, _ = interruptions(outputs)
    assert page.rule == "same_node" and page.node == "node-000"
    assert page.reason.code == ReasonCode.PAGE_SAME_NODE and "node-000" in page.reason.text
    assert page.evidence == [first.interruption_id, second.interruption_id]


def test_the_same_step_failing_after_a_restart_pages_as_data_or_code() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)  # steps 0..125
    # A bad batch at step 125: every restart from checkpoint 120 dies there, on any node.
    crash_and_restart(job, 5, 5, resume_from=120)
    crash_and_restart(job, 12, 5, resume_from=120)
    _, outputs = run_all(job.events, POLICY)
    (page,) = pages(outputs)
    assert page.rule == "same_step" and page.step == 125
    assert "data or code" in page.reason.text and len(page.evidence) == 2


def test_a_crash_after_a_checkpoint_then_one_while_restarting_is_no_pattern() -> None:
    # Both stop "at step 120" by chance: one just after the checkpoint, one before the
    # next attempt completed any step. Not the same failure twice.
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(121)  # checkpoint 120, then nothing
    job.exit(5, exit_code=1)
    job.restart(resumed_from_step=120, delay_s=300.0)
    job.exit(9, exit_code=1)  # the restart fails before its first step
    job.restart(resumed_from_step=120, delay_s=300.0)
    job.steps(30)
    _, outputs = run_all(job.events, POLICY)
    assert [i.step for i in interruptions(outputs)] == [120, 120] and pages(outputs) == []


def test_a_first_step_that_fails_every_time_pages_as_data_or_code() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(125)
    job.exit(5, exit_code=1)
    for rank in (9, 14):  # the first step after resuming from 120 kills a rank each time
        job.restart(resumed_from_step=120, delay_s=300.0)
        job.exit(rank, exit_code=1)
    _, outputs = run_all(job.events, POLICY)
    assert pages(outputs) == []  # twice: restarts are hit by failures by chance, too
    job.restart(resumed_from_step=120, delay_s=300.0)
    job.exit(2, exit_code=1)
    _, outputs = run_all(job.events, POLICY)
    (page,) = pages(outputs)
    assert page.rule == "same_step" and "starting from step 120, before completing a step" in page.reason.text
    assert page.evidence == [i.interruption_id for i in interruptions(outputs)[1:]]


def test_a_burst_unlikely_at_the_baseline_pages_but_two_or_three_failures_do_not() -> None:
    # The baseline here is the seed's 16,384-rank rate (MTBF 3.1 h, 0.32/h).
    two = Job(step_s=60.0).start().steps(120)
    crash_and_restart(two, 1, 20)
    crash_and_restart(two, 6, 20)  # 2 in the last hour: 6x the baseline, but only two
    _, outputs = run_all(two.events, POLICY)
    assert pages(outputs) == []

    for burst in ((1, 6, 11), (1, 6, 11, 14)):  # 9x, 12x the baseline: a few times a month by chance
        job = Job(step_s=60.0).start().steps(120)
        for rank in burst:
            crash_and_restart(job, rank, 10)
        _, outputs = run_all(job.events, POLICY)
        assert pages(outputs) == []

    five = Job(step_s=60.0, world_size=32).start().steps(120)
    for rank in (1, 6, 11, 14, 17):  # five nodes, five steps, within an hour
        crash_and_restart(five, rank, 10)
    _, outputs = run_all(five.events, CorePolicy(baseline=BaselinePolicy(reference_world_size=32)))
    (page,) = pages(outputs)
    assert page.rule == "failure_rate" and page.reason.code == ReasonCode.PAGE_FAILURE_RATE
    assert page.evidence == [i.interruption_id for i in interruptions(outputs)]
    assert "5 interruptions" in page.reason.text and "p = 1.4e-04 for the 4 before it" in page.reason.text


def test_a_redelivered_interruption_is_not_counted_twice() -> None:
    job = Job(step_s=60.0).start().steps(150)
    crash_and_restart(job, 1, 150)
    exit_event = job.events[-1]
    job.events.append(exit_event)  # at-least-once: the same exit report again
    _, outputs = run_all(job.events, POLICY)
    assert pages(outputs) == []


def of(outputs: list, kind: type) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def bad_batch_at_126(policy: CorePolicy = POLICY) -> list:
    """A bad batch at step 126: every restart from checkpoint 120 completes step 125 and
    dies in 126, on whichever rank reads it. The first failure's node is quarantined
    (nobody can tell yet) and swapped for a spare; the second, on another node, is the
    pattern; a third (a launcher that restarts anyway) comes from the spare that replaced
    the first node."""
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    job.exit(5, exit_code=1)  # node-001
    job.replace("node-001")
    job.restart(resumed_from_step=120).steps(5)
    job.exit(9, exit_code=1)  # node-002
    job.restart(resumed_from_step=120).steps(5)
    job.exit(5, exit_code=1)  # spare-000, in node-001's slot
    _, outputs = run_all(job.events, policy)
    return outputs


def test_a_step_failing_on_different_nodes_pauses_the_run_and_releases_the_first_node() -> None:
    outputs = bad_batch_at_126()
    first, second, third = interruptions(outputs)
    assert [(i.step, i.node) for i in (first, second, third)] == [
        (125, "node-001"),
        (125, "node-002"),
        (125, "spare-000"),
    ]
    (page,) = pages(outputs)  # one page: no same_node page blaming the spare
    assert page.rule == "same_step" and page.evidence == [first.interruption_id, second.interruption_id]
    # The run stops restarting into step 126, once.
    (pause,) = of(outputs, PauseRun)
    assert pause.step == 126 and pause.attempt == second.attempt and pause.caused_by == [page.event_id]
    assert pause.reason.code == ReasonCode.PAUSE_RUN
    assert "step 126 failed 2 times on 2 different nodes: data or code" in pause.reason.text
    assert "paused for a human" in pause.reason.text
    # Only the first failure quarantined a node; the pattern gives it back, with the reason.
    (quarantine,) = of(outputs, Quarantine)
    (command,) = of(outputs, QuarantineNode)
    assert quarantine.node == command.node == "node-001"
    (released,) = of(outputs, QuarantineReleased)
    (release,) = of(outputs, ReleaseNode)
    assert released.node == release.node == "node-001" and released.quarantine_id == quarantine.event_id
    assert released.reason.code == ReasonCode.QUARANTINE_RELEASED == release.reason.code
    assert released.reason.text.startswith("step 126 failed on 2 different nodes: data or code, not node-001")
    assert release.caused_by == [released.event_id] and page.event_id in released.caused_by


def test_under_the_skip_policy_the_failing_batch_is_skipped_instead() -> None:
    policy = POLICY.model_copy(update={"paging": PagingPolicy(on_repeat_step="skip")})
    outputs = bad_batch_at_126(policy)
    assert of(outputs, PauseRun) == []
    (skip,) = of(outputs, SkipUpdate)
    assert skip.step == 126 and skip.reason.code == ReasonCode.SKIP_BATCH
    assert "skipping the batch of step 126" in skip.reason.text
    assert [r.node for r in of(outputs, ReleaseNode)] == ["node-001"]


def test_the_same_node_failing_twice_at_one_step_keeps_its_quarantine() -> None:
    # Twice on node-001 (its quarantine did not hold): the step pages, the node stays out.
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    job.exit(5, exit_code=1)
    job.restart(resumed_from_step=120).steps(5)
    job.exit(6, exit_code=1)
    _, outputs = run_all(job.events, POLICY)
    assert [p.rule for p in pages(outputs)] == ["same_step"] and len(of(outputs, PauseRun)) == 1
    assert of(outputs, ReleaseNode) == [] and "on one node" in of(outputs, PauseRun)[0].reason.text
