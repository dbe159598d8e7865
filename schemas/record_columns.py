"""A telemetry record as the archive keeps it for replays: its step timings as columns, its
other events as the objects they were read from (issue 20: replay from the archive with
columnar scans, decoded once).

The archive writer decodes every telemetry record anyway (sinks/archive.py). A *common*
record (a current batch whose header is valid, no event rejected, every part a common row
or its one columnar block: schemas/event_check.py, schemas/columnar.py) is stored, beside
its bytes, as :class:`RecordColumns` (the archive's telemetry_columns): the header's
fields, the block's columns, and each other part's object as JSON. A replay folds those
columns (replay/stored.py) without parsing the record or checking it again: the writer's
decoder did, with the same code. Anything else is replayed from its bytes.

The one input of the decoder that the writer does not know is the core's registered world
size of the run (schemas/codec.py ``registered``). The writer decodes against the batch's
own; a replay whose core knows the run with another size decodes the record's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from .codec import DecodedParts
from .columnar import StepColumns
from .event_check import GPU_SCHEMA, HEARTBEAT_SCHEMA, STATS_SCHEMA, Row, is_heartbeat, is_stats


class RecordColumns(NamedTuple):
    """One common telemetry record's columns (module docstring)."""

    #: The batch header's fields (but its records).
    run_id: str
    node: str
    world_size: int
    producer_id: str
    seq: int
    shard: int
    shard_ranks: int
    #: The block's place among the record's parts (-1: the record has no block), its node
    #: and its columns (empty without a block).
    block_part: int
    block_node: str
    event_id: list[str]
    attempt: list[int]
    rank: list[int]
    step: list[int]
    ts: list[float]
    compute_s: list[float]
    total_s: list[float]
    #: The other parts' objects in order, each with its schema key, as JSON.
    rest: list[str]


#: RecordColumns' fields as telemetry_columns names them (sinks/archive_schema.py), in order.
TABLE_COLUMNS: tuple[str, ...] = (
    "batch_run_id", "batch_node", "world_size", "producer_id", "seq", "shard", "shard_ranks", "block_part",
    "block_node", "event_id", "attempt", "rank", "step", "step_ts", "compute_s", "total_s", "rest",
)  # fmt: skip


def row_schema(row: Row) -> str:
    """The schema of the event a common row was read from."""
    return HEARTBEAT_SCHEMA if is_heartbeat(row) else STATS_SCHEMA if is_stats(row) else GPU_SCHEMA


def record_columns(decoded: DecodedParts) -> RecordColumns | None:
    """`decoded`'s columns when it is a common record (module docstring), else None."""
    header = decoded.header
    if header is None or decoded.rejections or len(decoded.parts) != len(header.records):
        return None  # (a part per object: none rejected, no empty block)
    block: StepColumns | None = None
    block_part = -1
    rest: list[str] = []
    for i, part in enumerate(decoded.parts):
        if type(part) is tuple:
            item: dict[str, Any] = part[-1]
            rest.append(orjson.dumps({"schema": row_schema(part), **item}).decode())
        elif isinstance(part, StepColumns) and block is None and not part.bad:
            block, block_part = part, i
        else:
            return None  # an event read by its model, or a second block
    fields = (
        header.run_id, header.node, header.world_size, header.producer_id, header.seq, header.shard,
        header.shard_ranks,
    )  # fmt: skip
    if block is None:
        return RecordColumns(*fields, -1, "", [], [], [], [], [], [], [], rest)
    return RecordColumns(
        *fields, block_part, block.node, block.event_id, block.attempt_list, block.rank_list, block.step_list,
        block.ts_list, block.compute_list, block.total_list, rest,
    )  # fmt: skip


class StoredRecord(NamedTuple):
    """What a replay folds of one stored record (replay/stored.py): its batch header's
    run, world size and shard, its block's place among its parts (-1: none), node and rows
    in the stored block columns ([lo, hi)), and its other parts as the decoder's rows."""

    run_id: str
    world_size: int
    shard: int
    shard_ranks: int
    block_part: int
    block_node: str
    lo: int
    hi: int
    rows: list[Row]


@dataclass(frozen=True)
class StoredColumns:
    """The stored columns of a run's records: `slot[i]` is record i's place in `records`
    (i its place in the recording), -1 where it is folded from its bytes; `block` holds
    every record's block rows (its run_id and node are each record's own)."""

    slot: list[int]
    records: list[StoredRecord]
    block: StepColumns
