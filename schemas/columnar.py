"""Columnar telemetry (issue 20): a node's step timings of one flush as ONE record of
columns instead of one JSON object per rank and step, its columns checked a column at a
time and folded by the core without an event object per row (processors/core/block.py).

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from pydantic import Field, ValidationError

from .base import NO_STEP, Record
from .events import StepTiming

#: The per-row columns, in the order a row lists its fields.
COLUMNS = ("event_id", "attempt", "rank", "step", "ts", "compute_s", "total_s")
#: The keys a block may hold.
_FIELDS = frozenset({"schema", "run_id", "node", *COLUMNS})
#: Fewer step timings than this in one node's flush stay in the row format.
MIN_BLOCK_ROWS = 2


class StepTimings(Record):
    """A node's step timings, one column per field (module docstring)."""

    KIND: ClassVar[str] = "step_timings"
    VERSION: ClassVar[int] = 1

    run_id: str = Field(min_length=1, max_length=128)
    node: str = Field(max_length=128)
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
    (numbers of the right kinds, in range) is checked a column at a time; any other block
    is read row by row through the StepTiming model, so a row is accepted or refused
    exactly as in the row format (which, for instance, reads a rank of "3" as 3)."""
    run_id, node = obj.get("run_id"), obj.get("node")
    if (
        not isinstance(run_id, str)
        or not 0 < len(run_id) <= 128
        or not isinstance(node, str)
        or len(node) > 128
    ):
        raise BlockError("step_timings/1: run_id and node must be strings (1-128 and 0-128 characters)")
    if not _FIELDS.issuperset(obj):
        raise BlockError(f"step_timings/1: unknown fields {sorted(set(obj) - _FIELDS)}")
    get: Callable[[str], Any] = obj.get
    raw: list[list[Any]] = list(map(get, COLUMNS))
    if set(map(type, raw)) != {list}:
        raise BlockError(f"step_timings/1: every one of {list(COLUMNS)} must be a list")
    if len(set(map(len, raw))) != 1:
        raise BlockError("step_timings/1: the columns have different lengths")
    n = len(raw[0])
    if _common_columns(raw):  # nearly every block: checked a column at a time, at C speed
        ids, attempts, ranks, steps, ts, compute, total = raw  # the parsed lists, kept as they are
        return StepColumns(run_id, node, ids, attempts, ranks, steps, ts, compute, total, [])
    out: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    bad: list[dict[str, Any]] = []
    for i in range(n):  # a block with an uncommon row: the model reads each row, as the row format does
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


#: Ints past 64 bits (the model reads them too) take the row by row path: the fast path
#: keeps to what every JSON reader of the log agrees on.
_INT_LIMIT = 2**63


def _common_columns(raw: list[list[Any]]) -> bool:
    """Every row is common: the right types, in range (ints as ints, floats as finite,
    non-negative floats), judged a few columns at a time. A block with any other row is
    read row by row through the model."""
    ids, attempts, ranks, steps, ts, compute, total = raw
    if not ids:
        return True
    # all(ids): no empty id (every one is a str by then).
    if set(map(type, ids)) != {str} or not all(ids) or max(map(len, ids)) > 200:
        return False
    ints = attempts + ranks + steps
    if set(map(type, ints)) != {int} or max(ints) >= _INT_LIMIT:
        return False
    if min(attempts) < 0 or min(ranks) < 0 or min(steps) < NO_STEP:
        return False
    # (an int among the floats is legal: the row by row path reads it.) The sum of
    # non-negative floats is finite only if each is; a sum that overflows sends a block of
    # finite huge values the row by row way, which accepts them as it should.
    floats = ts + compute + total
    return set(map(type, floats)) == {float} and min(floats) >= 0.0 and math.isfinite(sum(floats))


def row(block: StepColumns, i: int) -> StepTiming:
    """Row i in the row format (its values are validated already; the model's own
    validator is still the cheapest way to build one: model_construct is slower)."""
    return _VALIDATE(
        {
            "event_id": block.event_id[i],
            "run_id": block.run_id,
            "attempt": block.attempt_list[i],
            "rank": block.rank_list[i],
            "node": block.node,
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
