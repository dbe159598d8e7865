"""How far a consumer group is behind: committed offsets against high watermarks."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from .security import KafkaCredentials, client_config


def group_lag(
    bootstrap: str,
    group: str,
    topics: list[str],
    timeout_s: float = 10.0,
    credentials: KafkaCredentials | None = None,
) -> int:
    """Records on `topics` not yet committed by `group` (a partition never committed
    counts from its low watermark). On a secured broker the principal needs DESCRIBE on
    the group and the topics (the admin principal has it)."""
    config = {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
    consumer = Consumer(client_config(config, credentials))
    try:
        partitions = [
            TopicPartition(topic, p)
            for topic in topics
            for p in consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions
        ]
        lag = 0
        for tp in _committed(consumer, partitions, timeout_s):
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag
    finally:
        consumer.close()


#: The group coordinator moving, loading or not yet elected: it answers within moments.
_COORDINATOR_BUSY = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
)


def _committed(
    consumer: Consumer, partitions: list[TopicPartition], timeout_s: float
) -> list[TopicPartition]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(consumer.committed(partitions, timeout=timeout_s))
        except KafkaException as exc:
            if exc.args[0].code() not in _COORDINATOR_BUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def wait_caught_up(
    bootstrap: str,
    group: str,
    topics: list[str],
    timeout_s: float,
    credentials: KafkaCredentials | None = None,
) -> bool:
    """Poll until `group` has committed everything on `topics`; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if group_lag(bootstrap, group, topics, credentials=credentials) == 0:
            return True
        time.sleep(0.5)
    return False
