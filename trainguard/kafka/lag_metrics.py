"""Consumer lag per partition as Prometheus metrics, for the processors and the archive
writer: the first thing an SRE asks of a stream consumer is whether it keeps up.

A background thread asks the broker every `refresh_s` for the group's committed offsets
and the partitions' high watermarks; a scrape reads the last answer (a scrape never waits
on the broker). When the broker does not answer, `trainguard_consumer_broker_up` drops to
0 and the lag series keep their last values with their refresh time: a consumer connected
to nothing shows as such instead of looking idle and healthy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from .security import KafkaCredentials, client_config

log = logging.getLogger(__name__)


@dataclass
class _Reading:
    lag: dict[tuple[str, int], int] = field(default_factory=dict)
    up: bool = False
    at: float = 0.0


class ConsumerLagCollector(Collector):
    """Lag of consumer `group` on `topics`, labelled with the consumer's `role`
    (processor, archive) so that one rule covers every group of a role."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topics: list[str],
        role: str,
        *,
        refresh_s: float = 10.0,
        timeout_s: float = 5.0,
        credentials: KafkaCredentials | None = None,
    ) -> None:
        self.group, self.topics, self.role = group, topics, role
        self.refresh_s, self.timeout_s = refresh_s, timeout_s
        self._reading = _Reading()
        self._stop = threading.Event()
        # A consumer of its own that never subscribes: it only reads offsets (no rebalance).
        config = {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "log_level": 2,
        }
        self._consumer = Consumer(client_config(config, credentials))
        self._thread = threading.Thread(target=self._run, name=f"lag-{role}", daemon=True)

    def start(self, registry: CollectorRegistry) -> ConsumerLagCollector:
        registry.register(self)
        self._thread.start()
        return self

    def refresh(self) -> None:
        """One reading from the broker (the thread's loop; tests call it directly)."""
        try:
            partitions = [
                TopicPartition(topic, p)
                for topic in self.topics
                for p in self._consumer.list_topics(topic, timeout=self.timeout_s).topics[topic].partitions
            ]
            lag = {}
            for tp in self._consumer.committed(partitions, timeout=self.timeout_s):
                low, high = self._consumer.get_watermark_offsets(tp, timeout=self.timeout_s, cached=False)
                lag[(tp.topic, tp.partition)] = max(0, high - (tp.offset if tp.offset >= 0 else low))
        except (KafkaException, KeyError) as exc:
            log.debug("consumer lag of %s not read: %s", self.group, exc)
            self._reading = _Reading(self._reading.lag, up=False, at=self._reading.at)
            return
        self._reading = _Reading(lag, up=True, at=time.time())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s * 3)
        self._consumer.close()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reading, labels = self._reading, [self.role, self.group]
        lag = GaugeMetricFamily(
            "trainguard_consumer_lag_records",
            "Records on the partition not yet committed by the consumer group (the last reading).",
            labels=["role", "group", "topic", "partition"],
        )
        for (topic, partition), value in sorted(reading.lag.items()):
            lag.add_metric([*labels, topic, str(partition)], value)
        yield lag
        up = GaugeMetricFamily(
            "trainguard_consumer_broker_up",
            "1 when the last lag reading reached the broker, 0 when it did not.",
            labels=["role", "group"],
        )
        up.add_metric(labels, 1.0 if reading.up else 0.0)
        yield up
        at = GaugeMetricFamily(
            "trainguard_consumer_lag_read_timestamp_seconds",
            "When the lag was last read from the broker (0: never).",
            labels=["role", "group"],
        )
        at.add_metric(labels, reading.at)
        yield at
