"""The archive writer: every trainguard topic, consumed into the archive (a Delta Lake
root, sinks/lake.py).

Each batch records, with its rows and in the same commit point, the next offset of every
partition it read; a writer that starts (after a crash, a rebalance, or in a new consumer
group) resumes each partition from the archive's own offset where it has one, so a killed
writer neither loses nor stores a record twice. Offsets are also committed to the group
after each batch, for lag monitoring and for partitions the archive has not seen yet; the
archive's deduplicating views (:mod:`.archive_tables`) absorb what a rebalance between two
writers or a producer's retry delivers twice. A record that cannot be decoded is stored
as a dead letter with its reason and bytes; it never stops the writer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, TopicPartition

from trainguard.kafka.security import KafkaCredentials, client_config
from trainguard.kafka.topics import TopicNames

from ..schemas import Rejected, decode
from ..schemas.codec import ACKS, COMMANDS, DERIVED, decode_parts, events_of
from ..schemas.record_columns import record_columns
from ..schemas.sharding import run_of_key
from .archive_metrics import ArchiveMetrics
from .archive_store import (
    Archive,
    DeadLetter,
    Item,
    Located,
    Logged,
    WriteResult,
    goodput_breakdown,
    summary,
    timeline,
)

__all__ = [
    "Archive", "ArchiveWriter", "DeadLetter", "Item", "Located", "Logged", "Role", "WriteResult",
    "WriterStats", "decode_message", "goodput_breakdown", "summary", "timeline",
]  # fmt: skip

log = logging.getLogger(__name__)


def archive_group(topics: TopicNames) -> str:
    """The writers' consumer group: one per topic set (like the processor's app id), so
    that writers of another prefix never share, or wait on, its rebalances."""
    return topics.telemetry.removesuffix("telemetry") + "archive"


def archived_topics(topics: TopicNames) -> list[str]:
    """The topics the writer stores, in Role order (not the run registry, not the
    processors' snapshots)."""
    return [topics.telemetry, topics.events, topics.commands, topics.acks, topics.deadletter]


class Role(StrEnum):
    TELEMETRY = "telemetry"
    EVENTS = "events"
    COMMANDS = "commands"
    ACKS = "acks"
    DEADLETTER = "deadletter"


_REGISTRY = {Role.EVENTS: DERIVED, Role.COMMANDS: COMMANDS, Role.ACKS: ACKS}


Headers = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]] | None


def _header(headers: Headers, name: str) -> str:
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    for key, value in pairs:
        if key == name and value is not None:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return ""


def offset_key(topic: str, partition: int) -> str:
    """A partition's key in the archive's batch marks ("topic:partition")."""
    return f"{topic}:{partition}"


def _where(msg: Message) -> tuple[str, int, int]:
    topic, part, off = msg.topic(), msg.partition(), msg.offset()
    assert topic is not None and part is not None and off is not None, "a consumed record has a position"
    return topic, part, off


def decode_message(role: Role, msg: Message) -> list[Item]:
    """The archive items of one Kafka record; never raises on bad bytes (they become dead letters)."""
    topic, part, off = _where(msg)
    position = f"{topic}:{part}:{off}"
    _, ts_ms = msg.timestamp()
    ts = ts_ms / 1000 if ts_ms > 0 else time.time()
    raw = msg.value() or b""
    if role is Role.DEADLETTER:
        reason = _header(msg.headers(), "reason") or "unknown"
        return [DeadLetter(position, topic, reason, _header(msg.headers(), "detail"), raw, ts)]
    if role is Role.TELEMETRY:
        decoded = decode_parts(raw)
        events = events_of(decoded)
        # As consumed, for replays: the bytes, and the columns of a common record.
        items: list[Item] = [Logged(run_of_key(msg.key()), part, off, ts, raw, record_columns(decoded))]
        if events:
            items.append(Located(events, topic, part, off))
        whole = decoded.header is None and not events
        for i, rej in enumerate(decoded.rejections):
            ident = position if whole else f"{position}:{i}"
            items.append(DeadLetter(ident, topic, str(rej.reason), rej.detail, rej.raw, ts))
        return items
    try:
        return [Located([decode(raw, _REGISTRY[role])], topic, part, off)]
    except Rejected as rej:
        return [DeadLetter(position, topic, str(rej.reason), rej.detail, raw, ts)]


@dataclass(frozen=True)
class Maintenance:
    """How the writer keeps the lake small: every `every_s` it merges each table's small
    files (a batch writes one per partition), drops the hours of a table older than its
    retention (`retain_s`: table -> seconds; tables partitioned by hour only) and deletes
    files no reader has needed for `vacuum_hours`."""

    every_s: float = 300.0
    retain_s: Mapping[str, float] = field(default_factory=dict)
    vacuum_hours: int = 1


@dataclass
class WriterStats:
    """Running totals of an ArchiveWriter."""

    consumed: int = 0  # Kafka records
    batches: int = 0  # DuckDB transactions
    rows: Counter[str] = field(default_factory=Counter)  # inserted, per table
    duplicates: Counter[str] = field(default_factory=Counter)  # already stored, per table
    commit_failures: int = 0
    maintenance_s: float = 0.0

    def add(self, result: WriteResult) -> None:
        self.batches += 1
        self.rows.update(result.inserted)
        self.duplicates.update(result.duplicates)


class ArchiveWriter:
    """Consumes every trainguard topic into an Archive, committing offsets only after the rows are durable."""

    def __init__(
        self,
        bootstrap: str,
        topics: TopicNames,
        db_path: str | Path,
        group_id: str | None = None,
        *,
        storage_options: dict[str, str] | None = None,
        maintenance: Maintenance | None = None,
        metrics: ArchiveMetrics | None = None,
        batch_size: int = 5000,
        max_events_per_write: int = 200_000,
        poll_timeout_s: float = 0.5,
        consumer_config: dict[str, Any] | None = None,
        credentials: KafkaCredentials | None = None,
    ) -> None:
        self.roles = dict(zip(archived_topics(topics), Role, strict=True))
        self.batch_size = batch_size
        self.max_events_per_write = max_events_per_write
        self.poll_timeout_s = poll_timeout_s
        self.stats = WriterStats()
        self.maintenance = maintenance or Maintenance()
        self.metrics = metrics or ArchiveMetrics()
        self._maintained_at = time.monotonic()
        self._next: dict[tuple[str, int], int] = {}  # next offset to read, per partition, as consumed
        self._uncommitted: dict[tuple[str, int], int] = {}  # stored, offset commit still to do
        self.archive = Archive(db_path, storage_options)
        self._consumer = Consumer(
            client_config(
                {
                    "bootstrap.servers": bootstrap,
                    "group.id": group_id or archive_group(topics),
                    "enable.auto.commit": False,
                    "auto.offset.reset": "earliest",
                    # A writer that died without leaving holds its partitions this long before a
                    # restarted one gets them (librdkafka's default is 45 s).
                    "session.timeout.ms": 10_000,
                    **(consumer_config or {}),
                },
                credentials,
            )
        )
        self._consumer.subscribe(list(self.roles), on_assign=self._resume_from_archive)

    def _resume_from_archive(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Start each partition where the archive's last batch left it (its own record beats
        the group's commit, which may lag it or belong to another archive)."""
        stored = self.archive.mark.offsets
        for tp in partitions:
            at = stored.get(offset_key(tp.topic, tp.partition))
            if at is not None:
                tp.offset = at
                self._next[(tp.topic, tp.partition)] = at
                self._uncommitted[(tp.topic, tp.partition)] = at  # the group's lag is the archive's
        consumer.assign(partitions)

    def poll_once(self) -> int:
        """Consume up to batch_size records; store them (one transaction per max_events_per_write
        events, which bounds memory when batches are large), then commit their offsets.
        Returns the number of records consumed."""
        messages = self._consumer.consume(num_messages=self.batch_size, timeout=self.poll_timeout_s)
        items: list[Item] = []
        ends: dict[tuple[str, int], int] = {}
        events = consumed = 0
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.fatal():
                    raise KafkaException(error)
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("archive consumer: %s", error)
                continue
            topic, part, off = _where(msg)
            decoded = decode_message(self.roles[topic], msg)
            items += decoded
            events += sum(len(i.records) if isinstance(i, Located) else 1 for i in decoded)
            ends[(topic, part)] = off + 1
            consumed += 1
            if events >= self.max_events_per_write:
                self._store(items, ends, consumed)
                items, ends, events, consumed = [], {}, 0, 0
        if ends:
            self._store(items, ends, consumed)
        else:
            self._commit()  # retry a commit that failed earlier, if any
        return sum(1 for msg in messages if msg.error() is None)

    def _store(self, items: list[Item], ends: dict[tuple[str, int], int], records: int) -> None:
        """One transaction, then the offsets: never commit past what is durably written."""
        offsets = {offset_key(topic, part): end for (topic, part), end in ends.items()}
        try:
            result = self.archive.write(items, offsets)
        except Exception:
            self.metrics.errors.labels(stage="write").inc()
            raise
        self.stats.add(result)
        self.stats.consumed += records
        for table, rows in result.inserted.items():
            self.metrics.rows.labels(table=table).inc(rows)
        self.metrics.records.inc(records)
        self.metrics.batches.inc()
        self.metrics.last_commit.set_to_current_time()
        self._next.update(ends)
        self._uncommitted.update(ends)
        self._commit()

    def _commit(self) -> bool:
        """Commit the offsets of everything stored. A failure is kept for the next try: the rows are
        durable, so at worst the records are read again and insert nothing."""
        if not self._uncommitted:
            return True
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        offsets = [TopicPartition(t, p, end) for (t, p), end in self._uncommitted.items() if (t, p) in owned]
        try:
            if offsets:
                self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            self.stats.commit_failures += 1
            self.metrics.errors.labels(stage="offset_commit").inc()
            log.warning("archive offset commit failed (will retry; re-reads are harmless): %s", exc)
            return False
        self._uncommitted.clear()  # committed, or no longer ours after a rebalance
        return True

    def run(self, stop_event: threading.Event | None = None, max_idle_s: float | None = None) -> WriterStats:
        """Archive until `stop_event` is set or nothing arrived for `max_idle_s` seconds."""
        idle_since = time.monotonic()
        while stop_event is None or not stop_event.is_set():
            if time.monotonic() - self._maintained_at >= self.maintenance.every_s:
                self.maintain()
            if self.poll_once():
                idle_since = time.monotonic()
            elif max_idle_s is not None and time.monotonic() - idle_since >= max_idle_s:
                break
        return self.stats

    def maintain(self) -> None:
        """Compaction, retention and vacuum between two batches (the writer is the lake's only
        writer, so nothing else commits meanwhile)."""
        started = time.monotonic()
        try:
            self.archive.maintain(self.maintenance.retain_s, self.maintenance.vacuum_hours)
        except Exception:  # the rows are safe; the next pass tries again
            self.metrics.errors.labels(stage="maintenance").inc()
            log.exception("archive maintenance failed (the next pass retries)")
        self._maintained_at = time.monotonic()
        self.stats.maintenance_s += self._maintained_at - started
        self.metrics.maintenance_seconds.inc(self._maintained_at - started)

    def run_until_caught_up(self, timeout_s: float = 60.0) -> WriterStats:
        """Archive up to the end offsets the topics have now; TimeoutError if that takes over timeout_s."""
        deadline = time.monotonic() + timeout_s
        ends, committed = self._starting_point(deadline)
        pending = self._behind(ends, committed)
        while pending or not self._commit():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"archive not caught up after {timeout_s:g} s on {sorted(pending)}")
            if pending:
                self.poll_once()
                pending = self._behind(pending, [])
            else:
                time.sleep(0.2)
        return self.stats

    def _starting_point(self, deadline: float) -> tuple[dict[tuple[str, int], int], list[TopicPartition]]:
        """End offset of every partition, and what this group committed in an earlier run or
        the archive stored (which counts as read). Retried until `deadline`: a broker that
        just started or just created the topics answers NOT_LEADER_FOR_PARTITION or
        NOT_COORDINATOR for a moment."""
        while True:
            try:
                metadata = self._consumer.list_topics(timeout=max(0.1, deadline - time.monotonic())).topics
                parts = [TopicPartition(t, p) for t in self.roles for p in metadata[t].partitions]
                ends = {
                    (tp.topic, tp.partition): self._consumer.get_watermark_offsets(tp, timeout=10)[1]
                    for tp in parts
                }
                stored = self.archive.mark.offsets
                archived = [
                    TopicPartition(tp.topic, tp.partition, stored[offset_key(tp.topic, tp.partition)])
                    for tp in parts
                    if offset_key(tp.topic, tp.partition) in stored
                ]
                return ends, [*self._consumer.committed(parts, timeout=10), *archived]
            except KafkaException as exc:
                if time.monotonic() >= deadline:
                    raise
                log.debug("end offsets not available yet, retrying: %s", exc)
                time.sleep(0.2)

    def _behind(
        self, ends: dict[tuple[str, int], int], committed: list[TopicPartition]
    ) -> dict[tuple[str, int], int]:
        """The partitions of `ends` not yet read up to their end offset. The consumer's position
        also counts: it moves past offsets that hold no record (transaction markers, compaction)."""
        reached = dict(self._next)
        positions = self._consumer.position([TopicPartition(t, p) for t, p in ends])
        for tp in [*positions, *committed]:
            if tp.offset != OFFSET_INVALID and tp.offset >= 0:
                key = (tp.topic, tp.partition)
                reached[key] = max(reached.get(key, 0), tp.offset)
        return {tp: end for tp, end in ends.items() if reached.get(tp, 0) < end}

    def close(self) -> None:
        """Commit what is stored (best effort), leave the group, release the archive."""
        try:
            self._commit()
            self._consumer.close()
        finally:
            self.archive.close()

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
