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


def step_totals(decoded: Iterable[DecodedParts]) -> list[float]:
    """Every step timing's total_s, in the log's order (the blocks' columns extended whole)."""
    out: list[float] = []
    for record in decoded:
        for part in record.parts:
            if isinstance(part, StepColumns):
                out += part.total_list
            elif isinstance(part, StepTiming):
                out.append(part.total_s)
    return out


def others(decoded: Iterable[DecodedParts]) -> Iterator[Envelope]:
    """Every event of the log that is not a step timing, in its order."""
    for record in decoded:
        for part in record.parts:
            if isinstance(part, Envelope) and not isinstance(part, StepTiming):
                yield part


def ts_span(decoded: Iterable[DecodedParts]) -> tuple[float, float]:
    """The earliest and the latest event time of the log ((inf, -inf) when it has none)."""
    stamps: list[float] = []
    for record in decoded:
        for part in record.parts:
            if isinstance(part, StepColumns):
                stamps += part.ts_list
            else:
                stamps.append(part.ts)
    return (min(stamps), max(stamps)) if stamps else (float("inf"), float("-inf"))
