"""The archive's tables two ways: as Arrow tables the lake stores (one per batch and table),
and as the DuckDB views readers query (a snapshot of the lake at one batch mark).

The columns and their types are TABLE_DDL's (sinks/archive_schema.py), created once in an
in-memory DuckDB and read back as Arrow, so the schema has one source. Each stored row adds
``_seq`` (the batch that stored it) and, where the table is partitioned by hour, ``hour``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from .archive_schema import HOUR, HOUR_OF, KEYS, PARTITIONS, SCOPES, TABLE_DDL, VIEW_DDL
from .lake import Lake, Mark

SEQ = "_seq"
HOUR_FORMAT = "%Y-%m-%dT%H"
#: The prefix of the registered Arrow data each table's view reads.
_SOURCE = "_lake_"


@dataclass(frozen=True)
class TableShape:
    name: str
    columns: tuple[str, ...]  # TABLE_DDL's, in order
    json: frozenset[str]  # columns DuckDB types as JSON (stored as strings)
    schema: pa.Schema  # what the lake stores: the columns, _seq, then the hour if partitioned

    @property
    def types(self) -> dict[str, pa.DataType]:
        return {f.name: f.type for f in self.schema}


def _shapes() -> dict[str, TableShape]:
    con = duckdb.connect()
    try:
        for statement in TABLE_DDL:
            con.execute(statement)
        shapes = {}
        for name in KEYS:
            described = con.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = ? ORDER BY ordinal_position",
                [name],
            ).fetchall()
            arrow = con.sql(f"SELECT * FROM {name} LIMIT 0").to_arrow_table().schema
            fields = [pa.field(f.name, f.type, nullable=True) for f in arrow]
            fields.append(pa.field(SEQ, pa.int64(), nullable=False))
            if HOUR in PARTITIONS[name]:
                fields.append(pa.field(HOUR, pa.string(), nullable=False))
            shapes[name] = TableShape(
                name,
                tuple(c for c, _ in described),
                frozenset(c for c, t in described if t == "JSON"),
                pa.schema(fields),
            )
        return shapes
    finally:
        con.close()


SHAPES: dict[str, TableShape] = _shapes()


def to_arrow(name: str, columns: Mapping[str, Sequence[Any]], seq: int) -> pa.Table:
    """One table's rows of a batch as the lake stores them: the first row of each key only
    (the rest of the batch repeats it), stamped with the batch and its hour partition.
    OverflowError / ArrowInvalid when a value does not fit its column."""
    shape = SHAPES[name]
    types = shape.types
    arrays = [pa.array(columns[c], type=types[c]) for c in shape.columns]
    table = pa.Table.from_arrays(arrays, names=list(shape.columns))
    key = KEYS[name]
    if key is not None:
        first: dict[tuple[Any, ...], int] = {}
        for i, k in enumerate(zip(*(columns[c] for c in key), strict=True)):
            first.setdefault(k, i)
        if len(first) < table.num_rows:
            table = table.take(pa.array(list(first.values()), type=pa.int64()))
    table = table.append_column(
        pa.field(SEQ, pa.int64(), nullable=False), pa.array([seq] * table.num_rows, pa.int64())
    )
    if HOUR in PARTITIONS[name]:
        table = table.append_column(pa.field(HOUR, pa.string(), nullable=False), _hours(table[HOUR_OF[name]]))
    return table.cast(shape.schema)


def _hours(ts: pa.ChunkedArray) -> pa.Array:
    """UTC hour of each epoch-seconds time, as 'YYYY-MM-DDTHH' (a sortable partition value)."""
    micros = pc.cast(pc.multiply(pc.fill_null(ts, 0.0), 1e6), pa.int64(), safe=False)
    bounded = pc.max_element_wise(pc.min_element_wise(micros, 253_402_300_799_000_000), 0)
    stamps = pc.cast(bounded, pa.timestamp("us", tz="UTC"))
    return pc.strftime(stamps, format=HOUR_FORMAT).combine_chunks()


def hour_of(ts: float) -> str:
    """The hour partition of one time (as _hours gives it for a column)."""
    return time.strftime(HOUR_FORMAT, time.gmtime(ts))


def stored_rows(name: str) -> str:
    """The relation of a snapshot that holds table `name`'s rows as stored (every copy of a
    key, with its _seq; the view of the same name keeps the first)."""
    return f"{_SOURCE}{name}"


def _table_view(shape: TableShape) -> str:
    """The view readers query under the table's name: its DDL columns (JSON typed again),
    one row per key, the first stored."""
    columns = ", ".join(
        f'CAST("{c}" AS JSON) AS "{c}"' if c in shape.json else f'"{c}"' for c in shape.columns
    )
    key = KEYS[shape.name]
    dedupe = ""
    if key is not None:
        within = ", ".join([*SCOPES.get(shape.name, ()), *key])
        dedupe = f" QUALIFY row_number() OVER (PARTITION BY {within} ORDER BY {SEQ}) = 1"
    return f"CREATE OR REPLACE VIEW {shape.name} AS SELECT {columns} FROM {stored_rows(shape.name)}{dedupe}"


def snapshot(lake: Lake, mark: Mark, tables: Collection[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection whose tables and views show the lake as of `mark`;
    only `tables`, without the views over them, when it names some (a replay reads three
    tables: the other tables and views cost more than its queries)."""
    con = duckdb.connect()
    try:
        for name, shape in SHAPES.items():
            if tables is not None and name not in tables:
                continue
            data: Any = lake.dataset(name, mark)
            con.register(stored_rows(name), shape.schema.empty_table() if data is None else data)
            con.execute(_table_view(shape))
        for statement in VIEW_DDL if tables is None else ():
            con.execute(statement)
    except BaseException:
        con.close()
        raise
    return con
