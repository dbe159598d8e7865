"""The archive's storage side: records in, rows of the lake out (sinks/lake.py), and the
queries on them.

Every table is keyed by the record's own identity (event_id, command_id, the Kafka
position of a dead letter) and readers see the first row stored of each key, so storing
the same records twice shows them once: that, with the writer resuming from the offsets
its last batch recorded, is what lets the Kafka writer (:mod:`trainguard.sinks.archive`)
deliver at least once and lose nothing when killed.

Readers open a snapshot (an in-memory DuckDB over the lake's files as of the newest batch),
so they never wait on the writer and never see part of a batch; any number of processes
read while one writes.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

import duckdb
import orjson
import pyarrow as pa

from ..schemas import (
    Ack,
    Command,
    Derived,
    Envelope,
    Interruption,
    InterruptionRecovered,
    Record,
    RunStarted,
    encode,
)
from ..schemas.codec import TELEMETRY
from ..schemas.record_columns import TABLE_COLUMNS as RECORD_COLUMNS
from ..schemas.record_columns import RecordColumns
from .archive_schema import (
    ACK,
    COMMAND,
    DEAD_LETTER,
    HOUR,
    INTERRUPTION_DETECTED,
    INTERRUPTION_RECOVERED,
    KEYS,
    PARTITIONS,
    RAW_EVENT,
    RETAINED_WITH,
    RUN_ACTIVITY,
    RUN_ATTEMPT,
    SCHEMA_VERSION,
    SUMMARY_RELATIONS,
    TELEMETRY_COLUMNS,
    TELEMETRY_LOG,
)
from .archive_tables import hour_of, snapshot, to_arrow
from .lake import BATCHES, Lake, WriterLock, is_uri

# --------------------------------------------------------------------------- items


@dataclass(frozen=True, slots=True)
class Located:
    """The records decoded from one Kafka record (a telemetry batch holds many) and its position."""

    records: Sequence[Record]
    topic: str
    partition: int | None = None
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Bytes that could not be archived as a record, kept with why."""

    id: str
    topic: str
    reason: str
    detail: str
    raw: bytes
    ts: float


@dataclass(frozen=True, slots=True)
class Logged:
    """A telemetry record's bytes, kept verbatim for replays (telemetry_log)."""

    run_id: str
    partition: int
    offset: int
    ts: float
    value: bytes
    #: Its columns when it is a common record (schemas/record_columns.py: telemetry_columns).
    columns: RecordColumns | None = None


#: What Archive.write takes: a bare record (tests, tools), records read from Kafka, a
#: telemetry record's bytes, or a dead letter.
Item: TypeAlias = Record | Located | Logged | DeadLetter

# Columns each write fills, in the order of the row tuples built below; their types come from
# the DDL (read back from the database). run_activity is filled in SQL from the incoming events.
_COLUMNS: dict[str, tuple[str, ...]] = {
    RAW_EVENT: (
        "event_id", "topic", "kind", "schema_version", "run_id", "attempt", "rank", "node", "step", "ts",
        "payload", "kafka_partition", "kafka_offset",
    ),
    RUN_ATTEMPT: (
        "run_id", "attempt", "world_size", "ranks_per_node", "nodes", "resumed_from_step", "config_digest",
        "started_at", "event_id",
    ),
    INTERRUPTION_DETECTED: (
        "interruption_id", "run_id", "attempt", "at", "detected_by", "cause", "node_id", "rank", "lost_steps",
        "last_checkpoint_step", "reason_code", "reason_text", "event_id",
    ),
    INTERRUPTION_RECOVERED: (
        "interruption_id", "run_id", "restart_seconds", "resumed_attempt", "recovered_at", "event_id",
    ),
    COMMAND: (
        "command_id", "kind", "run_id", "attempt", "ranks", "issued_ts", "reason_code", "reason_text",
        "payload", "kafka_partition", "kafka_offset",
    ),
    ACK: (
        "command_id", "rank", "status", "command_kind", "run_id", "attempt", "node", "detail", "ts",
        "kafka_partition", "kafka_offset",
    ),
    DEAD_LETTER: ("id", "topic", "reason", "detail", "raw", "ts"),
    TELEMETRY_LOG: ("run_id", "kafka_partition", "kafka_offset", "ts", "value"),
    TELEMETRY_COLUMNS: ("run_id", "kafka_partition", "kafka_offset", "ts", *RECORD_COLUMNS),
}  # fmt: skip

#: Tables whose rows are facts (counted as written or duplicate).
FACT_TABLES = tuple(_COLUMNS)
_ROW_TABLES = tuple(t for t in FACT_TABLES if t != RAW_EVENT)
#: Telemetry kinds that only make a raw_event row (the bulk: skip the per-kind dispatch).
_PLAIN: frozenset[type[Record]] = frozenset(cls for cls in TELEMETRY.values() if cls is not RunStarted)

_INT64 = (-(2**63), 2**63 - 1)
UNARCHIVABLE = "unarchivable"


def _logical_topic(record: Record) -> str:
    """Topic role of a record handed to write() without a Kafka position (tests, tools)."""
    if isinstance(record, Command):
        return "commands"
    if isinstance(record, Ack):
        return "acks"
    return "events" if isinstance(record, Derived) else "telemetry"


def _rows_of(rec: Record, part: int | None, off: int | None) -> list[tuple[str, tuple[Any, ...]]]:
    """(table, row) pairs a record contributes besides its raw_event row, in _COLUMNS order."""
    row: tuple[Any, ...]
    if isinstance(rec, Envelope):
        if isinstance(rec, RunStarted):
            nodes = orjson.dumps(rec.nodes).decode()
            row = (rec.run_id, rec.attempt, rec.world_size, rec.ranks_per_node, nodes, rec.resumed_from_step,
                   rec.config_digest, rec.ts, rec.event_id)  # fmt: skip
            return [(RUN_ATTEMPT, row)]
        if isinstance(rec, Interruption):
            row = (rec.interruption_id, rec.run_id, rec.attempt, rec.ts, rec.detected_by, str(rec.cause),
                   rec.node, rec.rank, rec.lost_steps, rec.last_checkpoint_step, str(rec.reason.code),
                   rec.reason.text, rec.event_id)  # fmt: skip
            return [(INTERRUPTION_DETECTED, row)]
        if isinstance(rec, InterruptionRecovered):
            row = (rec.interruption_id, rec.run_id, rec.restart_s, rec.resumed_attempt, rec.ts, rec.event_id)
            return [(INTERRUPTION_RECOVERED, row)]
        return []
    if isinstance(rec, Command):
        ranks = None if rec.ranks is None else orjson.dumps(rec.ranks).decode()
        row = (rec.command_id, rec.KIND, rec.run_id, rec.attempt, ranks, rec.issued_ts, str(rec.reason.code),
               rec.reason.text, encode(rec).decode(), part, off)  # fmt: skip
        return [(COMMAND, row)]
    if isinstance(rec, Ack):
        row = (rec.command_id, rec.rank, str(rec.status), rec.command_kind, rec.run_id, rec.attempt, rec.node,
               rec.detail, rec.ts, part, off)  # fmt: skip
        return [(ACK, row)]
    raise TypeError(f"the archive does not store {type(rec).__name__} records")


def _fits_int64(rec: Record, rows: list[tuple[str, tuple[Any, ...]]]) -> bool:
    lo, hi = _INT64
    ints = [v for _, row in rows for v in row if type(v) is int]
    if isinstance(rec, Envelope):
        ints += [rec.attempt, rec.rank, rec.step]
    return all(lo <= v <= hi for v in ints)


def _unarchivable(rec: Record, topic: str, part: int | None, off: int | None) -> tuple[Any, ...]:
    """A dead_letter row for a record whose integers do not fit the archive's columns."""
    key = getattr(rec, "event_id", None) or getattr(rec, "command_id", "")
    ts = rec.issued_ts if isinstance(rec, Command) else float(getattr(rec, "ts", 0.0))
    detail = "an integer field is outside the 64-bit range of the archive's columns"
    return (f"{topic}:{part}:{off}:{key}", topic, UNARCHIVABLE, detail, encode(rec), ts)


@dataclass
class _Batch:
    """Events as columns (built with one comprehension per column: no per-row tuples) and the
    rows of the low-volume tables."""

    events: list[Envelope] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    partitions: list[int | None] = field(default_factory=list)
    offsets: list[int | None] = field(default_factory=list)
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=lambda: {t: [] for t in _ROW_TABLES})

    def event_columns(self) -> dict[str, list[Any]]:
        ev = self.events
        return {
            "event_id": [e.event_id for e in ev],
            "topic": self.topics,
            "kind": [e.KIND for e in ev],
            "schema_version": [e.VERSION for e in ev],
            "run_id": [e.run_id for e in ev],
            "attempt": [e.attempt for e in ev],
            "rank": [e.rank for e in ev],
            "node": [e.node for e in ev],
            "step": [e.step for e in ev],
            "ts": [e.ts for e in ev],
            "payload": [encode(e).decode() for e in ev],
            "kafka_partition": self.partitions,
            "kafka_offset": self.offsets,
        }


def _collect(items: Iterable[Item], checked: bool = False) -> _Batch:
    """Sort items into tables. With `checked`, records whose integers overflow become dead letters."""
    batch = _Batch()
    dead = batch.rows[DEAD_LETTER]
    for item in items:
        if isinstance(item, DeadLetter):
            dead.append((item.id, item.topic, item.reason, item.detail, item.raw, item.ts))
            continue
        if isinstance(item, Logged):
            batch.rows[TELEMETRY_LOG].append((item.run_id, item.partition, item.offset, item.ts, item.value))
            if item.columns is not None:
                batch.rows[TELEMETRY_COLUMNS].append(
                    (item.run_id, item.partition, item.offset, item.ts, *item.columns)
                )
            continue
        if isinstance(item, Located):
            records, topic, part, off = item.records, item.topic, item.partition, item.offset
        else:
            records, topic, part, off = (item,), _logical_topic(item), None, None
        for rec in records:
            extra = [] if type(rec) in _PLAIN else _rows_of(rec, part, off)
            if checked and not _fits_int64(rec, extra):
                dead.append(_unarchivable(rec, topic, part, off))
                continue
            if isinstance(rec, Envelope):
                batch.events.append(rec)
                batch.topics.append(topic)
                batch.partitions.append(part)
                batch.offsets.append(off)
            for table, row in extra:
                batch.rows[table].append(row)
    return batch


# --------------------------------------------------------------------------- archive


@dataclass(frozen=True)
class WriteResult:
    """What one write() offered and stored per table. A batch stores each key once; a key
    stored by an earlier batch is stored again and readers see the first (archive_tables)."""

    offered: dict[str, int]
    inserted: dict[str, int]

    @property
    def duplicates(self) -> dict[str, int]:
        """Rows of the batch that repeated a key of the same batch."""
        return {t: self.offered[t] - self.inserted.get(t, 0) for t in self.offered}


class Archive:
    """The archive at one root (a directory or an object-store URI, sinks/lake.py), opened
    to write: one batch at a time, each atomic for readers. Opening it rolls back a batch a
    killed writer left unfinished; a second writer on the same local root is refused."""

    def __init__(self, root: str | Path, storage_options: dict[str, str] | None = None) -> None:
        self.path = root if is_uri(root) else Path(root)
        self.lake = Lake(root, storage_options)
        self._lock = WriterLock(root)
        try:
            self.mark = self.lake.recover(KEYS)
        except BaseException:
            self._lock.release()
            raise
        if self.mark.schema_version > SCHEMA_VERSION:
            self._lock.release()
            raise RuntimeError(
                f"{root} has archive schema version {self.mark.schema_version}, "
                f"newer than this code's {SCHEMA_VERSION}"
            )
        self._snapshot: duckdb.DuckDBPyConnection | None = None

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """A connection showing everything written so far (renewed after each write)."""
        if self._snapshot is None:
            self._snapshot = snapshot(self.lake, self.mark)
        return self._snapshot

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection showing everything written so far, for another thread (close it)."""
        return snapshot(self.lake, self.mark)

    def write(self, items: Iterable[Item], offsets: Mapping[str, int] | None = None) -> WriteResult:
        """Store records and dead letters as ONE batch; `offsets` ("topic:partition" -> next
        offset) are where a writer resumes once the batch is committed."""
        items = list(items)
        seq = self.mark.seq + 1
        try:
            batch = _collect(items)
            tables = self._tables(batch, seq)
        except (OverflowError, pa.ArrowInvalid):
            # A record with an integer beyond 64 bits passed validation: park it, keep the rest.
            batch = _collect(items, checked=True)
            tables = self._tables(batch, seq)
        offered = {t: (len(batch.events) if t == RAW_EVENT else len(batch.rows[t])) for t in FACT_TABLES}
        inserted = dict.fromkeys(FACT_TABLES, 0)
        inserted.update({t: data.num_rows for t, data in tables.items() if t in inserted})
        self.mark = self.lake.commit(tables, PARTITIONS, self.mark, SCHEMA_VERSION, offsets)
        self._forget_snapshot()
        return WriteResult(offered, inserted)

    def maintain(self, retain_s: Mapping[str, float], vacuum_hours: int, now: float | None = None) -> None:
        """Drop hours past each table's retention, compact every table and the batch log,
        vacuum; then a mark with the new versions (the same rows in fewer files, or fewer rows
        after retention). The mark is always the batch log's newest commit: readers find it
        at the log's tail however long the archive stays idle."""
        now = time.time() if now is None else now
        # The batch log gets a small file per batch too; readers read its commits, not its rows.
        self.lake.compact(BATCHES)
        self.lake.vacuum(BATCHES, vacuum_hours)
        versions = dict(self.mark.versions)
        for table in self.mark.versions:
            keep = retain_s.get(table, retain_s.get(RETAINED_WITH.get(table, "")))
            if keep is not None and HOUR in PARTITIONS.get(table, ()):
                self.lake.drop_before(table, HOUR, hour_of(now - keep))
            self.lake.compact(table)
            self.lake.vacuum(table, vacuum_hours)
            versions[table] = self.lake.version(table)
        if self.lake.exists():
            self.mark = self.lake.commit(
                {}, PARTITIONS, replace(self.mark, versions=versions), SCHEMA_VERSION
            )
            self._forget_snapshot()

    def _tables(self, batch: _Batch, seq: int) -> dict[str, pa.Table]:
        tables = {}
        if batch.events:
            columns = batch.event_columns()
            tables[RAW_EVENT] = to_arrow(RAW_EVENT, columns, seq)
            tables[RUN_ACTIVITY] = _activity(tables[RAW_EVENT], seq)
        for table, rows in batch.rows.items():
            if rows:
                columns = {c: list(v) for c, v in zip(_COLUMNS[table], zip(*rows, strict=True), strict=True)}
                tables[table] = to_arrow(table, columns, seq)
        return tables

    def _forget_snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None

    def close(self) -> None:
        self._forget_snapshot()
        self._lock.release()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _activity(events: pa.Table, seq: int) -> pa.Table:
    """First and last event time of each run in the batch."""
    grouped = events.group_by("run_id").aggregate([("ts", "min"), ("ts", "max")])
    columns = {"run_id": grouped["run_id"], "first_ts": grouped["ts_min"], "last_ts": grouped["ts_max"]}
    return to_arrow(RUN_ACTIVITY, {k: v.to_pylist() for k, v in columns.items()}, seq)


# --------------------------------------------------------------------------- queries

Db = Archive | duckdb.DuckDBPyConnection | str | Path


class Reader:
    """A connection for reading `db`: a snapshot of an open archive, a connection as it is,
    or the archive at a root read as of its newest batch (never blocked by its writer).
    A root that is a single file is an archive from before the lake (a DuckDB file).
    `tables`: a root's snapshot shows only these tables, no views (snapshot)."""

    def __init__(self, db: Db, tables: Collection[str] | None = None) -> None:
        self._owned = True
        if isinstance(db, Archive):
            self.con = db.cursor()
        elif isinstance(db, duckdb.DuckDBPyConnection):
            self.con, self._owned = db, False
        elif not is_uri(db) and Path(db).is_file():
            self.con = duckdb.connect(str(db), read_only=True)
        else:
            self.con = open_snapshot(db, tables=tables)

    def __enter__(self) -> duckdb.DuckDBPyConnection:
        return self.con

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self.con.close()


def open_snapshot(
    db: str | Path, storage_options: dict[str, str] | None = None, tables: Collection[str] | None = None
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection on the archive at `db` as of its newest batch (ad-hoc SQL)."""
    lake = Lake.reading(db, storage_options)
    return snapshot(lake, lake.mark(), tables)


_TIMELINE_SQL = """
SELECT run_id, interruption_id, "at", cause, node_id AS node, rank, lost_steps, last_checkpoint_step,
       restart_seconds, resumed_attempt, detected_by, reason_text AS reason, reason_code,
       lost_seconds, gpu_hours, detect_seconds, reschedule_seconds, startup_seconds,
       coalesce(decisions, []) AS decisions, coalesce(decision_reasons, []) AS decision_reasons
FROM timeline
WHERE $run_id IS NULL OR run_id = $run_id
ORDER BY "at", interruption_id
"""


def query(db: Db, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every row of one SQL statement on the archive, as dicts keyed by column name."""
    with Reader(db) as con:
        result = con.execute(sql, params)
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def timeline(db: Db, run_id: str | None = None) -> list[dict[str, Any]]:
    """Interruptions in detection order with cause and cost (seed: /timeline); restart_seconds is
    None until the run has recovered."""
    return query(db, _TIMELINE_SQL, {"run_id": run_id})


_GOODPUT_SQL = """
SELECT run_id, window_s, arg_max("at", "at") AS "at", arg_max(goodput, "at") AS goodput,
       arg_max(elapsed_s, "at") AS elapsed_s, arg_max(checkpoint_s, "at") AS checkpoint_s,
       arg_max(lost_s, "at") AS lost_s, arg_max(restart_s, "at") AS restart_s,
       arg_max(straggler_s, "at") AS straggler_s
FROM goodput
WHERE $run_id IS NULL OR run_id = $run_id
GROUP BY run_id, window_s
ORDER BY run_id, window_s
"""


def goodput_breakdown(db: Db, run_id: str | None = None) -> list[dict[str, Any]]:
    """Each run's latest goodput report per window: goodput and the seconds lost to
    checkpoints, re-done work, restarts and stragglers."""
    return query(db, _GOODPUT_SQL, {"run_id": run_id})


def summary(db: Db) -> dict[str, int]:
    """Row counts of the archive's tables and main views."""
    with Reader(db) as con:
        return {
            name: int(con.execute(f"SELECT count(*) FROM {name}").fetchall()[0][0])
            for name in SUMMARY_RELATIONS
        }
