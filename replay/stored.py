"""A run's common telemetry records as the archive keeps them in columns (issue 20, item 3:
replay from the archive with columnar scans, decoded once).

The archive writer stores each common record's columns beside its bytes
(schemas/record_columns.py, telemetry_columns). :func:`read_stored` scans them for a run:
the block columns as flat lists over every record (no object per record), each other
part made once into the row the decoder makes of it (schemas/event_check.py): a
heartbeat's or step stats' from its columns, a GPU health report's from its object. A
replay folds stretches of records from them (processors/driver.py
``CoreDriver.fold_stored_many``); a record not stored, or one whose rows are not what the
writer found (an archive of another version), is folded from its bytes.
"""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ..common.collector import old_objects_left_alone
from ..schemas.columnar import StepColumns
from ..schemas.event_check import Row, common_row
from ..schemas.record_columns import TABLE_COLUMNS, StoredColumns, StoredRecord
from ..sinks.archive_schema import TELEMETRY_COLUMNS
from ..sinks.archive_tables import SEQ, stored_rows

#: The block columns, in StepColumns' order (after its run_id and node).
_BLOCK = ("event_id", "attempt", "rank", "step", "step_ts", "compute_s", "total_s")


def archived_rows(
    con: duckdb.DuckDBPyConnection, name: str, run_id: str, columns: list[str]
) -> pa.Table | None:
    """`columns` of the run's rows of table `name` (keyed by kafka_partition and kafka_offset) in
    key order, each key once; None where the archive has no such table (one written before
    the table was).

    From a lake (sinks/archive_tables.py) the rows are read as stored, put in order of key
    then batch, and each key's first copy kept here: what the table's view does with a window,
    which took 0.11-0.13 s of telemetry_log for a 1,024-rank run's 26,259 records where the
    stored rows read in ~0.05 s. An archive of one DuckDB file has its table, no copies."""
    listed = ", ".join(["kafka_partition", "kafka_offset", *columns])
    source, order = stored_rows(name), f", {SEQ}"  # (a lake's rows as stored, with their batch)
    try:
        con.execute(f"DESCRIBE {source}").fetchall()
    except duckdb.CatalogException:
        source, order = name, ""
        try:
            con.execute(f"DESCRIBE {source}").fetchall()
        except duckdb.CatalogException:
            return None
    rows = con.sql(f"SELECT {listed}{order} FROM {source} WHERE run_id = $run_id", params={"run_id": run_id})
    table = _in_key_order(rows.to_arrow_table(), bool(order))
    partition, offset = table.column("kafka_partition").to_numpy(), table.column("kafka_offset").to_numpy()
    again = (partition[1:] == partition[:-1]) & (offset[1:] == offset[:-1])
    if again.any():
        table = table.filter(pa.array(np.concatenate([[True], ~again])))
    return table.select(["kafka_partition", "kafka_offset", *columns])


def _in_key_order(table: pa.Table, with_seq: bool) -> pa.Table:
    """`table`'s rows by (partition, offset[, _seq]). Ordered here rather than by DuckDB,
    which moved every row's lists and bytes to sort (it doubled the scan): the scan gives a
    chunk per stored file, each in order (the writer stores a batch's records in order), so
    putting the chunks in order is nearly always enough; rows are moved only when not."""

    names = ["kafka_partition", "kafka_offset", *([SEQ] if with_seq else [])]
    chunks = sorted(
        (c for c in table.to_batches() if c.num_rows),
        key=lambda c: tuple(c.column(name)[0].as_py() for name in names),  # (each chunk's first key)
    )
    if chunks:
        table = pa.Table.from_batches(chunks, schema=table.schema)
    at = np.lexsort([table.column(name).to_numpy() for name in reversed(names)])  # (last key first)
    return table.take(at) if (at[1:] < at[:-1]).any() else table


def read_stored(
    con: duckdb.DuckDBPyConnection, run_id: str, records: list[tuple[int, int, bytes]]
) -> StoredColumns | None:
    """The run's telemetry_columns, aligned with `records` (the recording's, in its order);
    None where the archive stores none (written before schema version 3)."""
    table = archived_rows(con, TELEMETRY_COLUMNS, run_id, list(TABLE_COLUMNS))
    if table is None or table.num_rows == 0:
        return None
    with old_objects_left_alone():  # (a row and its object for each event but step timings)
        return _stored(table, records)


def _stored(table: pa.Table, records: list[tuple[int, int, bytes]]) -> StoredColumns:
    get = lambda name: table.column(name).to_pylist()  # noqa: E731
    runs, sizes = get("batch_run_id"), get("world_size")
    rows, unlike = _rows(table, runs, sizes)
    stored = []
    bounds = _bounds(table, "event_id")
    parts = zip(get("shard"), get("shard_ranks"), get("block_part"), get("block_node"), rows, strict=True)
    for s, (shard, shard_ranks, part, node, mine) in enumerate(parts):
        stored.append(
            StoredRecord(runs[s], sizes[s], shard, shard_ranks, part, node, bounds[s], bounds[s + 1], mine)
        )
    where = zip(get("kafka_partition"), get("kafka_offset"), strict=True)
    place = {key: s for s, key in enumerate(where) if s not in unlike}
    ids, attempts, ranks, steps, ts, compute, total = (_flat(table, name) for name in _BLOCK)
    block = StepColumns("", "", ids, attempts, ranks, steps, ts, compute, total, [])
    return StoredColumns([place.get((p, o), -1) for p, o, _ in records], stored, block)


def _rows(table: pa.Table, runs: list[str], sizes: list[int]) -> tuple[list[list[Row]], set[int]]:
    """Each stored record's other parts as the decoder's rows (schemas/event_check.py), and
    the records whose rows are not what the writer found (folded from their bytes). A
    heartbeat's and a step stats' row is made of its columns, with its object's JSON in
    the place of the object (schemas/codec.py event_of parses it where the core needs the
    model); a GPU health report's is read from its object."""
    objects = _flat(table, "rest")
    ids, attempts, ranks, nodes, steps, ts, phases, losses, norms, finite = (
        _flat(table, f"row_{name}")
        for name in (
            "event_id",
            "attempt",
            "rank",
            "node",
            "step",
            "ts",
            "phase",
            "loss",
            "grad_norm",
            "finite",
        )
    )
    at = _bounds(table, "rest")
    out: list[list[Row]] = []
    unlike: set[int] = set()
    for s in range(len(runs)):
        mine: list[Row] = []
        for k in range(at[s], at[s + 1]):
            head = (ids[k], attempts[k], ranks[k], nodes[k], steps[k], ts[k])
            if phases[k] is not None:
                mine.append((*head, phases[k], objects[k]))
            elif finite[k] is not None:
                mine.append((*head, losses[k], norms[k], finite[k], objects[k]))
            elif (row := common_row(orjson.loads(objects[k]), runs[s], sizes[s])) is not None:
                mine.append(row)
            else:
                unlike.add(s)
        out.append(mine)
    return out, unlike


def _flat(table: pa.Table, name: str) -> list[Any]:
    """A list column's values, every row's after the one before's."""
    return table.column(name).combine_chunks().flatten().to_pylist()


def _bounds(table: pa.Table, name: str) -> list[int]:
    """Where each row's list starts among a list column's flat values, and the end."""
    lengths = pc.list_value_length(table.column(name)).fill_null(0).to_numpy()
    return [0, *np.cumsum(lengths).tolist()]
