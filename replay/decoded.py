"""What a backtest keeps of the log it decodes: the step timings as columns, and the few
facts its cost model reads of the other events (issue 20: the log is decoded once, in
one pass for every policy, and let go record by record: a month of a large run does not
fit in memory as decoded events, a step timing here is 40 bytes).

:meth:`LogColumns.add` reads each decoded record as the pass makes it: a columnar
block's columns are appended whole (C loops, no object per row), a step timing of the
row format as one row, any other event for the facts."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..schemas import CheckpointWritten, Envelope, RunStarted, StepTiming
from ..schemas.codec import DecodedParts
from ..schemas.columnar import StepColumns
from ..schemas.event_check import ROW_TS, Row
from ..schemas.record_columns import StoredColumns


class Timing(NamedTuple):
    """One step timing's numbers."""

    attempt: int
    step: int
    ts: float
    compute_s: float
    total_s: float


class IntColumn:
    """Ints as 64-bit machine words; a value the model accepts past 64 bits (it bounds
    none from above) turns the column into a plain list rather than fail."""

    def __init__(self) -> None:
        self.values: array[int] | list[int] = array("q")

    def extend(self, values: list[int]) -> None:
        kept = len(self.values)
        try:
            self.values.extend(values)
        except OverflowError:  # (an array keeps the values before the one that failed)
            self.values = list(self.values[:kept])
            self.values.extend(values)

    def append(self, value: int) -> None:
        self.extend([value])


@dataclass
class LogColumns:
    """A log's step timings as columns, in log order, and what else the cost model reads."""

    attempt: IntColumn = field(default_factory=IntColumn)
    step: IntColumn = field(default_factory=IntColumn)
    ts: array[float] = field(default_factory=lambda: array("d"))
    compute_s: array[float] = field(default_factory=lambda: array("d"))
    total_s: array[float] = field(default_factory=lambda: array("d"))
    #: The world size of the log's last RunStarted (1 when it has none), and its ranks per node.
    world_size: int = 1
    ranks_per_node: int = 8
    #: Every CheckpointWritten's blocking seconds, in log order.
    blocking_s: list[float] = field(default_factory=list)
    #: The earliest and the latest time of the events that are not step timings (the
    #: step timings' are read from their column: first_ts, last_ts).
    _first_other_ts: float = math.inf
    _last_other_ts: float = -math.inf

    def add(self, decoded: DecodedParts) -> None:
        """One decoded record's events (the order of the log is the order of the calls)."""
        for part in decoded.parts:
            kind = type(part)
            if kind is StepColumns:
                self.attempt.extend(part.attempt_list)  # type: ignore[union-attr]
                self.step.extend(part.step_list)  # type: ignore[union-attr]
                self.ts.extend(part.ts_list)  # type: ignore[union-attr]
                self.compute_s.extend(part.compute_list)  # type: ignore[union-attr]
                self.total_s.extend(part.total_list)  # type: ignore[union-attr]
                continue
            if kind is tuple:  # a heartbeat's, step stats' or GPU health's row: only its time counts
                self._add_rows([part])  # type: ignore[list-item]
                continue
            event: Envelope = part  # type: ignore[assignment]
            if event.ts < self._first_other_ts:
                self._first_other_ts = event.ts
            if event.ts > self._last_other_ts:
                self._last_other_ts = event.ts
            if kind is StepTiming:
                self.attempt.append(event.attempt)
                self.step.append(event.step)
                self.ts.append(event.ts)
                self.compute_s.append(event.compute_s)  # type: ignore[attr-defined]
                self.total_s.append(event.total_s)  # type: ignore[attr-defined]
            elif kind is RunStarted:
                self.world_size = event.world_size  # type: ignore[attr-defined]
                self.ranks_per_node = event.ranks_per_node  # type: ignore[attr-defined]
            elif kind is CheckpointWritten:
                self.blocking_s.append(event.blocking_s)  # type: ignore[attr-defined]

    def add_stored(self, stored: StoredColumns, i: int) -> None:
        """Record i of a run kept as columns (replay/stored.py), as `add` takes it decoded."""
        record = stored.records[stored.slot[i]]
        block, lo, hi = stored.block, record.lo, record.hi
        at = len(record.rows) if record.block_part < 0 else record.block_part
        self._add_rows(record.rows[:at])
        if hi > lo:
            self.attempt.extend(block.attempt_list[lo:hi])
            self.step.extend(block.step_list[lo:hi])
            self.ts.extend(block.ts_list[lo:hi])
            self.compute_s.extend(block.compute_list[lo:hi])
            self.total_s.extend(block.total_list[lo:hi])
        self._add_rows(record.rows[at:])

    def _add_rows(self, rows: list[Row]) -> None:
        for row in rows:
            ts: float = row[ROW_TS]
            if ts < self._first_other_ts:
                self._first_other_ts = ts
            if ts > self._last_other_ts:
                self._last_other_ts = ts

    @property
    def first_ts(self) -> float:
        """The earliest event time of the log (inf when it has none)."""
        stamps = np.frombuffer(self.ts, dtype=np.float64)
        return min(self._first_other_ts, float(stamps.min())) if len(stamps) else self._first_other_ts

    @property
    def last_ts(self) -> float:
        """The latest event time of the log (-inf when it has none)."""
        stamps = np.frombuffer(self.ts, dtype=np.float64)
        return max(self._last_other_ts, float(stamps.max())) if len(stamps) else self._last_other_ts

    def __len__(self) -> int:
        return len(self.total_s)

    def timings(self) -> Iterator[Timing]:
        """Every step timing of the log, in its order."""
        return map(Timing, self.attempt.values, self.step.values, self.ts, self.compute_s, self.total_s)

    def median_step_s(self) -> float:
        """The median total step time (0.0 with no step timing)."""
        return float(np.median(np.frombuffer(self.total_s, dtype=np.float64))) if len(self) else 0.0
