"""A run cut into shards over two real processor workers (schemas/sharding.py): each
worker holds some of the shards, shard 0's worker makes the run-level decisions from
reports routed or forwarded to it through Kafka, and every fault is still pinned on the
right rank, whichever worker saw that rank."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.devtools.broker_config import free_ports
from harness.devtools.stack import scrape, start_processor
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.producers.simulator.driver import run_simulation
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import (
    EvictionDecision,
    EvictionVerdict,
    Interruption,
    ReasonCode,
    StragglerFlagged,
    decode,
)
from trainguard.schemas.codec import DERIVED

from ..readers import TopicReader

pytestmark = pytest.mark.broker

SECRET = b"sharded-test-secret-0123456789abcdef"
POLICY = Path(__file__).parents[2] / "processors" / "policies" / "evaluate.yaml"
LIBRARY = Scenario.library()
#: 128-rank library runs in four shards of 32 ranks (one rack each).
SHARD_RANKS = 32
PROCESSED = "trainguard_events_processed_total"


@dataclass
class TwoWorkers:
    bootstrap: str
    names: TopicNames
    urls: list[str]

    def processed(self) -> list[float]:
        return [scrape(url).get(PROCESSED, 0.0) for url in self.urls]


@pytest.fixture(scope="module")
def workers(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoWorkers]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    logs = tmp_path_factory.mktemp("workers")
    env = {"TRAINGUARD_SECRET": SECRET.decode()}
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for i, port in enumerate(free_ports(2)):
            proc, url = start_processor(bootstrap, POLICY, port, logs / f"worker-{i}.log", env, prefix)
            procs.append(proc)
            urls.append(url)
        yield TwoWorkers(bootstrap, topic_names(prefix), urls)
        for i, proc in enumerate(procs):
            assert proc.poll() is None, (logs / f"worker-{i}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        delete_topics(bootstrap, list(topic_names(prefix).all()))


def run(workers: TwoWorkers, name: str, until: type, count: int = 1) -> list:
    scenario = LIBRARY[name]
    run_id = f"shard-{name}-{uuid.uuid4().hex[:6]}"
    reader = TopicReader(workers.bootstrap, workers.names.events)
    result = run_simulation(
        scenario, workers.bootstrap, workers.names, SECRET, speed=4.0, run_id=run_id, shard_ranks=SHARD_RANKS
    )
    assert result.finished, result

    def mine(seen: list) -> list:
        return [d for d in (decode(s.value, DERIVED) for s in seen) if d.run_id == run_id]

    derived = mine(reader.until(lambda s: len([d for d in mine(s) if isinstance(d, until)]) >= count))
    reader.close()
    return derived


def test_a_hang_is_pinned_on_a_rank_of_another_shard_and_a_straggler_is_evicted_from_its_shard(
    workers: TwoWorkers,
) -> None:
    before = workers.processed()
    truth = LIBRARY["hang-allreduce"].truth()[0]  # rank 100: shard 3
    derived = run(workers, "hang-allreduce", Interruption)
    (hang,) = [d for d in derived if isinstance(d, Interruption)]
    assert (hang.cause.value, hang.rank, hang.node) == ("hang", truth.rank, truth.node)
    assert hang.reason.code == ReasonCode.ODD_STACK  # every rank's stack reached shard 0
    # Both workers took part of the run.
    assert all(after > b for after, b in zip(workers.processed(), before, strict=True))

    # Shard 2 flags and diagnoses its straggler (node_link) and forwards both; shard 0, which
    # alone decides, prices and evicts it, as an unsharded run does.
    truth = LIBRARY["straggler-nvlink"].truth()[0]  # rank 90: shard 2
    derived = run(workers, "straggler-nvlink", Interruption)
    flagged = {(d.rank, d.node) for d in derived if isinstance(d, StragglerFlagged)}
    assert flagged == {(truth.rank, truth.node)}
    (decision,) = [d for d in derived if isinstance(d, EvictionDecision)]
    assert (decision.rank, decision.decision) == (truth.rank, EvictionVerdict.EVICT)
    evicted = [(d.cause.value, d.rank, d.node) for d in derived if isinstance(d, Interruption)]
    assert evicted == [("eviction", truth.rank, truth.node)]


def test_non_finite_reports_from_every_shard_make_one_decision(workers: TwoWorkers) -> None:
    """A NaN on rank 40 (shard 1) poisons the all-reduced grad norm, so every shard sees
    non-finite reports: shards 1-3 forward theirs to shard 0 through the telemetry topic,
    shard 0 sees its own, and the run is interrupted once."""
    derived = run(workers, "nan-burst", Interruption)
    interruptions = [d for d in derived if isinstance(d, Interruption)]
    assert len({i.interruption_id for i in interruptions}) == 1
    assert interruptions[0].cause.value == "non_finite"
