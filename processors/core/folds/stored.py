"""Folding records a run's archive keeps as columns (schemas/record_columns.py, replay/
stored.py) into the core, a stretch at a time, with the state and outputs of folding each
record's decoded bytes (issue 20: replay from the archive at 1,000x real time).

A stored record is what the decoder makes of a common record: its batch header's run,
world size and shard, its other parts as rows (quiet.py) and at most one block of step
timings (block.py), held as rows lo..hi of columns shared by the run's records. The loop
over records, the quiet rows and the quiet block rows run here, compiled; an event that is
not quiet goes to the caller's `one_row` / `one_timing`, which fold its model with
``step`` (processors/driver.py). The interpreted loop this replaces cost about as much as
the folds it called. Pure like the rest of the core: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ....schemas.columnar import StepColumns
from ....schemas.event_check import Row
from ..state import RunState, state_key
from .block import QuietLimits, Timings, fold_quiet, steady
from .quiet import fold_quiet_rows

#: (run_id, world_size, shard, shard_ranks, block_part, block_node, lo, hi, rows): a
#: schemas/record_columns.py StoredRecord.
Stored = tuple[str, int, int, int, int, str, int, int, list[Row]]
#: Fold a row's model with ``step``: (row, world size hint, shard, shard_ranks).
OneRow = Callable[[Row, int, int, int], None]
#: Fold step timing i of the columns with ``step``: (i, run_id, node, hint, shard, shard_ranks).
OneTiming = Callable[[int, str, str, int, int, int], None]


def fold_stored(
    runs: dict[str, RunState],
    slot: list[int],
    records: Sequence[Stored],
    block: StepColumns,
    start: int,
    end: int,
    limits: QuietLimits,
    one_row: OneRow,
    one_timing: OneTiming,
    counts: list[int],
) -> int:
    """Fold records start, start + 1, ... (`slot[i]`: record i's place in `records`) up
    to `end` or the first that has to be folded from its bytes, and return its index: one
    not stored (slot -1), or of a run the core knows with another world size than the
    batch's (which the archive writer decoded against). Adds each record's events and
    duplicates to counts[0] and counts[1]."""
    timings, i, events, duplicates = Timings(block), start, 0, 0
    # The run steady() last held for, with nothing but quiet events folded since (none of
    # which changes what steady reads): asked again only after an event folded with step.
    calm: RunState | None = None
    while i < end:
        s = slot[i]
        if s < 0:
            break
        run_id, hint, shard, shard_ranks, part, node, lo, hi, rows = records[s]
        known = runs.get(run_id)
        if known is not None and known.world_size is not None and known.world_size != hint:
            break
        key = state_key(run_id, shard)
        run = runs.get(key)
        before = run.duplicates if run is not None else 0
        if run is not None and run is not calm and steady(run):
            calm = run
        at = len(rows) if part < 0 else part  # (the block's place among the rows)
        if _rows(runs, key, rows, 0, at, limits, hint, shard, shard_ranks, one_row, run is calm):
            calm = None
        if part >= 0:
            ok = run is calm
            stepped = _block(
                runs, key, timings, lo, hi, run_id, node, limits, hint, shard, shard_ranks, one_timing, ok
            )
            if stepped:
                calm = None
            if _rows(runs, key, rows, at, len(rows), limits, hint, shard, shard_ranks, one_row, run is calm):
                calm = None
        events += len(rows) + hi - lo
        run = runs.get(key)
        if run is not None:
            duplicates += run.duplicates - before
        i += 1
    counts[0] += events
    counts[1] += duplicates
    return i


def _block(
    runs: dict[str, RunState],
    key: str,
    timings: Timings,
    lo: int,
    hi: int,
    run_id: str,
    node: str,
    limits: QuietLimits,
    hint: int,
    shard: int,
    shard_ranks: int,
    one_timing: OneTiming,
    known_steady: bool,
) -> bool:
    """A stored record's block, rows lo..hi of the shared columns (block.fold_block's loop):
    the quiet rows here, the others through `one_timing`; whether any went there."""
    i, stepped = lo, False
    while i < hi:
        run = runs.get(key)
        calm = known_steady and not stepped
        j = fold_quiet(run, timings, i, hi, node, limits, hint, calm) if run is not None else i
        if j < hi:
            one_timing(j, run_id, node, hint, shard, shard_ranks)
            stepped = True
        i = j + 1
    return stepped


def _rows(
    runs: dict[str, RunState],
    key: str,
    rows: list[Row],
    start: int,
    end: int,
    limits: QuietLimits,
    hint: int,
    shard: int,
    shard_ranks: int,
    one_row: OneRow,
    known_steady: bool,
) -> bool:
    """rows[start:end]: the quiet ones here (quiet.py), the others through `one_row`;
    whether any went there."""
    i, stepped = start, False
    while i < end:
        i = fold_quiet_rows(runs.get(key), rows, i, end, limits, hint, known_steady and not stepped)
        if i < end:
            one_row(rows[i], hint, shard, shard_ranks)
            stepped = True
            i += 1
    return stepped
