"""A processor worker SIGKILLed between publishing a decision and committing its offset,
then restarted (issue 7 scenario 1), on the real broker.

The job: 16 ranks, rank 5 slow from step 62 (flagged by the windowed detector at the end
of its first slow 32-step block, before step 115), rank 9 slow from step 100, rank 2
crashing at the end. The story:

1. worker A folds steps 0-60 and is stopped gracefully: it commits;
2. worker B takes over (a recovery up to A's commit), folds steps 61-115, publishes
   rank 5's StragglerFlagged, and is SIGKILLed at once: its offsets were never
   committed (a commit interval of 10 minutes), so the decision's record is above the
   committed offset;
3. worker C recovers (snapshot, or the whole log) up to the commit, folds steps 61-115
   again and re-makes the flag, which it must not publish twice; then steps 116-200:
   rank 9's slow block began before the kill, so its flag needs the recovered state, and
   so does the crash's interruption (its lost steps count from the recovered state).

Afterwards: nothing acknowledged is lost, no decision id appears twice on its topic,
and the log replayed through a fresh core gives exactly the live decisions.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.devtools.stack import builtin_policy, scrape
from harness.feed import Feed
from harness.scoring.oracle import check
from harness.straggler_streams import Slow, SyncJob
from trainguard.kafka.topics import TopicNames
from trainguard.processors.core.policy import load_policy
from trainguard.replay.log import read_recording
from trainguard.replay.replay import decision_id
from trainguard.schemas import Derived, Interruption, StragglerFlagged, decode
from trainguard.schemas.codec import DERIVED

from ..readers import TopicReader
from .workers import Workers, workers_on

pytestmark = pytest.mark.broker

SECRET = "processor-kill-test-secret-0123456789"
POLICY = builtin_policy("demo")


@dataclass(frozen=True)
class Case:
    """Where the newest snapshot stands when worker C recovers."""

    snapshot_interval_s: float
    #: A pause (longer than the interval) inside A's steps, B's steps: a snapshot is taken
    #: at the first record after it. B's is ahead of the commit: C skips up to it.
    pause_a: bool = False
    pause_b: bool = False


CASES = {
    "snapshot-behind-commit": Case(1.0, pause_a=True),
    "snapshot-ahead-of-commit": Case(1.0, pause_a=True, pause_b=True),
    "no-snapshots": Case(0.0),
}


@pytest.fixture(params=[pytest.param(case, id=name) for name, case in CASES.items()])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def workers(case: Case, bootstrap: str, topics: TopicNames, tmp_path: Path) -> Iterator[Workers]:
    # Offsets are committed every 10 minutes: only a graceful stop commits in this test.
    args = ("--snapshot-interval", str(case.snapshot_interval_s), "--commit-interval", "600")
    with workers_on(bootstrap, topics, POLICY, SECRET, tmp_path, args) as w:
        yield w


def derived_of(reader: TopicReader, run_id: str) -> list[Derived]:
    return [d for d in (decode(s.value, DERIVED) for s in reader.seen) if d.run_id == run_id]


def send_steps(
    job: SyncJob, feed: Feed, workers: Workers, n: int, pause_s: float | None, base: int = 0
) -> None:
    """n more steps of the job; with a pause, in two halves, the first one processed (the
    newest worker started at event `base`) and then `pause_s` of silence, so that the
    second half's first record is snapshotted."""
    halves = [n // 2, n - n // 2] if pause_s is not None else [n]
    for i, k in enumerate(halves):
        mark = len(job.events)
        job.steps(k)
        feed.send(job.events[mark:])
        if pause_s is not None and i == 0:
            workers.wait_processed(len(workers.procs) - 1, len(job.events) - base)
            time.sleep(pause_s)


def test_a_worker_killed_after_a_decision_and_before_its_commit_repeats_nothing_and_loses_nothing(
    case: Case, workers: Workers
) -> None:
    names = workers.names
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    job = SyncJob(run_id=run_id, world_size=16, ranks_per_node=4, nodes_per_rack=2, step_s=0.2,
                  slow=[Slow(5, 1.8, from_step=62), Slow(9, 1.8, from_step=100)])  # fmt: skip
    feed = Feed(workers.bootstrap, names.telemetry, job.world_size)
    events = TopicReader(workers.bootstrap, names.events)
    pause = case.snapshot_interval_s * 1.5

    # 1. Worker A folds steps 0-60 and stops gracefully, committing.
    workers.start()
    feed.send(job.start().events)
    send_steps(job, feed, workers, 61, pause if case.pause_a else None)
    workers.wait_processed(0, len(job.events))
    workers.stop(0, signal.SIGTERM)
    partition, a_end = feed.end_offset()
    assert workers.committed(partition) == a_end, workers.log(0)

    # 2. Worker B folds steps 61-115, publishes rank 5's flag, and is killed at once.
    workers.start()
    send_steps(job, feed, workers, 55, pause if case.pause_b else None, base=len(job.events))

    def flagged(rank: int) -> list[StragglerFlagged]:
        return [d for d in derived_of(events, run_id) if isinstance(d, StragglerFlagged) and d.rank == rank]

    events.until(lambda _: bool(flagged(5)), 90)
    assert flagged(5), workers.log(1)
    workers.stop(1, signal.SIGKILL)
    decision_record = feed.first_offset_of_step(flagged(5)[0].step)
    assert workers.committed(partition) == a_end < decision_record[1]

    # 3. Worker C recovers, re-folds 61-115 without publishing the flag again, goes on.
    workers.start()
    mark = len(job.events)
    job.steps(85)
    job.exit(2, signal=9)
    feed.send(job.events[mark:])
    events.until(
        lambda _: bool(flagged(9)) and any(isinstance(d, Interruption) for d in derived_of(events, run_id)),
        120,
    )
    events.settle(2.0)
    events.close()
    assert flagged(9), workers.log(2)
    assert feed.failed == 0

    recording = read_recording(workers.bootstrap, names, run_id)
    ids = [decision_id(d) for d in [*recording.derived, *recording.commands]]
    assert len(ids) == len(set(ids)), (
        f"a decision was published twice: {[(d.KIND, d.step) for d in recording.derived]}"
    )
    report = check(recording, load_policy(POLICY), acknowledged=feed.acknowledged())
    assert report.ok, str(report)

    metrics = scrape(workers.urls[2])
    assert metrics["trainguard_recoveries_total"] == 1, workers.log(2)
    assert metrics["trainguard_suppressed_outputs_total"] >= 1  # the flag, re-made and not re-sent
    folded_again, skipped = (
        metrics["trainguard_recovery_records_total"],
        metrics["trainguard_redelivered_records_total"],
    )
    suppressed = metrics["trainguard_suppressed_outputs_total"]
    print(f"scenario 1 ({case}): {len(job.events)} events; worker C folded {folded_again:.0f} records again, "
          f"skipped {skipped:.0f}, suppressed {suppressed:.0f} outputs")  # fmt: skip
    if case.pause_b:  # B's snapshot: nothing to fold, B's records up to it skipped
        assert folded_again == 0 and skipped > 0
    elif case.pause_a:  # A's snapshot: the records after it, up to the commit
        assert 0 < folded_again < a_end and skipped == 0
    else:  # the whole log up to the commit
        assert folded_again == a_end and skipped == 0
