"""The "nothing lost" oracle cannot pass over nothing: every check says how many items it
covered, and one that covers none where items were expected fails, so a soak that lost
track of which events were acknowledged fails instead of reporting "0 of 0, ok"."""

from __future__ import annotations

from dataclasses import replace

from harness.scoring.oracle import EVERY_CHECK, NOTHING_LOST, REPLAY, check
from harness.streams import Job
from trainguard.processors.core.policy import CorePolicy
from trainguard.replay.log import Recording
from trainguard.replay.replay import replay
from trainguard.schemas import encode, encode_batch

POLICY = CorePolicy()


def _recorded(job: Job) -> Recording:
    """The job's telemetry as the log holds it (a node's record per 8 events), with the
    decisions a live core made of it."""
    header = dict(run_id=job.run_id, node="node-000", world_size=job.world_size, producer_id="p")
    records = [
        (0, seq, encode_batch({**header, "seq": seq}, [encode(e) for e in job.events[i : i + 8]]))
        for seq, i in enumerate(range(0, len(job.events), 8))
    ]
    recording = Recording(job.run_id, records)  # type: ignore[arg-type]
    live = replay(recording, POLICY)
    return replace(recording, derived=list(live.derived), commands=list(live.commands))


def _crashed() -> Job:
    job = Job(run_id="oracle-crash", world_size=8).start().steps(30)
    job.exit(3, signal=9).abort_all()
    return job.restart(resumed_from_step=20).steps(10)


def test_every_check_holds_on_a_whole_run_and_says_what_it_covered() -> None:
    job = _crashed()
    recording = _recorded(job)
    assert recording.commands, "a crash makes decisions"
    report = check(recording, POLICY, acknowledged=[e.event_id for e in job.events], expect=EVERY_CHECK[:-1])
    assert report.ok, str(report)
    covered = {v.name: v.covered for v in report.verdicts}
    assert covered[NOTHING_LOST] == len({e.event_id for e in job.events}) and covered[REPLAY] > 0


def test_no_acknowledged_ids_fails_nothing_lost_instead_of_passing_over_nothing() -> None:
    recording = _recorded(_crashed())
    report = check(recording, POLICY, acknowledged=[])
    verdict = next(v for v in report.verdicts if v.name == NOTHING_LOST)
    assert not verdict.held and "covers nothing" in verdict.detail and not report.ok
    # ...unless the caller says it expects nothing there
    assert check(recording, POLICY, acknowledged=[], expect=()).ok


def test_a_missing_acknowledged_event_is_named() -> None:
    job = _crashed()
    recording = _recorded(job)
    report = check(recording, POLICY, acknowledged=[job.events[0].event_id, "never-logged-7"])
    verdict = next(v for v in report.verdicts if v.name == NOTHING_LOST)
    assert not verdict.held and "never-logged-7" in verdict.detail


def test_a_healthy_run_expected_to_have_decisions_fails_the_checks_that_saw_none() -> None:
    job = Job(run_id="oracle-healthy", world_size=8).start().steps(20)
    recording = _recorded(job)
    assert not recording.commands and not recording.derived
    report = check(recording, POLICY, acknowledged=[e.event_id for e in job.events], expect=EVERY_CHECK)
    failed = {v.name for v in report.verdicts if not v.held}
    assert failed == {"one decision per id", REPLAY, "executed once per rank"}, str(report)
