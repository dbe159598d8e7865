"""Recover one telemetry partition's core state from the log (the I/O half of
processors/partitions.py).

A worker that gets a partition (at start, after a rebalance, after a crash) knows only
the offset faust hands it first: the group's committed offset. Every record below it
was folded and its outputs delivered by some earlier holder. So:

1. load the partition's newest snapshot (processors/snapshot.py), if any valid one;
2. fold the partition's records from the snapshot's offset (or the log's start) up to
   the first offset, with their outputs discarded: they were published already;
3. list the outputs published since the snapshot was taken (derived events and commands
   by id, dead letters by source record): the earlier holder may have processed records
   at and after the committed offset, published their outputs and died before
   committing. Folding those records again re-makes the same outputs, which the book
   then drops instead of publishing twice.

Step 2 costs the records since the last snapshot, not the run's history. Without any
snapshot, it folds the partition from the start of what retention kept, and says so.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from ..kafka.security import client_config
from ..kafka.topics import TopicNames
from ..schemas import Command, Derived, decode
from ..schemas.codec import Rejected
from .core import CoreState, RunState
from .driver import CoreDriver
from .snapshot import Snapshot, SnapshotError, decode_snapshot

log = logging.getLogger("trainguard.recovery")

#: How far before a snapshot's wall clock to look for outputs made after it: covers the
#: clock skew between two processor hosts (NTP keeps it to milliseconds; this is ample).
CLOCK_MARGIN_S = 60.0


@dataclass
class Recovered:
    partition: int
    runs: dict[str, RunState]
    next_offset: int
    #: Output ids already published since the snapshot, and the telemetry offset up to
    #: which a record may have been processed before (the partition's end at recovery).
    published: set[str]
    published_until: int
    snapshot_offset: int | None
    #: Records folded from the log (after the snapshot) to reach `next_offset`.
    replayed: int
    seconds: float
    #: Seconds of each part: loading the snapshot, folding the records after it, listing
    #: the outputs published since it.
    snapshot_s: float = 0.0
    fold_s: float = 0.0
    published_s: float = 0.0
    #: The outputs of the replayed records (already published): for the API's view.
    derived: list[Derived] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _consumer(bootstrap: str, config: dict[str, object] | None = None) -> Consumer:
    defaults = {
        "bootstrap.servers": bootstrap,
        "group.id": f"trainguard-recovery-{uuid.uuid4().hex}",  # never commits
        "enable.auto.commit": False,
        "enable.partition.eof": False,
        # It reads ranges of records that are there already: librdkafka's default (500 ms)
        # let the broker hold fetches that much, and every range waited it out (issue 49).
        "fetch.wait.max.ms": 10,
        **(config or {}),
    }
    return Consumer(client_config(defaults))  # SASL settings from the environment, if any


def read_range(
    consumer: Consumer, topic: str, partition: int, start: int, end: int, timeout_s: float = 60.0
) -> Iterator[Message]:
    """The records of one partition with offsets in [start, end), in order."""
    if start >= end:
        return
    consumer.assign([TopicPartition(topic, partition, start)])
    deadline = time.monotonic() + timeout_s
    expected = start  # the next offset wanted
    try:
        while True:
            # consume() waits for its whole batch or its timeout: ask for no more than the
            # range still holds, or every range's last batch costs the full timeout (the
            # snapshot's, and each output partition's: seconds of a recovery, issue 49).
            messages = consumer.consume(max(1, min(500, end - expected)), timeout=0.5)
            for message in messages:
                if (error := message.error()) is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(error)
                if (message.offset() or 0) >= end:
                    return
                expected = (message.offset() or 0) + 1
                yield message
                deadline = time.monotonic() + timeout_s  # progress: a long range is fine
            position = consumer.position([TopicPartition(topic, partition)])[0].offset
            if position >= end:  # compaction or aborted batches may leave offset gaps
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}[{partition}]: no record for {timeout_s:g} s below offset {end}")
    finally:
        consumer.unassign()


def newest_snapshot(
    consumer: Consumer, topic: str, partition: int, telemetry: str, key: bytes
) -> tuple[Snapshot | None, list[str]]:
    """The newest valid snapshot of telemetry partition `partition`, looking back from the
    end of its snapshot partition past any that fail to load (each named in warnings)."""
    warnings: list[str] = []
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
    wanted = f"{telemetry}:{partition}".encode()
    end, step = high, 1  # the newest first: a snapshot is MiBs, and it is nearly always good
    while end > low:
        start = max(low, end - step)
        step = 8
        candidates = [m for m in read_range(consumer, topic, partition, start, end) if m.key() == wanted]
        for message in reversed(candidates):
            try:
                return decode_snapshot(message.value() or b"", key), warnings
            except SnapshotError as exc:
                warnings.append(f"snapshot at {topic}[{partition}]@{message.offset()} not loaded: {exc}")
        end = start
    return None, warnings


def read_ranges(
    consumer: Consumer, ranges: dict[tuple[str, int], tuple[int, int]], timeout_s: float = 60.0
) -> Iterator[Message]:
    """The records of several partitions, each in [start, end), read together (one fetch
    round for all of them rather than one per partition); in order within a partition."""
    left = {tp: (start, end) for tp, (start, end) in ranges.items() if start < end}
    if not left:
        return
    consumer.assign([TopicPartition(topic, p, start) for (topic, p), (start, _) in left.items()])
    deadline = time.monotonic() + timeout_s
    try:
        while left:
            wanted = sum(end - start for start, end in left.values())
            for message in consumer.consume(max(1, min(500, wanted)), timeout=0.5):
                if (error := message.error()) is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(error)
                key = (message.topic() or "", message.partition() or 0)
                offset = message.offset() or 0
                if key not in left or offset >= left[key][1]:
                    continue
                left[key] = (offset + 1, left[key][1])
                if offset + 1 >= left[key][1]:
                    del left[key]
                yield message
                deadline = time.monotonic() + timeout_s
            for tp in consumer.position([TopicPartition(t, p) for t, p in left]):
                if tp.offset >= left[(tp.topic, tp.partition)][1]:  # gaps: compaction, markers
                    del left[(tp.topic, tp.partition)]
            if left and time.monotonic() > deadline:
                raise TimeoutError(f"no record for {timeout_s:g} s from {sorted(left)}")
    finally:
        consumer.unassign()


def published_since(consumer: Consumer, names: TopicNames, since_ts: float | None) -> set[str]:
    """Ids of the outputs on the output topics from `since_ts` (None: from the start)."""
    ranges: dict[tuple[str, int], tuple[int, int]] = {}
    for topic in (names.events, names.commands, names.deadletter):
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        # [start, end) per partition, from one watermark query each; start -1: nothing to read
        for p in partitions:
            ranges[(topic, p)] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if since_ts is not None:
            asked = [TopicPartition(topic, p, int(since_ts * 1000)) for p in partitions]
            for tp in consumer.offsets_for_times(asked, timeout=10):
                # -1: no record that recent on this partition
                low, high = ranges[(topic, tp.partition)]
                ranges[(topic, tp.partition)] = (max(low, tp.offset) if tp.offset >= 0 else high, high)
    ids = {_output_id(m.topic() == names.deadletter, m) for m in read_ranges(consumer, ranges)}
    ids.discard("")
    return ids


def _output_id(deadletter: bool, message: Message) -> str:
    if deadletter:  # a rejection is identified by the record it came from
        headers: list[tuple[str, bytes]] = list(message.headers() or [])  # type: ignore[arg-type]
        return next((raw.decode(errors="replace") for name, raw in headers if name == "source" and raw), "")
    try:
        record = decode(message.value() or b"")
    except Rejected:  # not a trainguard record (a principal allowed to write there erred)
        return ""
    return record.command_id if isinstance(record, Command) else getattr(record, "event_id", "")


def recover_partition(
    bootstrap: str,
    names: TopicNames,
    partition: int,
    first_offset: int,
    driver: CoreDriver,
    snapshot_key: bytes | None,
) -> Recovered:
    """The state of telemetry partition `partition` up to `first_offset` (see module doc).
    `driver` only lends its policy and secret: the fold runs on a private core, so the
    caller's state is untouched until it swaps the result in."""
    t0 = time.perf_counter()
    consumer = _consumer(bootstrap)
    try:
        snapshot: Snapshot | None = None
        warnings: list[str] = []
        if snapshot_key is not None:
            snapshot, warnings = newest_snapshot(
                consumer, names.snapshots, partition, names.telemetry, snapshot_key
            )
        t_snapshot = time.perf_counter()
        low, high = consumer.get_watermark_offsets(TopicPartition(names.telemetry, partition), timeout=10)
        runs = dict(snapshot.runs) if snapshot is not None else {}
        start = snapshot.offset if snapshot is not None else low
        if start < low:
            warnings.append(
                f"records {start}..{low - 1} of {names.telemetry}[{partition}] were deleted by retention "
                "before this recovery: the state misses them"
            )
        elif snapshot is None and low > 0:
            warnings.append(f"no snapshot, and the log of {names.telemetry}[{partition}] starts at {low}")
        core = CoreDriver(driver.policy, driver.master_secret, state=CoreState(runs=runs))
        out = Recovered(
            partition,
            runs,
            next_offset=max(first_offset, snapshot.offset if snapshot is not None else 0),
            published=set(),
            published_until=high,
            snapshot_offset=snapshot.offset if snapshot is not None else None,
            replayed=0,
            seconds=0.0,
            warnings=warnings,
        )
        for message in read_range(consumer, names.telemetry, partition, max(start, low), first_offset):
            result = core.handle(message.value() or b"")
            out.replayed += 1
            out.derived += result.derived
            out.commands += result.commands
        t_fold = time.perf_counter()
        since = snapshot.wall_ts - CLOCK_MARGIN_S if snapshot is not None else None
        out.published = published_since(consumer, names, since)
        out.seconds = time.perf_counter() - t0
        out.snapshot_s, out.fold_s = t_snapshot - t0, t_fold - t_snapshot
        out.published_s = out.seconds - (t_fold - t0)
        return out
    finally:
        consumer.close()
