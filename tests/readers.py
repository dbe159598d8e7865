"""Reading what the pipeline wrote to a real topic, for assertions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer

from trainguard.broker.security import KafkaCredentials, client_config


@dataclass(frozen=True)
class Seen:
    value: bytes
    headers: dict[str, bytes]


class TopicReader:
    """Reads one topic from its beginning with a throwaway consumer group."""

    def __init__(self, bootstrap: str, topic: str, credentials: KafkaCredentials | None = None) -> None:
        config = {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
        self.consumer = Consumer(client_config(config, credentials))
        self.consumer.subscribe([topic])
        self.seen: list[Seen] = []

    def poll(self, timeout_s: float = 0.2) -> None:
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
