"""Two processor workers share six runs; one is SIGKILLed mid-run and later comes back
(issue 7 scenario 2: two rebalances while processing), on the real broker.

Each run (16 ranks) has a straggler flagged after 100 slow steps, a crash with its
interruption and quarantine command, a restart, and a second crash on the same node
(a page, which needs the first crash in the state). The runs' telemetry streams in
rounds, step by step, while the worker that holds some of them is killed: the other
worker takes its partitions over after the session timeout and recovers their state
(snapshot + log); then the killed worker restarts and the partitions are shared again.

Afterwards, for every run: nothing acknowledged is lost, no decision or command id is
on its topic twice, and the log replayed through a fresh core gives exactly the live
decisions (no gap: a decision missed during a takeover would be missing).
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.devtools.stack import builtin_policy
from harness.feed import Feed, node_batches
from harness.scoring.oracle import check
from harness.straggler_streams import Slow, SyncJob
from trainguard.kafka.lag import wait_caught_up
from trainguard.kafka.topics import TopicNames, partition_count
from trainguard.processors.core.policy import load_policy
from trainguard.replay.log import read_recording
from trainguard.replay.replay import decision_id
from trainguard.schemas import Interruption, Page, decode
from trainguard.schemas.codec import DERIVED
from trainguard.schemas.sharding import telemetry_partition

from ..readers import TopicReader
from .workers import Workers, workers_on

pytestmark = pytest.mark.broker

SECRET = "rebalance-test-secret-0123456789"
POLICY = builtin_policy("demo")
RUNS = 6


@pytest.fixture
def workers(bootstrap: str, topics: TopicNames, tmp_path: Path) -> Iterator[Workers]:
    with workers_on(bootstrap, topics, POLICY, SECRET, tmp_path, ("--snapshot-interval", "3")) as w:
        yield w


def run_ids(partitions: int) -> list[str]:
    """One run per partition (as far as there are runs), so both workers hold some."""
    ids: dict[int, str] = {}
    while len(ids) < min(RUNS, partitions):
        run_id = f"rb-{uuid.uuid4().hex[:8]}"
        ids.setdefault(telemetry_partition(run_id, 0, 1, partitions), run_id)
    return list(ids.values())


def job_rounds(run_id: str, seed: int) -> list[list]:
    """The run's telemetry, one round per step (a node batch each), faults included."""
    job = SyncJob(run_id=run_id, world_size=16, ranks_per_node=4, nodes_per_rack=2, step_s=0.2, seed=seed,
                  slow=[Slow(5 + seed % 3, 1.8, from_step=5)])  # fmt: skip
    job.start().steps(125)
    job.exit(2, signal=9)
    job.restart(resumed_from_step=100).steps(60)
    job.exit(1, signal=9)  # the same node again: a page
    rounds: list[list] = []
    for batch in node_batches(job.events):
        if not rounds or rounds[-1][0].step != batch[0].step or rounds[-1][0].attempt != batch[0].attempt:
            rounds.append([])
        rounds[-1].extend(batch)
    return rounds


def test_a_worker_killed_mid_run_and_restarted_leaves_no_gap_and_no_duplicate(workers: Workers) -> None:
    names = workers.names
    runs = run_ids(partition_count(workers.bootstrap, names.telemetry))
    streams = [job_rounds(run_id, seed) for seed, run_id in enumerate(runs)]
    feed = Feed(workers.bootstrap, names.telemetry, 16)
    workers.start()
    workers.start()
    rounds = max(map(len, streams))
    kill_at, back_at = rounds // 3, 2 * rounds // 3
    t0 = time.monotonic()
    for i in range(rounds):
        feed.send([e for stream in streams if i < len(stream) for e in stream[i]])
        if i == kill_at:
            workers.stop(0, signal.SIGKILL)
        if i == back_at:
            workers.start()
        time.sleep(0.12)  # ~40 s of load: the takeover (15 s session timeout) happens under it
    load_s = time.monotonic() - t0
    assert feed.failed == 0
    wait_caught_up(workers.bootstrap, workers.group, [names.telemetry], 120)

    reader = TopicReader(workers.bootstrap, names.events)
    reader.settle(3.0)
    derived = [decode(s.value, DERIVED) for s in reader.seen]
    reader.close()
    for run_id in runs:
        mine = [d for d in derived if d.run_id == run_id]
        assert sum(isinstance(d, Interruption) for d in mine) == 2, (run_id, [d.KIND for d in mine])
        assert any(isinstance(d, Page) for d in mine), (run_id, [d.KIND for d in mine])

    policy = load_policy(POLICY)
    acknowledged = feed.acknowledged()
    for run_id in runs:
        recording = read_recording(workers.bootstrap, names, run_id)
        ids = [decision_id(d) for d in [*recording.derived, *recording.commands]]
        assert recording.commands, run_id
        assert len(ids) == len(set(ids)), f"{run_id}: a decision was published twice"
        mine = {e for e in acknowledged if e.startswith(run_id)}
        report = check(recording, policy, acknowledged=mine)
        assert report.ok, f"{run_id}:\n{report}"

    survivor = 1
    assert workers.metric(survivor, "trainguard_recoveries_total") >= 1  # it took partitions over
    assert workers.metric(2, "trainguard_recoveries_total") >= 1  # the restarted one recovered its share
    events = sum(len(round_) for stream in streams for round_ in stream)
    assert events / load_s > 300, f"{events} events in {load_s:.0f} s"
    names_ = ("recoveries", "recovery_records", "suppressed_outputs", "redelivered_records")
    figures = {name: [workers.metric(n, f"trainguard_{name}_total") for n in (1, 2)] for name in names_}
    print(f"scenario 2: {len(runs)} runs, {events} events in {load_s:.1f} s ({events / load_s:.0f}/s); "
          f"workers 1 and 2: {figures}")  # fmt: skip
