"""A decoded log (the replay's list of DecodedParts) read for what a backtest measures,
column by column where it is columnar: its step timings as plain tuples straight from a
block's columns, with no event object per row (issue 20: decode once, for all policies
and the report), and its other events as they are."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from ..schemas import Envelope, StepTiming
from ..schemas.codec import DecodedParts
from ..schemas.columnar import StepColumns


class Timing(NamedTuple):
    """One step timing's numbers."""

    attempt: int
    step: int
    ts: float
    compute_s: float
    total_s: float


def timings(decoded: Iterable[DecodedParts]) -> Iterator[Timing]:
    """Every step timing of the log, in its order."""
    for record in decoded:
        for part in record.parts:
            if isinstance(part, StepColumns):
                at = (part.attempt_list, part.step_list, part.ts_list)
                yield from map(Timing, *at, part.compute_list, part.total_list)
            elif isinstance(part, StepTiming):
                yield Timing(part.attempt, part.step, part.ts, part.compute_s, part.total_s)


def others(decoded: Iterable[DecodedParts]) -> Iterator[Envelope]:
    """Every event of the log that is not a step timing, in its order."""
    for record in decoded:
        for part in record.parts:
            if isinstance(part, Envelope) and not isinstance(part, StepTiming):
                yield part


def ts_span(decoded: Iterable[DecodedParts]) -> tuple[float, float]:
    """The earliest and the latest event time of the log ((inf, -inf) when it has none)."""
    first, last = float("inf"), float("-inf")
    for record in decoded:
        for part in record.parts:
            if isinstance(part, StepColumns):
                if part.ts_list:
                    first, last = min(first, min(part.ts_list)), max(last, max(part.ts_list))
            else:
                first, last = min(first, part.ts), max(last, part.ts)
    return first, last
