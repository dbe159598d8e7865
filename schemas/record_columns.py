"""A telemetry record as the archive keeps it for replays: its step timings as columns, its
other events as the objects they were read from (issue 20: replay from the archive with
columnar scans, decoded once).

The archive writer decodes every telemetry record anyway (sinks/archive.py). A *common*
record (a current batch whose header is valid, no event rejected, every part a common row
or its one columnar block: schemas/event_check.py, schemas/columnar.py) is stored, beside
its bytes, as :class:`RecordColumns` (the archive's telemetry_columns): the header's
fields, the block's columns, each other part's object as JSON, and those parts' fields as
columns (a heartbeat's and a step stats' row is made of them). A replay folds those
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
    #: The other parts as columns (a row each, in `rest`'s order): the envelope's fields;
    #: a heartbeat's phase (None for another kind); a step stats' loss, gradient norm and
    #: finite (None for another kind; the norm may be None for one). A GPU health report
    #: is read again from its object (its row holds more than these).
    row_event_id: list[str]
    row_attempt: list[int]
    row_rank: list[int]
    row_node: list[str]
    row_step: list[int]
    row_ts: list[float]
    row_phase: list[str | None]
    row_loss: list[float | None]
    row_grad_norm: list[float | None]
    row_finite: list[bool | None]


#: RecordColumns' fields as telemetry_columns names them (sinks/archive_schema.py), in order.
TABLE_COLUMNS: tuple[str, ...] = (
    "batch_run_id", "batch_node", "world_size", "producer_id", "seq", "shard", "shard_ranks", "block_part",
    "block_node", "event_id", "attempt", "rank", "step", "step_ts", "compute_s", "total_s", "rest",
    "row_event_id", "row_attempt", "row_rank", "row_node", "row_step", "row_ts", "row_phase", "row_loss",
    "row_grad_norm", "row_finite",
)  # fmt: skip


def row_schema(row: Row) -> str:
    """The schema of the event a common row was read from."""
    return HEARTBEAT_SCHEMA if is_heartbeat(row) else STATS_SCHEMA if is_stats(row) else GPU_SCHEMA


def _object(row: Row) -> dict[str, Any]:
    """The object a decoded row was read from (the decoder's rows hold it, not its JSON)."""
    source = row[-1]
    assert isinstance(source, dict), "a decoded row holds its object"
    return source


def record_columns(decoded: DecodedParts) -> RecordColumns | None:
    """`decoded`'s columns when it is a common record (module docstring), else None."""
    header = decoded.header
    if header is None or decoded.rejections or len(decoded.parts) != len(header.records):
        return None  # (a part per object: none rejected, no empty block)
    block: StepColumns | None = None
    block_part = -1
    rows: list[Row] = []
    for i, part in enumerate(decoded.parts):
        if type(part) is tuple:
            rows.append(part)
        elif isinstance(part, StepColumns) and block is None and not part.bad:
            block, block_part = part, i
        else:
            return None  # an event read by its model, or a second block
    stats = [row[6:9] if is_stats(row) else (None, None, None) for row in rows]
    return RecordColumns(
        run_id=header.run_id,
        node=header.node,
        world_size=header.world_size,
        producer_id=header.producer_id,
        seq=header.seq,
        shard=header.shard,
        shard_ranks=header.shard_ranks,
        block_part=block_part,
        block_node=block.node if block is not None else "",
        event_id=block.event_id if block is not None else [],
        attempt=block.attempt_list if block is not None else [],
        rank=block.rank_list if block is not None else [],
        step=block.step_list if block is not None else [],
        ts=block.ts_list if block is not None else [],
        compute_s=block.compute_list if block is not None else [],
        total_s=block.total_list if block is not None else [],
        rest=[orjson.dumps({"schema": row_schema(row), **_object(row)}).decode() for row in rows],
        row_event_id=[row[0] for row in rows],
        row_attempt=[row[1] for row in rows],
        row_rank=[row[2] for row in rows],
        row_node=[row[3] for row in rows],
        row_step=[row[4] for row in rows],
        row_ts=[row[5] for row in rows],
        row_phase=[row[6] if is_heartbeat(row) else None for row in rows],
        row_loss=[values[0] for values in stats],
        row_grad_norm=[values[1] for values in stats],
        row_finite=[values[2] for values in stats],
    )


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
