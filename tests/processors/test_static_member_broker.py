"""A worker with a static group member id (`trainguard process --instance-id`), SIGKILLed
and restarted under the same id: it takes its partitions straight back, without waiting
out the dead member's 15 s session, recovers their state and goes on; nothing is lost and
no decision is published twice.

Without an id the same restart waits for the session to expire (14 s measured on this
box, ~12 s at the least: the last heartbeat is at most 3 s older than the kill)."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
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
from trainguard.schemas import Derived, StragglerFlagged, decode
from trainguard.schemas.codec import DERIVED

from ..readers import Seen, TopicReader
from .workers import Workers, workers_on

pytestmark = pytest.mark.broker

SECRET = "static-member-test-secret-0123456789"
POLICY = builtin_policy("demo")
#: Under the dynamic member's floor (session 15 s less one 3 s heartbeat interval).
TAKEBACK_LIMIT_S = 12.0


def derived(seen: list[Seen], run_id: str) -> list[Derived]:
    return [d for d in (decode(s.value, DERIVED) for s in seen) if d.run_id == run_id]


@pytest.fixture
def workers(bootstrap: str, topics: TopicNames, tmp_path: Path) -> Iterator[Workers]:
    with workers_on(bootstrap, topics, POLICY, SECRET, tmp_path, ("--instance-id", "worker-a")) as w:
        yield w


def test_a_static_member_restarted_at_once_takes_its_partitions_straight_back(workers: Workers) -> None:
    run_id = f"static-{uuid.uuid4().hex[:8]}"
    job = SyncJob(run_id=run_id, world_size=16, ranks_per_node=4, nodes_per_rack=2, step_s=0.2,
                  slow=[Slow(9, 1.8, from_step=25)])  # fmt: skip
    feed = Feed(workers.bootstrap, workers.names.telemetry, job.world_size)
    workers.start()
    feed.send(job.start().steps(30).events)
    workers.wait_processed(0, len(job.events))
    time.sleep(2.0)  # a commit interval: the restart refolds from the committed offset
    workers.stop(0, signal.SIGKILL)

    restarted = time.monotonic()
    workers.start()
    mark = len(job.events)
    feed.send(job.steps(110).events[mark:])  # rank 9 is flagged at step 124
    workers.wait_processed(1, 1, timeout_s=60)
    takeback_s = time.monotonic() - restarted
    events = TopicReader(workers.bootstrap, workers.names.events)
    flagged = events.until(
        lambda seen: any(isinstance(d, StragglerFlagged) for d in derived(seen, run_id)), 90
    )
    events.close()
    assert any(isinstance(d, StragglerFlagged) for d in derived(flagged, run_id)), workers.log(1)
    metrics = scrape(workers.urls[1])
    print(f"static member: restart to first event processed {takeback_s:.1f} s")
    assert takeback_s < TAKEBACK_LIMIT_S, workers.log(1)
    assert metrics["trainguard_recoveries_total"] == 1, workers.log(1)
    assert feed.failed == 0

    recording = read_recording(workers.bootstrap, workers.names, run_id)
    assert [d.rank for d in recording.derived if isinstance(d, StragglerFlagged)] == [9]
    ids = [decision_id(d) for d in [*recording.derived, *recording.commands]]
    assert len(ids) == len(set(ids))
    report = check(recording, load_policy(POLICY), acknowledged=feed.acknowledged())
    assert report.ok, str(report)
