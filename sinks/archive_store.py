"""The archive's storage side: records in, idempotent rows out, and the queries on them.

Every table is keyed by the record's own identity (event_id, command_id, the Kafka
position of a dead letter) and every insert is ``ON CONFLICT DO NOTHING``, so writing
the same records twice stores them once: that is what lets the Kafka writer
(:mod:`trainguard.sinks.archive`) deliver at least once.

Bulk loads go through Arrow tables (shared/NOTES.md: ``executemany`` is ~1000x slower).
One process holds one connection to a file (DuckDB locks it); other threads of that
process read through ``Archive.cursor()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
from .archive_schema import (
    ACK,
    COMMAND,
    DDL,
    DEAD_LETTER,
    INTERRUPTION_DETECTED,
    INTERRUPTION_RECOVERED,
    RAW_EVENT,
    RUN_ATTEMPT,
    SCHEMA_VERSION,
    SUMMARY_RELATIONS,
)

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


#: What Archive.write takes: a bare record (tests, tools), records read from Kafka, or a dead letter.
Item: TypeAlias = Record | Located | DeadLetter

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
    """What one write() offered and inserted per table; the difference was already stored."""

    offered: dict[str, int]
    inserted: dict[str, int]

    @property
    def duplicates(self) -> dict[str, int]:
        return {t: self.offered[t] - self.inserted.get(t, 0) for t in self.offered}


class Archive:
    """One DuckDB file holding the archived log; idempotent bulk writes in one transaction each."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._con = duckdb.connect(str(self.path))
        try:
            self._create_schema()
            self._arrow_schemas = {
                table: self._con.sql(f"SELECT {', '.join(map(_quote, cols))} FROM {table} LIMIT 0")
                .to_arrow_table()
                .schema
                for table, cols in _COLUMNS.items()
            }
        except BaseException:
            self._con.close()
            raise

    def _create_schema(self) -> None:
        self._con.begin()
        for statement in DDL:
            self._con.execute(statement)
        self._con.execute(
            "INSERT INTO archive_meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING",
            [str(SCHEMA_VERSION)],
        )
        found = self._con.execute("SELECT value FROM archive_meta WHERE key = 'schema_version'").fetchall()
        self._con.commit()
        if int(found[0][0]) > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has archive schema version {found[0][0]}, "
                f"newer than this code's {SCHEMA_VERSION}"
            )

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The writer's connection: use it from the thread that writes."""
        return self._con

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection to the same database for another thread of this process."""
        return self._con.cursor()

    def write(self, items: Iterable[Item]) -> WriteResult:
        """Insert records and dead letters in ONE transaction; rows already stored are skipped."""
        items = list(items)
        try:
            batch = _collect(items)
            tables = self._tables(batch)
        except (OverflowError, pa.ArrowInvalid):
            # A record with an integer beyond 64 bits passed validation: park it, keep the rest.
            batch = _collect(items, checked=True)
            tables = self._tables(batch)
        offered = {t: (len(batch.events) if t == RAW_EVENT else len(batch.rows[t])) for t in FACT_TABLES}
        inserted = dict.fromkeys(FACT_TABLES, 0)
        con = self._con
        con.begin()
        try:
            for table, data in tables.items():
                view = f"_incoming_{table}"
                con.register(view, data)
                try:
                    sql = f"INSERT INTO {table} BY NAME SELECT * FROM {view} ON CONFLICT DO NOTHING"
                    inserted[table] = int(con.execute(sql).fetchall()[0][0])
                    if table == RAW_EVENT:
                        con.execute(_ACTIVITY_SQL.format(view=view))
                finally:
                    con.unregister(view)
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return WriteResult(offered, inserted)

    def _tables(self, batch: _Batch) -> dict[str, pa.Table]:
        tables = {}
        if batch.events:
            tables[RAW_EVENT] = self._arrow(RAW_EVENT, batch.event_columns())
        for table, rows in batch.rows.items():
            if rows:
                columns = zip(*rows, strict=True)
                tables[table] = self._arrow(table, dict(zip(_COLUMNS[table], columns, strict=True)))
        return tables

    def _arrow(self, table: str, columns: dict[str, Any]) -> pa.Table:
        schema = self._arrow_schemas[table]
        return pa.Table.from_arrays([pa.array(columns[f.name], type=f.type) for f in schema], schema=schema)

    def close(self) -> None:
        """Close the connection; DuckDB checkpoints the WAL into the file on close."""
        self._con.close()

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ACTIVITY_SQL = """
INSERT INTO run_activity SELECT run_id, min(ts), max(ts) FROM {view} GROUP BY run_id
ON CONFLICT (run_id) DO UPDATE
SET first_ts = least(first_ts, excluded.first_ts), last_ts = greatest(last_ts, excluded.last_ts)
"""


def _quote(column: str) -> str:
    return f'"{column}"'


# --------------------------------------------------------------------------- queries

Db = Archive | duckdb.DuckDBPyConnection | str | Path


class _Reader:
    """A connection for reading `db`: a cursor of an open archive/connection, or the file opened
    read-only (falling back to the process's open instance, which DuckDB shares)."""

    def __init__(self, db: Db) -> None:
        self._owned = False
        if isinstance(db, Archive):
            self.con = db.cursor()
            self._owned = True
        elif isinstance(db, duckdb.DuckDBPyConnection):
            self.con = db
        else:
            path = Path(db)
            if not path.exists():
                raise FileNotFoundError(f"no archive at {path}")
            try:
                self.con = duckdb.connect(str(path), read_only=True)
            except duckdb.ConnectionException:  # already open read-write in this process
                self.con = duckdb.connect(str(path))
            self._owned = True

    def __enter__(self) -> duckdb.DuckDBPyConnection:
        return self.con

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self.con.close()


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
    with _Reader(db) as con:
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
    with _Reader(db) as con:
        return {
            name: int(con.execute(f"SELECT count(*) FROM {name}").fetchall()[0][0])
            for name in SUMMARY_RELATIONS
        }
