"""The training step never waits for Kafka: with the broker gone, RankAgent.step()
still returns in microseconds, and the shipper accounts for every event, by id: each one
submitted has exactly one outcome (delivered, dropped or failed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from harness.devtools.broker_jars import ensure_jars
from harness.devtools.local_broker import LocalBroker
from trainguard.kafka.topics import ensure_topics, topic_names
from trainguard.producers.rank.agent import RankAgent
from trainguard.producers.rank.shipper import DeliveryOutcome, ShipperConfig, TelemetryShipper
from trainguard.schemas import Envelope

pytestmark = pytest.mark.broker

CALLS = 20_000


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def test_step_never_blocks_when_the_broker_dies(tmp_path: Path) -> None:
    ensure_jars()
    broker = LocalBroker(tmp_path / "kafka")  # our own broker: this test kills it
    try:
        bootstrap = broker.start()
        ensure_topics(bootstrap, prefix="stall.")
        config = ShipperConfig(
            bootstrap,
            topic_names("stall.").telemetry,
            flush_interval_s=2.0,  # long: a submit() that waited for a flush would wait ~2 s
            max_queued_events=1000,
            producer={"message.timeout.ms": 3000},
        )
        outcomes: dict[str, list[DeliveryOutcome]] = {}

        def told(outcome: DeliveryOutcome, events: Sequence[Envelope]) -> None:
            for event in events:
                outcomes.setdefault(event.event_id, []).append(outcome)

        shipper = TelemetryShipper(config, "run-stall", world_size=1, name="stall", on_outcome=told)
        agent = RankAgent(shipper, "run-stall", attempt=0, rank=0, node="node-0")
        for step in range(5):
            agent.step(step, compute_s=0.5, total_s=0.6, loss=1.0, grad_norm=0.1)
        shipper.flush_now()
        assert wait_for(lambda: shipper.stats.delivered == 10, 30), shipper.stats
        delivered_before = shipper.stats.delivered
        first_ids = set(outcomes)

        broker.stop()

        durations = []
        for step in range(5, 5 + CALLS):
            start = time.perf_counter_ns()
            agent.step(step, compute_s=0.5, total_s=0.6, loss=1.0, grad_norm=0.1)
            durations.append(time.perf_counter_ns() - start)
        stats = shipper.close(timeout_s=10)
    finally:
        broker.stop()

    durations.sort()
    p99_ms = durations[int(0.99 * len(durations))] / 1e6
    max_ms = durations[-1] / 1e6
    slow = sum(d > 5_000_000 for d in durations)
    print(
        f"\nstep() with the broker down: p99 {p99_ms * 1000:.1f} µs, max {max_ms:.2f} ms, {slow} calls > 5 ms"
    )
    print(stats)
    assert p99_ms < 0.5
    # Not `max < 5 ms`: on a busy 2-core machine a few calls in 20,000 are preempted by
    # the OS or wait up to one GIL switch interval (5 ms) for the shipper thread (up to 105
    # ms and 22 calls over 5 ms were seen with other jobs running). What "blocking" would
    # look like is different: a submit() that waited for room in the queue would wait for
    # the next flush (2 s here) every 500 calls, and one that waited for the broker would
    # take seconds (message.timeout.ms is 3 s).
    assert slow <= len(durations) // 200
    # Nor a bound on the longest call (one preemption took 1.2 s at a load of 9): a call that
    # blocked would take a flush interval or a broker timeout (2-3 s), every 500 calls.
    assert sum(d >= 1_500_000_000 for d in durations) <= 3
    assert stats.submitted == 10 + 2 * CALLS
    assert stats.submitted == stats.delivered + stats.dropped + stats.failed
    assert stats.delivered == delivered_before
    assert stats.dropped + stats.failed == stats.submitted - stats.delivered
    assert stats.in_flight == 0
    # By id: every event has one outcome; the acknowledged ones are the first ten exactly.
    assert len(outcomes) == stats.submitted and all(len(o) == 1 for o in outcomes.values())
    by_outcome = {kind: {i for i, (o,) in outcomes.items() if o is kind} for kind in DeliveryOutcome}
    assert by_outcome[DeliveryOutcome.DELIVERED] == first_ids and len(first_ids) == 10
    assert len(by_outcome[DeliveryOutcome.DROPPED]) == stats.dropped > 0
    assert len(by_outcome[DeliveryOutcome.FAILED]) == stats.failed
