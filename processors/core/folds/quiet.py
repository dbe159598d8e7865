"""Folding a quiet heartbeat, step stats or GPU health from its row (schemas/event_check.py), without
its model and without :func:`~.engine.step` (issue 20), with exactly step's state and
(no) outputs.

After the step timings (block.py), heartbeats and step stats are most of a training
run's events: each node's first rank reports its step stats every step, and every rank
beats. Nearly all of them change a few fields and decide nothing. Such an event is
*quiet* when, besides what makes a step timing quiet (block.steady: the run training,
nothing pending; the event of the run's attempt, a known rank inside the world, an id
not seen; on the coordinator, no goodput report or failure-rate check due at its ts):

- a heartbeat: its rank's stall is below every timeout the watchdog can give (on a
  shard: below half of every step timeout, under which no phase is forwarded);
- step stats: finite, and on the coordinator a step already judged (a synchronous job's
  first report of a step is judged, the others are ignored) or no gradient norm.

A GPU health report decides nothing by itself (the diagnosis keeps it): it is quiet when
what makes any event quiet holds.

Anything else, or any doubt, is not quiet: the fold then changes nothing and returns
False, and the caller folds the event's model with ``step``. Pure like the rest of the
core: no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import orjson

from ....schemas.event_check import HEARTBEAT_LEN, STATS_LEN, GpuRow, HeartbeatRow, Row, StatsRow
from ..accounting.baseline import observe
from ..accounting.goodput import advance
from ..detectors.diagnosis import keep_reading, reading_of
from ..detectors.hazard import observe as observe_hazard
from ..detectors.sdc_state import REMEMBERED
from .block import QuietLimits, steady

if TYPE_CHECKING:
    from ..state import RankState, RunState


def fold_quiet_row(run: RunState | None, row: Row, limits: QuietLimits, hint: int | None) -> bool:
    """Fold the row's event here if it is quiet (module docstring); False (nothing
    changed): fold its model with ``step``."""
    size = _steady_size(run, hint)
    return run is not None and size > 0 and _fold_row(run, row, limits, size)


def fold_quiet_rows(
    run: RunState | None,
    rows: list[Row],
    start: int,
    end: int,
    limits: QuietLimits,
    hint: int | None,
    known_steady: bool = False,
) -> int:
    """Fold rows[start:end] here while they are quiet (fold_quiet_row); the first that is
    not (`end` when all were), which the caller folds with ``step``. Whether the run is
    steady is asked once (`known_steady`: the caller saw it hold, and nothing but quiet
    events folded since): a quiet event changes none of what block.steady reads."""
    size = _steady_size(run, hint, known_steady)
    if run is None or size <= 0:
        return start
    i = start
    while i < end and _fold_row(run, rows[i], limits, size):
        i += 1
    return i


def _steady_size(run: RunState | None, hint: int | None, known_steady: bool = False) -> int:
    """The run's world size (else the batch's), when the run is steady (block.steady, unless
    `known_steady`); 0 when it is not, or neither size is known."""
    if run is None or not (known_steady or steady(run)):
        return 0
    return run.world_size or hint or 0


def _fold_row(run: RunState, row: Row, limits: QuietLimits, size: int) -> bool:
    # (event_check's is_heartbeat and is_stats, inline: a call into the schemas' compiled
    # package is a Python call, a good part of a quiet row's cost.)
    fields = len(row)
    if fields == HEARTBEAT_LEN:
        return _heartbeat(run, cast("HeartbeatRow", row), limits, size)
    if fields == STATS_LEN:
        return _stats(run, cast("StatsRow", row), limits, size)
    return _health(run, cast("GpuRow", row), limits, size)


def _heartbeat(run: RunState, row: HeartbeatRow, limits: QuietLimits, size: int) -> bool:
    """Fold the heartbeat here if it is quiet (module docstring), with the effects ``step``
    would have; False (nothing changed): fold it with ``step``."""
    event_id, attempt, rank_id, _, _, ts, phase, _ = row
    if (rank := _quiet_rank(run, event_id, attempt, rank_id, ts, limits, size)) is None:
        return False
    stalled = 0.0 if rank.progress_ts is None else max(0.0, ts - rank.progress_ts)
    if run.coordinator:
        if not rank.exited and stalled > limits.hang_below_s and _watched(run, rank_id):
            return False  # the watchdog would look at it (watchdog.is_hung)
    elif phase and stalled >= limits.forward_below_s:
        return False  # it might forward the phase (engine._forward_phase)
    _apply(run, rank, event_id, ts, limits)
    if rank.progress_ts is None:  # the first sign of life in the attempt starts its clock
        rank.progress_ts = ts
    if run.coordinator:
        if phase and ts >= rank.phase_ts:
            rank.phase, rank.phase_ts = phase, ts
    elif phase:
        rank.forwarded_phase = ""  # below half a timeout (engine._forward_phase)
    return True


def _stats(run: RunState, row: StatsRow, limits: QuietLimits, size: int) -> bool:
    """Fold the step stats here if they are quiet (module docstring), with the effects
    ``step`` would have; False (nothing changed): fold them with ``step``."""
    event_id, attempt, rank_id, _, step, ts, loss, grad, finite, _ = row
    if not (finite and math.isfinite(loss) and (grad is None or math.isfinite(grad))):
        return False  # the SDC detector's (sdc.is_non_finite)
    if (rank := _quiet_rank(run, event_id, attempt, rank_id, ts, limits, size)) is None:
        return False
    if run.coordinator:  # (a shard forwards only non-finite stats: engine._on_shard_event)
        current = run.sdc.current
        if current is None or current.attempt != run.attempt:
            return False  # the detector renews its memory for the attempt first
        measured = grad is not None and grad >= 0
        if measured and step > current.highest_judged_step - REMEMBERED and step not in current.judged_steps:
            return False  # the step's first report: judged (sdc.on_step_stats)
    _apply(run, rank, event_id, ts, limits)
    return True


def _health(run: RunState, row: GpuRow, limits: QuietLimits, size: int) -> bool:
    """Fold the GPU health report here if what makes any event quiet holds (it decides
    nothing by itself: diagnosis.observe_health keeps it), with the effects ``step``
    would have; False (nothing changed): fold it with ``step``."""
    event_id, attempt, rank_id, node, _, ts, present, temperature, capped, throttled = row[:10]
    width, expected_width, retries, nic = row[10:14]
    if (rank := _quiet_rank(run, event_id, attempt, rank_id, ts, limits, size)) is None:
        return False
    _apply(run, rank, event_id, ts, limits)
    source = row[14]  # the report as parsed, or (an archive's row) its JSON
    fields = source if isinstance(source, dict) else orjson.loads(source)
    observe_hazard(run.hazard, rank_id, node, ts, fields, limits.prediction)
    reading = reading_of(
        event_id,
        temperature,
        capped,
        throttled,
        width,
        expected_width,
        retries,
        nic,
        limits.nvlink_expected_width,
    )
    keep_reading(run.health, attempt, rank_id, node, present, reading, limits.recent_reports)
    return True


def _quiet_rank(
    run: RunState, event_id: str, attempt: int, rank_id: int, ts: float, limits: QuietLimits, size: int
) -> RankState | None:
    """The event's rank, when what makes any event quiet holds (block.fold_quiet's
    conditions, for one event of a steady run of world size `size`); None otherwise."""
    if not 0 <= rank_id < size or attempt != run.attempt:
        return None
    rank = run.ranks.get(rank_id)
    if rank is None or event_id in run.seen.ids:
        return None
    if ts >= run.hazard.checked_ts + limits.hazard_every_s:
        return None  # failure prediction evaluates (hazard.due)
    if run.coordinator:
        goodput, baseline, every = run.goodput, run.baseline, limits.report_every_s
        clock, last_report = goodput.clock, goodput.last_report_ts
        check_at = baseline.checked_end_ts + limits.check_every_s
        if clock - last_report >= every or not baseline.end_ts < check_at:  # type: ignore[operator]
            return None  # the next event reports or checks, whatever it is
        if ts > clock and ts - last_report >= every:  # type: ignore[operator]
            return None
        if ts > baseline.end_ts and ts >= check_at:
            return None
    return rank


def _watched(run: RunState, rank_id: int) -> bool:
    """The coordinator watches this rank for hangs (not another shard's, forwarded)."""
    owned = run.owned() if run.shard_ranks else None
    return owned is None or rank_id in owned


def _apply(run: RunState, rank: RankState, event_id: str, ts: float, limits: QuietLimits) -> None:
    """What ``step`` does with any quiet event: the dedupe window, the run's clocks, the
    rank's last sight (engine._rank) and, on the coordinator, goodput and exposure."""
    run.seen.add(event_id, limits.dedupe_window)
    if run.first_ts is None or ts < run.first_ts:
        run.first_ts = ts
    if ts > run.last_ts:
        run.last_ts = ts
    if ts > rank.last_seen_ts:
        rank.last_seen_ts = ts
    if run.coordinator:
        if ts > run.goodput.clock:  # type: ignore[operator]
            advance(run.goodput, ts, False, limits.goodput)
        observe(run.baseline, run, ts)
