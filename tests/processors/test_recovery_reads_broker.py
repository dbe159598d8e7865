"""The recovery's reads of the log (processors/recovery.py) against the real broker: every
record of each range, the outputs published since a moment, and no read that waits out its
batch timeout once per partition (issue 49: a 2,048-rank recovery spent seconds there)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaException, Producer

from trainguard.kafka.topics import TopicNames
from trainguard.processors.recovery import _consumer, published_since, read_range, read_ranges
from trainguard.schemas import Abort, Reason, ReasonCode, encode

pytestmark = pytest.mark.broker


def produce(bootstrap: str, records: list[tuple[str, int, bytes, float]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for topic, partition, value, ts in records:
        producer.produce(topic, value=value, partition=partition, timestamp=int(ts * 1000))
    assert producer.flush(30) == 0


def command(command_id: str, ts: float) -> bytes:
    reason = Reason(code=ReasonCode.RANK_EXITED, text="rank 3 died")
    return encode(Abort(command_id=command_id, run_id="run-r", attempt=0, ranks=None, issued_ts=ts,
                        reason=reason, caused_by=["e-1"], stack_dump=False))  # fmt: skip


def test_ranges_of_several_partitions_come_back_whole_and_in_order(
    bootstrap: str, topics: TopicNames
) -> None:
    now = time.time()
    produce(bootstrap, [(topics.events, p, f"{p}:{i}".encode(), now) for p in (0, 2, 5) for i in range(7)])
    consumer = _consumer(bootstrap)
    try:
        ranges = {(topics.events, 0): (2, 7), (topics.events, 2): (0, 3), (topics.events, 5): (6, 7),
                  (topics.events, 1): (0, 0)}  # fmt: skip
        t0 = time.perf_counter()
        got = [(m.partition(), (m.value() or b"").decode()) for m in read_ranges(consumer, ranges)]
        together_s = time.perf_counter() - t0
        assert sorted(got) == sorted([(0, f"0:{i}") for i in range(2, 7)] + [(2, f"2:{i}") for i in range(3)]
                                     + [(5, "5:6")])  # fmt: skip
        for p in (0, 2):
            mine = [v for q, v in got if q == p]
            assert mine == sorted(mine, key=lambda v: int(v.split(":")[1]))
        t0 = time.perf_counter()
        alone = [(m.value() or b"").decode() for m in read_range(consumer, topics.events, 0, 0, 7)]
        alone_s = time.perf_counter() - t0
    finally:
        consumer.close()
    assert alone == [f"0:{i}" for i in range(7)]
    # A short range no longer waits out consume()'s 0.5 s for a batch it cannot fill.
    assert together_s < 2.0 and alone_s < 2.0, (together_s, alone_s)


def test_outputs_published_since_a_moment_are_listed_by_id(bootstrap: str, topics: TopicNames) -> None:
    now = time.time()
    produce(bootstrap, [
        (topics.commands, 0, command("old", now - 120), now - 120),
        (topics.commands, 0, command("new-0", now), now),
        (topics.commands, 3, command("new-3", now), now),
        (topics.events, 1, b"not a trainguard record", now),
    ])  # fmt: skip
    consumer = _consumer(bootstrap)
    try:
        for _ in range(20):  # the fresh topics' leaders may not be known yet
            try:
                published_since(consumer, topics, now - 60)
                break
            except KafkaException:
                time.sleep(0.5)
        assert published_since(consumer, topics, now - 60) == {"new-0", "new-3"}
        assert published_since(consumer, topics, None) == {"old", "new-0", "new-3"}
    finally:
        consumer.close()
