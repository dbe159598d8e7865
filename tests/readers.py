"""Reading what the pipeline wrote to a real topic, for assertions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from trainguard.kafka.security import KafkaCredentials, client_config


@dataclass(frozen=True)
class Seen:
    value: bytes
    headers: dict[str, bytes]


class TopicReader:
    """Reads one topic from its beginning, every partition assigned directly.

    Not `subscribe`: a group join can take longer than a short `settle` window under
    load, and a reader that saw nothing yet would pass for "nothing was written"."""

    def __init__(self, bootstrap: str, topic: str, credentials: KafkaCredentials | None = None) -> None:
        config = {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
        self.consumer = Consumer(client_config(config, credentials))
        self.topic = topic
        self.assigned = False
        self.seen: list[Seen] = []
        self._assign()

    def _assign(self) -> None:
        """Assign every partition from the beginning, once the topic exists."""
        try:
            metadata = self.consumer.list_topics(self.topic, timeout=5).topics.get(self.topic)
        except KafkaException:
            return
        if metadata is None or metadata.error is not None or not metadata.partitions:
            return
        self.consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in metadata.partitions])
        self.assigned = True

    def poll(self, timeout_s: float = 0.2) -> None:
        if not self.assigned:
            self._assign()
            if not self.assigned:
                time.sleep(timeout_s)
                return
        for msg in self.consumer.consume(1000, timeout_s):
            if msg.error() is None:
                self.seen.append(Seen(msg.value() or b"", {k: v or b"" for k, v in msg.headers() or []}))

    def until(self, done: Callable[[list[Seen]], bool], timeout_s: float = 60.0) -> list[Seen]:
        """Poll until `done(seen)` holds (returns everything seen) or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        while not done(self.seen) and time.monotonic() < deadline:
            self.poll()
        return self.seen

    def settle(self, quiet_s: float = 1.5) -> list[Seen]:
        """Keep listening for `quiet_s` so that unexpected extra records would be seen."""
        end = time.monotonic() + quiet_s
        while time.monotonic() < end:
            self.poll(0.1)
        return self.seen

    def close(self) -> None:
        self.consumer.close()
