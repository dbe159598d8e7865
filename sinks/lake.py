"""Where the archive's rows live: one Delta Lake table per archive table under one root (a
directory, or an object-store URI such as ``s3://bucket/trainguard``), and a batch log
that makes one write atomic across all of them.

Why Delta and not one DuckDB file: DuckDB lets one process hold a file read-write and then
no other process may open it, so a report could not run while the writer did. Delta's
files are immutable Parquet plus a JSON commit log, so any number of readers (trainguard,
DuckDB, Spark, Trino, pandas) read a consistent version while one writer appends, on a
local disk or on object storage, and old partitions can be dropped per table.

A batch writes each table (one Delta commit each), then appends its mark to ``_batches``:
the version of every table and the Kafka offsets the batch reached. The mark is the commit
point. Readers open each table at the version its newest mark lists, so they never see a
part of a batch. A writer that dies between the two leaves commits no mark lists; the next
writer rolls those tables back to the mark (:meth:`Lake.recover`) and resumes Kafka from the
mark's offsets, so a killed writer neither loses nor duplicates a record.

One writer per root (:class:`WriterLock` keeps a second one out on a local root); readers
are unlimited.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError

BATCHES = "_batches"
_MARK_KEY = "trainguard.mark"
#: Commits of `_batches` searched for the newest mark (only maintenance commits lack one).
_LOOK_BACK = 50
_MARK_SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("at", pa.float64()),
        ("schema_version", pa.int64()),
        ("rows", pa.int64()),
        ("versions", pa.string()),  # JSON {table: delta version}
        ("offsets", pa.string()),  # JSON {"topic:partition": next offset}
    ]
)


@dataclass(frozen=True)
class Mark:
    """What the newest committed batch left: the version of each table readers open, and the
    next Kafka offset of every partition the archive has stored (its own resume point)."""

    seq: int = 0
    schema_version: int = 0
    versions: Mapping[str, int] = field(default_factory=dict)
    offsets: Mapping[str, int] = field(default_factory=dict)


def is_uri(root: str | Path) -> bool:
    return "://" in str(root)


class Lake:
    """The Delta tables of one archive root."""

    def __init__(self, root: str | Path, storage_options: dict[str, str] | None = None) -> None:
        self.root = str(root).rstrip("/")
        self.storage_options = storage_options
        #: The writer's tables, opened once: a write through an open table updates it in
        #: place, where reopening replays the log since its checkpoint (~70 ms at 100 commits).
        self._writing: dict[str, DeltaTable] = {}
        if not is_uri(self.root):
            Path(self.root).mkdir(parents=True, exist_ok=True)

    @classmethod
    def reading(cls, root: str | Path, storage_options: dict[str, str] | None = None) -> Lake:
        """The lake at `root`, which must exist (FileNotFoundError names it otherwise)."""
        if not is_uri(root) and not Path(root).is_dir():
            raise FileNotFoundError(f"no archive at {root}")
        lake = cls.__new__(cls)
        lake.root, lake.storage_options, lake._writing = str(root).rstrip("/"), storage_options, {}
        if not lake.exists():
            raise FileNotFoundError(f"no archive at {root} (no {BATCHES} table there)")
        return lake

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}"

    def _table(self, table: str, version: int | None = None) -> DeltaTable | None:
        try:
            return DeltaTable(self.uri(table), version=version, storage_options=self.storage_options)
        except TableNotFoundError:
            return None

    def _open(self, table: str) -> DeltaTable | None:
        """The writer's handle on `table` (None until its first write); the writer's own
        operations keep it current."""
        if table not in self._writing:
            opened = self._table(table)
            if opened is None:
                return None
            self._writing[table] = opened
        return self._writing[table]

    def _append(self, table: str, data: pa.Table, **options: Any) -> int:
        """Append `data` to `table` (created by its first append); the table's new version."""
        opened = self._open(table)
        if opened is None:
            write_deltalake(
                self.uri(table), data, mode="append", storage_options=self.storage_options, **options
            )
            opened = self._open(table)
            assert opened is not None
        else:
            write_deltalake(opened, data, mode="append", **options)
        return opened.version()

    def exists(self) -> bool:
        return self._table(BATCHES) is not None

    def mark(self) -> Mark:
        """The newest committed mark (an empty one for a new root)."""
        batches = self._table(BATCHES)
        if batches is None:
            return Mark()
        # The mark rides on its commit's metadata: the newest one is read from the log's tail,
        # whatever the table holds (a compaction's commit carries none, hence the look back).
        for commit in batches.history(_LOOK_BACK):
            found = commit.get(_MARK_KEY)
            if found:
                mark = orjson.loads(found)
                return Mark(mark["seq"], mark["schema_version"], mark["versions"], mark["offsets"])
        raise RuntimeError(f"{self.uri(BATCHES)}: no batch mark in its last {_LOOK_BACK} commits")

    def recover(self, tables: Iterable[str] = ()) -> Mark:
        """Roll `tables` (and every table found under a local root) back to the newest mark:
        commits made after it belong to a batch whose writer died before its mark, and their
        records will be read from Kafka again."""
        mark = self.mark()
        for name in sorted({*tables, *self._table_names()}):
            table = self._open(name)
            if table is None:
                continue  # never written
            listed = mark.versions.get(name)
            if listed is None:
                table.delete()  # created by the unfinished batch: empty it
            elif table.version() > listed:
                table.restore(listed)
        return mark

    def _table_names(self) -> list[str]:
        if is_uri(self.root):
            return []  # an object store lists no directories cheaply: the caller names its tables
        return sorted(
            p.name for p in Path(self.root).iterdir() if p.name != BATCHES and (p / "_delta_log").is_dir()
        )

    def commit(
        self,
        tables: Mapping[str, pa.Table],
        partition_by: Mapping[str, list[str]],
        previous: Mark,
        schema_version: int,
        offsets: Mapping[str, int] | None = None,
    ) -> Mark:
        """Append each table, then the mark listing their new versions: the batch is visible to
        readers all at once, or (if this dies before the mark) not at all."""
        versions = dict(previous.versions)
        rows = 0
        for name, data in tables.items():
            if data.num_rows == 0:
                continue
            versions[name] = self._append(name, data, partition_by=partition_by.get(name) or None)
            rows += data.num_rows
        mark = Mark(previous.seq + 1, schema_version, versions, {**previous.offsets, **(offsets or {})})
        row = {
            "seq": mark.seq,
            "at": time.time(),
            "schema_version": schema_version,
            "rows": rows,
            "versions": orjson.dumps(mark.versions).decode(),
            "offsets": orjson.dumps(mark.offsets).decode(),
        }
        metadata = {
            "seq": mark.seq,
            "schema_version": schema_version,
            "versions": mark.versions,
            "offsets": mark.offsets,
        }
        self._append(
            BATCHES,
            pa.Table.from_pylist([row], schema=_MARK_SCHEMA),
            commit_properties=CommitProperties(custom_metadata={_MARK_KEY: orjson.dumps(metadata).decode()}),
        )
        return mark

    def version(self, table: str) -> int:
        opened = self._open(table)
        if opened is None:
            raise FileNotFoundError(f"no table {self.uri(table)}")
        return opened.version()

    def dataset(self, table: str, mark: Mark) -> ds.Dataset | None:
        """`table` as of `mark` (None when the mark lists no version of it yet)."""
        version = mark.versions.get(table)
        if version is None:
            return None
        opened = self._table(table, version)
        return None if opened is None else opened.to_pyarrow_dataset()

    def compact(self, table: str) -> int:
        """Merge the table's small files (each batch writes one per partition); the files it
        replaced stay for readers of older versions until :meth:`vacuum`. Returns files removed."""
        opened = self._open(table)
        if opened is None:
            return 0
        return int(opened.optimize.compact()["numFilesRemoved"])

    def vacuum(self, table: str, retention_hours: int) -> int:
        """Delete files no version younger than `retention_hours` uses (readers hold a version
        for the length of one query; keep it above the longest query)."""
        opened = self._open(table)
        if opened is None:
            return 0
        removed = opened.vacuum(retention_hours, dry_run=False, enforce_retention_duration=False)
        return len(removed)

    def drop_before(self, table: str, column: str, cutoff: str) -> int:
        """Retention: delete the rows of partitions whose `column` (an hour) sorts before
        `cutoff`; their files go at the next vacuum. Returns rows deleted."""
        opened = self._open(table)
        if opened is None:
            return 0
        escaped = cutoff.replace("'", "''")
        return int(opened.delete(f"{column} < '{escaped}'").get("num_deleted_rows", 0))


class WriterLock:
    """One writer per local archive root: a second one fails at once instead of interleaving
    batches with the first (an object-store root relies on the consumer group's single member)."""

    def __init__(self, root: str | Path) -> None:
        self._file: IO[bytes] | None = None
        if is_uri(root):
            return
        path = Path(root) / "_writer.lock"
        handle = path.open("ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RuntimeError(f"another archive writer holds {root} (lock {path})") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n".encode())
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
