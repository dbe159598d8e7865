"""Telemetry of a streamed job sent to a real broker the way rank shippers send it (one
batch per node and step, keyed by run id), remembering what the broker acknowledged
and at which offsets, so that a fault scenario can place a kill between two records
and the oracle can check that nothing acknowledged was lost."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, Message, Producer

from trainguard.schemas import Envelope, encode, encode_batch


@dataclass(frozen=True)
class Sent:
    partition: int
    offset: int
    steps: frozenset[int]
    event_ids: tuple[str, ...]


def node_batches(events: Iterable[Envelope]) -> Iterator[list[Envelope]]:
    """Consecutive events of one (run, step, node): what one node's shipper sends per step."""
    for _, group in itertools.groupby(events, key=lambda e: (e.run_id, e.step, e.node)):
        yield list(group)


@dataclass
class Feed:
    bootstrap: str
    topic: str
    world_size: int
    sent: list[Sent] = field(default_factory=list)
    failed: int = 0

    def __post_init__(self) -> None:
        self.producer = Producer(
            {"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "linger.ms": 5}
        )
        self._seq = itertools.count()

    def send(self, events: Iterable[Envelope]) -> None:
        """Send and wait until every record is acknowledged or failed."""
        for batch in node_batches(events):
            head = batch[0]
            header = dict(run_id=head.run_id, node=head.node or "controller", world_size=self.world_size,
                          producer_id=f"feed-{head.run_id}", seq=next(self._seq))  # fmt: skip
            value = encode_batch(header, [encode(e) for e in batch])
            ids = tuple(e.event_id for e in batch)
            steps = frozenset(e.step for e in batch)

            def delivered(
                err: KafkaError | None, msg: Message, s: frozenset[int] = steps, i: tuple = ids
            ) -> None:
                self._delivered(err, msg, s, i)

            self.producer.produce(self.topic, key=head.run_id.encode(), value=value, on_delivery=delivered)
            self.producer.poll(0)
        assert self.producer.flush(30) == 0

    def _delivered(
        self, err: KafkaError | None, msg: Message, steps: frozenset[int], ids: tuple[str, ...]
    ) -> None:
        if err is not None:
            self.failed += 1
            return
        self.sent.append(Sent(msg.partition() or 0, msg.offset() or 0, steps, ids))

    def acknowledged(self) -> set[str]:
        return {i for s in self.sent for i in s.event_ids}

    def first_offset_of_step(self, step: int) -> tuple[int, int]:
        """(partition, offset) of the first acknowledged record holding `step`."""
        return min((s.partition, s.offset) for s in self.sent if step in s.steps)

    def end_offset(self) -> tuple[int, int]:
        """(partition, next offset) after the last acknowledged record."""
        last = max((s.partition, s.offset) for s in self.sent)
        return last[0], last[1] + 1
