"""Columnar telemetry (issue 20): a node's step timings of one flush as ONE record of
columns instead of one JSON object per rank and step, its columns checked a column at a
time and folded by the core without an event object per row (processors/core/folds/block.py).

On the wire, inside a telemetry batch's ``records`` (schemas/codec.py)::

    {"schema": "step_timings/1", "run_id": "...", "node": "node-0007",
     "event_id": ["a1-17", "a1-18", ...], "attempt": [0, 0, ...], "rank": [56, 57, ...],
     "step": [812, 812, ...], "ts": [...], "compute_s": [...], "total_s": [...]}

Row i is exactly the StepTiming ``{event_id[i], run_id, attempt[i], rank[i], node,
step[i], ts[i], compute_s[i], total_s[i]}``: every event keeps its identity (its id, so
deduplication stays exact), a bad row is rejected alone with the reason the row format
would give it (schemas/codec.py words it as for a step_timing/1 record), and :func:`rows` turns a block
back into the row format, which is what every consumer that folds events one by one
reads. The row format itself still decodes: logs written before this record replay as
they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from pydantic import Field, ValidationError

from .base import MAX_NAME, Record
from .block_check import COLUMNS, block_columns, common_rows
from .events import StepTiming

#: Fewer step timings than this in one node's flush stay in the row format.
MIN_BLOCK_ROWS = 2


class StepTimings(Record):
    """A node's step timings, one column per field (module docstring)."""

    KIND: ClassVar[str] = "step_timings"
    VERSION: ClassVar[int] = 1

    run_id: str = Field(min_length=1, max_length=MAX_NAME)
    node: str = Field(max_length=MAX_NAME)
    event_id: list[str] = Field(max_length=1_000_000, description="Each row's event id.")
    attempt: list[int] = Field(max_length=1_000_000)
    rank: list[int] = Field(max_length=1_000_000)
    step: list[int] = Field(max_length=1_000_000)
    ts: list[float] = Field(max_length=1_000_000, description="Emitter clock, Unix seconds.")
    compute_s: list[float] = Field(max_length=1_000_000, description="Before the collective.")
    total_s: list[float] = Field(max_length=1_000_000)


@dataclass(frozen=True, slots=True)
class StepColumns:
    """A block's valid rows, column by column (row order kept), and the rows the row format
    would refuse (each as its step_timing/1 body: schemas/codec.py words the reason)."""

    run_id: str
    node: str
    event_id: list[str]
    attempt_list: list[int]
    rank_list: list[int]
    step_list: list[int]
    ts_list: list[float]
    compute_list: list[float]
    total_list: list[float]
    bad: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.event_id)

    def take(self, keep: list[bool]) -> StepColumns:
        """The rows where `keep` is true."""

        def kept(column: list[Any]) -> list[Any]:
            return [value for value, good in zip(column, keep, strict=True) if good]

        return StepColumns(
            self.run_id,
            self.node,
            kept(self.event_id),
            kept(self.attempt_list),
            kept(self.rank_list),
            kept(self.step_list),
            kept(self.ts_list),
            kept(self.compute_list),
            kept(self.total_list),
            self.bad,
        )


def encode_step_timings(events: Sequence[StepTiming]) -> bytes:
    """One block of the events (all of one run and node), in their order."""
    first = events[0]
    columns: dict[str, list[Any]] = {name: [getattr(e, name) for e in events] for name in COLUMNS}
    return orjson.dumps(
        {"schema": StepTimings.schema_name(), "run_id": first.run_id, "node": first.node, **columns}
    )


class BlockError(ValueError):
    """A block whose shape is wrong (not a per-row problem): rejected whole."""


def columns_of(obj: dict[str, Any]) -> StepColumns:
    """Validate a parsed block: its header and shape (BlockError), then every row; rows
    the model refuses are set apart, the others kept as columns. A block of common rows
    (numbers of the right kinds, in range) is checked in one loop over its rows
    (schemas/block_check.py, compiled); any other block is read row by row through the
    StepTiming model, so a row is accepted or refused exactly as in the row format
    (which, for instance, reads a rank of "3" as 3)."""
    raw = block_columns(obj)
    if isinstance(raw, str):
        raise BlockError(raw)
    run_id, node = obj["run_id"], obj["node"]
    if common_rows(raw):  # nearly every block: the parsed lists, kept as they are
        ids, attempts, ranks, steps, ts, compute, total = raw
        return StepColumns(run_id, node, ids, attempts, ranks, steps, ts, compute, total, [])
    out: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    bad: list[dict[str, Any]] = []
    for i in range(len(raw[0])):  # an uncommon row: the model reads each row, as the row format does
        line = {"run_id": run_id, "node": node, **{name: obj[name][i] for name in COLUMNS}}
        try:
            found = StepTiming.model_validate(line)
        except ValidationError:
            bad.append(line)
            continue
        for column, name in zip(out, COLUMNS, strict=True):
            column.append(getattr(found, name))
    ids, attempts, ranks, steps, ts, compute, total = out
    return StepColumns(run_id, node, ids, attempts, ranks, steps, ts, compute, total, bad)


def row(block: StepColumns, i: int, run_id: str | None = None, node: str | None = None) -> StepTiming:
    """Row i in the row format (its values are validated already; the model's own
    validator is still the cheapest way to build one: model_construct is slower); `run_id`
    and `node` in place of the block's (columns that hold several blocks: replay/stored.py)."""
    return _VALIDATE(
        {
            "event_id": block.event_id[i],
            "run_id": block.run_id if run_id is None else run_id,
            "attempt": block.attempt_list[i],
            "rank": block.rank_list[i],
            "node": block.node if node is None else node,
            "step": block.step_list[i],
            "ts": block.ts_list[i],
            "compute_s": block.compute_list[i],
            "total_s": block.total_list[i],
        }
    )


def rows(block: StepColumns) -> list[StepTiming]:
    """The block's valid rows in the row format, in order."""
    return [row(block, i) for i in range(len(block))]


_VALIDATE = StepTiming.__pydantic_validator__.validate_python
