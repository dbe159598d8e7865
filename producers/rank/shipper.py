"""Ships telemetry from a node to Kafka without ever blocking the training step.

Record granularity. One faust worker handles about 17,000 records/s on a 2-core
machine (shared/NOTES.md), while decoding one event costs ~4 µs. A 16,384-rank run
at 2 s/step emits ~8,200 step-timing events/s plus heartbeats and stats, i.e. about
16,000 events/s: one Kafka record per event would saturate a worker. So a shipper
batches per node and per flush interval: 2,048 nodes flushing once per second are
~2,000 records/s (about 8 events each), a tenth of one worker's capacity, and the
decode cost (~65 ms of CPU per second at 16,000 events/s) stays small. Ranks of one
node share a shipper where they share a process (the simulator, a per-node agent);
a rank process that has its own shipper should flush every few seconds instead
(`flush_interval_s`), which keeps the record rate at world_size / interval.

Placement. A run larger than `shard_ranks` is cut into shards (schemas/sharding.py):
a node's events go to its shard's partition, the run's start to every shard, and the
run-level reports (exits, SDC checks, checkpoints) to shard 0, one record per
(shard, node). Records are placed on explicit partitions, (crc32(run_id) + shard) mod
P spread (schemas/sharding.py), which the processor computes too for the records it
writes into the topic.

Never blocking. `submit()` appends to an in-memory queue under a lock and
returns; a background thread encodes, batches and hands records to librdkafka,
which queues them asynchronously. The bound, `max_queued_events`, covers every event
the shipper holds: queued here, plus handed to librdkafka and not yet acknowledged
(`ShipperStats.in_flight`). At most half of it is handed to librdkafka, so that while
the broker is slow or down the queue fills, rather than librdkafka's own queue: when
the bound is reached, the oldest queued events are dropped (the newest heartbeat
matters more than an old one) and counted. librdkafka keeps what it holds for
`message.timeout.ms` (5 min), so an outage shorter than that loses nothing unless the
bound is exceeded (tests/kafka/test_broker_outage.py: 30 s down under load, nothing
lost). Every submitted event ends in exactly one of the counters `delivered`,
`dropped` (bound reached), or `failed` (librdkafka gave up: timeout or error), so the
accounting is exact once the shipper is closed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from ...kafka.security import KafkaCredentials, client_config
from ...schemas import Envelope, StepTiming, encode, encode_batch
from ...schemas.columnar import MIN_BLOCK_ROWS, encode_step_timings
from ...schemas.sharding import (
    DEFAULT_SHARD_RANKS,
    route,
    shard_count,
    shard_size,
    telemetry_key,
    telemetry_partition,
)

#: Defaults for the librdkafka producer. Idempotence is off by default in
#: librdkafka; it is what makes its internal retries duplicate-free.
log = logging.getLogger(__name__)

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 20,
    "compression.type": "lz4",
    # Long enough to ride out a broker restart or a short outage: what limits the loss
    # is the shipper's bound (max_queued_events), not time. With 30 s, a broker killed
    # for 30 s (42 s without one, its restart included) failed 23% of the events.
    "message.timeout.ms": 300_000,
    "queue.buffering.max.messages": 10_000,
    "queue.buffering.max.kbytes": 64 * 1024,
    # A backlog after an outage flushes as full batches of up to max_batch_events;
    # the telemetry topic admits 8 MiB records (librdkafka's default is 1 MB).
    "message.max.bytes": 8 * 1024 * 1024,
}


@dataclass(frozen=True)
class ShipperConfig:
    bootstrap: str
    topic: str
    flush_interval_s: float = 1.0
    #: Bound on the events this shipper holds: queued, plus handed to librdkafka and not
    #: yet acknowledged (at most half of the bound is handed over).
    max_queued_events: int = 100_000
    #: Most events in one Kafka record.
    max_batch_events: int = 4_096
    #: A run larger than this is cut into shards of this many ranks (schemas/sharding.py).
    shard_ranks: int = DEFAULT_SHARD_RANKS
    #: Seconds to wait for the topic's partition count (background thread only).
    metadata_timeout_s: float = 2.0
    producer: dict[str, Any] = field(default_factory=dict)
    #: The SASL principal on a secured broker; None: from the environment (trainguard/kafka/security.py).
    credentials: KafkaCredentials | None = None
    #: A node's step timings of one record as one columnar block (schemas/columnar.py).
    #: False for processors older than the block (upgrade the processors first).
    columnar: bool = True


@dataclass
class ShipperStats:
    submitted: int = 0
    delivered: int = 0
    dropped: int = 0  # our queue was full: oldest events discarded
    failed: int = 0  # librdkafka reported a delivery error or timeout
    batches_sent: int = 0

    @property
    def in_flight(self) -> int:
        return self.submitted - self.delivered - self.dropped - self.failed


class DeliveryOutcome(StrEnum):
    """What became of a submitted event (each event has exactly one, or is still in flight)."""

    DELIVERED = "delivered"  # librdkafka acknowledged its record
    DROPPED = "dropped"  # the bounded queue was full, or close() gave up on it
    FAILED = "failed"  # librdkafka reported an error or a timeout


#: Told the outcome of events, by event: for an oracle that must know which ids were
#: acknowledged even when others were dropped. Called under the shipper's lock, from the
#: training thread (a drop in submit) or the shipper's: keep it O(events), no I/O.
DeliveryHook = Callable[[DeliveryOutcome, Sequence[Envelope]], None]


@dataclass(frozen=True, slots=True)
class PackedRecord:
    """One Kafka record of telemetry: a node's events for one shard of the run."""

    shard: int
    seq: int
    key: bytes
    value: bytes
    #: The events this record accounts for (an event copied to several shards counts
    #: with its first copy only, so every submitted event is counted exactly once).
    counted: list[Envelope]


def pack(
    events: list[Envelope],
    run_id: str,
    world_size: int,
    size: int,
    producer_id: str,
    seq: int,
    columnar: bool = True,
) -> list[PackedRecord]:
    """Group events into one record per (shard, node), numbered from `seq` (the
    shipper's packing, also used by the benchmarks to pre-build a run's records); with
    `columnar`, a record's step timings are one block where the first of them was."""
    groups: dict[tuple[int, str], list[tuple[Envelope, bool]]] = {}
    for event in events:
        for n, shard in enumerate(route(event, world_size, size)):
            groups.setdefault((shard, event.node), []).append((event, n == 0))
    records = []
    for i, ((shard, node), group) in enumerate(groups.items()):
        header = dict(
            run_id=run_id,
            node=node,
            world_size=world_size,
            producer_id=producer_id,
            seq=seq + i,
            shard=shard,
            shard_ranks=size,
        )
        value = encode_batch(header, _encoded([e for e, _ in group], columnar))
        counted = [e for e, primary in group if primary]
        records.append(PackedRecord(shard, seq + i, telemetry_key(run_id, shard), value, counted))
    return records


def _encoded(events: list[Envelope], columnar: bool) -> list[bytes]:
    timings = [e for e in events if type(e) is StepTiming] if columnar else []
    if len(timings) < MIN_BLOCK_ROWS:
        return [encode(e) for e in events]
    out: list[bytes] = []
    for event in events:
        if type(event) is not StepTiming:
            out.append(encode(event))
        elif event is timings[0]:
            out.append(encode_step_timings(timings))
    return out


class TelemetryShipper:
    """Batches the events of one run and produces them from a background thread: one
    Kafka record per node per flush. A real node runs one shipper for its local ranks;
    the simulator runs one for the whole simulated cluster."""

    def __init__(
        self,
        config: ShipperConfig,
        run_id: str,
        world_size: int,
        on_flush: Callable[[], None] | None = None,
        name: str = "",
        on_outcome: DeliveryHook | None = None,
    ) -> None:
        self.config = config
        self._on_outcome = on_outcome
        self.run_id = run_id
        self.world_size = world_size
        self.producer_id = f"{name or 'shipper'}-{uuid.uuid4().hex[:12]}"
        self.stats = ShipperStats()
        self._on_flush = on_flush
        self._queue: deque[Envelope] = deque()
        #: Events taken from the queue and not yet delivered, failed or put back.
        self._handed = 0
        self._handover_limit = max(1, config.max_queued_events // 2)
        self._lock = threading.Lock()
        self._seq = 0
        self._shard_size = shard_size(world_size, config.shard_ranks)
        self._shards = shard_count(world_size, self._shard_size)
        self._partitions: int | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ship now, not at the next interval (wake())
        self._producer = Producer(
            client_config(
                {**PRODUCER_DEFAULTS, **config.producer, "bootstrap.servers": config.bootstrap},
                config.credentials,
            )
        )
        self._thread = threading.Thread(target=self._run, name=f"trainguard-{self.producer_id}", daemon=True)
        self._metadata = threading.Thread(target=self._learn_partitions, name="tg-metadata", daemon=True)
        self._metadata.start()
        self._thread.start()

    # ------------------------------------------------------------------ hot path
    def submit(self, event: Envelope) -> bool:
        """Queue one event; O(1), never blocks on I/O. False when an event was dropped for it
        (the oldest queued one; this one if librdkafka holds the whole bound)."""
        with self._lock:
            self.stats.submitted += 1
            if len(self._queue) + self._handed >= self.config.max_queued_events:
                self.stats.dropped += 1
                if not self._queue:
                    self._tell(DeliveryOutcome.DROPPED, [event])
                    return False
                self._tell(DeliveryOutcome.DROPPED, [self._queue.popleft()])
                self._queue.append(event)
                return False
            self._queue.append(event)
            return True

    # ------------------------------------------------------------------ background
    def _take(self) -> list[Envelope]:
        with self._lock:
            room = max(0, self._handover_limit - self._handed)
            n = min(len(self._queue), self.config.max_batch_events, room)
            self._handed += n
            return [self._queue.popleft() for _ in range(n)]

    def _requeue_front(self, events: list[Envelope]) -> None:
        """librdkafka's queue is full: put events back, oldest dropped beyond the bound."""
        with self._lock:
            self._handed -= len(events)
            room = self.config.max_queued_events - len(self._queue) - self._handed
            keep = events[-room:] if room > 0 else []
            self.stats.dropped += len(events) - len(keep)
            self._tell(DeliveryOutcome.DROPPED, events[: len(events) - len(keep)])
            self._queue.extendleft(reversed(keep))

    def _tell(self, outcome: DeliveryOutcome, events: Sequence[Envelope]) -> None:
        if self._on_outcome is not None and events:
            self._on_outcome(outcome, events)

    def _delivery(self, events: list[Envelope]) -> Callable[[KafkaError | None, Message], None]:
        count = len(events)

        def done(err: KafkaError | None, _msg: Message) -> None:
            with self._lock:
                self._handed -= count
                if err is None:
                    self.stats.delivered += count
                else:
                    self.stats.failed += count
                self._tell(DeliveryOutcome.DELIVERED if err is None else DeliveryOutcome.FAILED, events)

        return done

    def _learn_partitions(self) -> None:
        """The telemetry topic's partition count (records are placed explicitly, so that
        a run's shards land on consecutive partitions and the processor's own records for
        the run land where the run's are). Its own thread: a broker that is down must not
        delay the flush loop, which carries the heartbeats."""
        while not self._lookup_partitions(self.config.metadata_timeout_s) and not self._stop.is_set():
            self._stop.wait(0.5)

    def _lookup_partitions(self, timeout_s: float) -> bool:
        if self._partitions is not None:
            return True
        topic = self.config.topic
        try:
            meta = self._producer.list_topics(topic, timeout=max(0.1, timeout_s)).topics.get(topic)
        except KafkaException as exc:
            log.warning("no metadata for %s yet: %s", topic, exc)
            return False
        if meta is None or meta.error is not None or not meta.partitions:
            return False
        self._partitions = len(meta.partitions)
        return True

    def _ship_once(self) -> None:
        partitions = self._partitions
        if partitions is None:
            return  # events stay queued (bounded; overflow is dropped and counted)
        while events := self._take():
            records = pack(
                events,
                self.run_id,
                self.world_size,
                self._shard_size,
                self.producer_id,
                self._seq,
                self.config.columnar,
            )
            for i, record in enumerate(records):
                try:
                    self._producer.produce(
                        self.config.topic,
                        key=record.key,
                        partition=telemetry_partition(self.run_id, record.shard, self._shards, partitions),
                        value=record.value,
                        on_delivery=self._delivery(record.counted),
                    )
                except BufferError:
                    # Copies to other shards of an event whose first copy was sent are
                    # not retried (only the run's start is copied; shards dedupe it).
                    self._requeue_front([e for r in records[i:] for e in r.counted])
                    self._producer.poll(0)
                    return
                except KafkaException as exc:  # e.g. a record too large: lost, and counted
                    log.error("cannot produce a batch of %d events: %s", len(record.counted), exc)
                    with self._lock:
                        self.stats.failed += len(record.counted)
                        self._handed -= len(record.counted)
                        self._tell(DeliveryOutcome.FAILED, record.counted)
                    self._seq = record.seq + 1  # the gap in seq shows the loss downstream
                    continue
                self._seq = record.seq + 1
                self.stats.batches_sent += 1
        self._producer.poll(0)

    def _run(self) -> None:
        next_flush = time.monotonic()
        while not self._stop.is_set():
            try:  # this thread must outlive any one bad flush: heartbeats depend on it
                if self._on_flush is not None:
                    self._on_flush()
                self._ship_once()
            except Exception:
                log.exception("telemetry flush failed; continuing")
            # Fell behind: start the next interval now rather than catch up in a burst.
            next_flush = max(next_flush + self.config.flush_interval_s, time.monotonic())
            # poll() serves delivery callbacks while we wait for the next flush.
            while not self._stop.is_set() and (left := next_flush - time.monotonic()) > 0:
                if self._wake.is_set():
                    self._wake.clear()
                    break
                self._producer.poll(min(left, 0.05))

    # ------------------------------------------------------------------ lifecycle
    def wake(self) -> None:
        """Ship what is queued now (within the thread's next 50 ms poll), without waiting
        for it: an event a decision waits on (the launcher's RankExit after a crash)."""
        self._wake.set()

    def flush_now(self, timeout_s: float = 10.0) -> None:
        """Ship what is queued and wait (bounded) for delivery. Not for the training step."""
        self._ship_once()
        self._producer.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> ShipperStats:
        """Stop the thread, ship what is left, wait up to timeout_s; undelivered events
        left in librdkafka are purged and counted as failed, so the counters add up."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + timeout_s
        self._lookup_partitions(timeout_s / 2)  # closing may wait, within timeout_s
        while True:
            self._ship_once()
            remaining = self._producer.flush(max(0.0, deadline - time.monotonic()))
            if not self._queue or time.monotonic() >= deadline:
                break
        if remaining or self._queue:
            self._producer.purge()  # purged messages report their error via poll()
            self._producer.poll(0)
            self._producer.flush(0)
            with self._lock:
                self.stats.dropped += len(self._queue)
                self._tell(DeliveryOutcome.DROPPED, list(self._queue))
                self._queue.clear()
        return self.stats

    def __enter__(self) -> TelemetryShipper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
