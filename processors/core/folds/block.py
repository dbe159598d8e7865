"""Folding a columnar block of step timings (schemas/columnar.py) into the core, with
exactly the state and the outputs of folding its rows one by one with
:func:`~.engine.step` (issue 20).

Most step timings of a training run change state and decide nothing: a rank reports a
step the job already reached, its step is still waiting for other ranks, no clock passes
a report or a check. Such a row is *quiet*, and its effects are a handful of assignments:
the dedupe window, the run's and the rank's clocks, the rank's last step and times, the
goodput clock, the failure-rate exposure, and the straggler detector's per-step buffers.
A block is folded as runs of quiet rows applied directly (no event object, no dispatch)
and the rows that are not quiet, each handed to ``step`` as a StepTiming, in order.

A row is quiet only when all of these hold (anything else, or any doubt, is not quiet):
the run is known and training; on its coordinator, with no hang, crash or deferred
eviction pending and no interruption open (a shard of a sharded run keeps no run-level
clocks or decisions, engine._on_shard_event: there the rest must hold); the row is of
the run's attempt, a rank inside the shard (its first row in the attempt makes its state,
as ``step`` would), an event id not seen;
its step is no newer than the job's and is waiting in the straggler detector, which has
not seen this rank for it; and the row neither completes that step, nor (on the
coordinator) moves the goodput clock to a report, nor the exposure to a failure-rate
check. Each row is checked against the state the rows before it left and applied at
once (one pass: no sets of the rows taken so far to keep).
Pure like the rest of the core: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ....schemas.columnar import StepColumns
from ..accounting.goodput import GoodputPolicy, advance
from ..detectors.hazard_state import PredictionPolicy
from ..detectors.straggler import record
from ..state import RankState, RunPhase

if TYPE_CHECKING:
    from ..policy import CorePolicy
    from ..state import RunState


class QuietLimits:
    """The policy's numbers the quiet folds compare with, read once (a policy is frozen;
    its fields are pydantic attributes, slow to read per event)."""

    def __init__(self, policy: CorePolicy) -> None:
        hang = policy.hang
        self.report_every_s: float = policy.goodput.report_every_s
        self.check_every_s: float = policy.baseline.check_every_s
        self.dedupe_window: int = policy.dedupe_window
        self.goodput: GoodputPolicy = policy.goodput
        #: watchdog.is_hung looks no further below this stall.
        self.hang_below_s: float = min(hang.floor_s, hang.default_timeout_s, hang.startup_timeout_s)
        #: Half the smallest step timeout (watchdog.step_timeout_s): engine._forward_phase
        #: forwards nothing below it.
        self.forward_below_s: float = 0.5 * min(hang.floor_s, hang.default_timeout_s, hang.ceiling_s)
        self.recent_reports: int = policy.diagnosis.recent_reports
        self.nvlink_expected_width: int | None = policy.diagnosis.nvlink_expected_width
        prediction = policy.prediction
        #: Failure prediction's evaluation period (hazard.due), and its policy; inf: off.
        self.hazard_every_s: float = prediction.check_every_s if prediction.enabled else math.inf
        self.prediction: PredictionPolicy = prediction


class Timings:
    """A block's columns as the quiet fold reads them: read from the StepColumns (a class of
    another compiled package, whose attributes cost a Python attribute read each) once for
    a block, or once for a stretch of stored records that share them (stored.py)."""

    def __init__(self, block: StepColumns) -> None:
        self.event_id: list[str] = block.event_id
        self.attempt: list[int] = block.attempt_list
        self.rank: list[int] = block.rank_list
        self.step: list[int] = block.step_list
        self.ts: list[float] = block.ts_list
        self.compute_s: list[float] = block.compute_list
        self.total_s: list[float] = block.total_list


def fold_block(
    run: RunState | None,
    block: StepColumns,
    limits: QuietLimits,
    world_size_hint: int | None,
    one: Callable[[int], None],
    lookup: Callable[[], RunState | None],
) -> None:
    """Fold every row of `block`: quiet rows here, the others through `one(i)` (which folds
    row i with ``step``); `lookup` finds the run again after a row that may have created or
    changed it."""
    timings, i, n = Timings(block), 0, len(block)
    while i < n:
        j = fold_quiet(run, timings, i, n, block.node, limits, world_size_hint) if run is not None else i
        if j < n:
            one(j)
            run = lookup()
        i = j + 1


def steady(run: RunState) -> bool:
    """The run is in the state where quiet rows exist at all."""
    stragglers = run.straggler
    if run.phase != RunPhase.TRAINING or stragglers.attempt != run.attempt:
        return False
    first, expected = run.owned_bounds()  # the ranks the detector watches
    if stragglers.expected != expected or stragglers.first != first:
        return False
    if not run.coordinator:
        return True  # a shard keeps no run-level clocks or decisions (engine._on_shard_event)
    return (
        run.pending_hang is None
        and run.pending_crash is None
        and run.open_interruption is None
        and not run.eviction.deferred
        and run.goodput.clock is not None
        and run.goodput.last_report_ts is not None
        and run.baseline.start_ts is not None
        and run.baseline.world_size == run.world_size
    )


def fold_quiet(
    run: RunState,
    block: Timings,
    i: int,
    n: int,
    node: str,
    limits: QuietLimits,
    world_size_hint: int | None,
    known_steady: bool = False,
) -> int:
    """Fold the quiet rows from row i on (up to n), each checked against the state the rows
    before it left, and return the first row that is not quiet (n when all were).
    `known_steady`: the caller saw steady(run) hold, and nothing but quiet events folded
    since (a quiet event changes none of what steady reads)."""
    if not (known_steady or steady(run)):
        return i
    size = run.world_size or world_size_hint
    if not size:
        return i
    goodput, baseline, stragglers = run.goodput, run.baseline, run.straggler
    # The same comparisons, written the same way, as goodput.reports and baseline.on_time.
    # A shard (not the coordinator) keeps neither clock: its rows pass neither gate.
    coordinator = run.coordinator
    last_report, every = goodput.last_report_ts, limits.report_every_s
    check_at = baseline.checked_end_ts + limits.check_every_s
    if coordinator and (goodput.clock - last_report >= every or not baseline.end_ts < check_at):  # type: ignore[operator]
        return i  # the next event reports or checks, whatever it is
    predict_at = run.hazard.checked_ts + limits.hazard_every_s  # (any shard: hazard.due)
    ranks, window, gp = run.ranks, limits.dedupe_window, limits.goodput
    dedupe = run.seen
    seen = dedupe.ids  # (DedupeWindow.add, inline: looked up once, below)
    pending, missing = stragglers.pending, stragglers.missing
    # A block's rows are mostly of one step: its buffers looked up once (quiet rows add no
    # step to the detector and evaluate none, so the lookup stands for the whole loop).
    waiting_step, waiting = -1, pending.get(-1)
    attempt, first, through = run.attempt, stragglers.first, stragglers.evaluated_through
    newest = min(run.job_step, stragglers.newest_step)
    end = size if stragglers.expected is None else min(size, stragglers.expected)
    end = min(end, stragglers.capacity)  # the detector counts ranks past it as out of range
    ids, attempts, rank_of, step_of, ts_of = block.event_id, block.attempt, block.rank, block.step, block.ts
    compute_of, total_of = block.compute_s, block.total_s
    # The goodput clock and the exposure's bounds as locals, written back once after the
    # loop (what observe does for each row, at once: the bounds' min and max and the world
    # size): their fields are optional floats, boxed, and a row would otherwise read and
    # write five of them. On the coordinator steady() holds, so none is None; a shard
    # touches neither.
    clock = goodput.clock if goodput.clock is not None else math.inf
    start_ts = baseline.start_ts if baseline.start_ts is not None else math.inf
    end_ts, observed = baseline.end_ts, False
    j = i
    while j < n:
        event_id, rank, step, ts = ids[j], rank_of[j], step_of[j], ts_of[j]
        if attempts[j] != attempt or not first <= rank < end:
            break
        state = ranks.get(rank)
        if state is None:  # the rank's first event of the attempt (a restart forgets ranks)
            if event_id in seen:
                break  # (``step`` drops a duplicate before it makes a rank's state)
            state = ranks[rank] = RankState(node=node)  # what ``step`` makes first (engine._rank)
        if not through < step <= newest:
            break
        if step != waiting_step:
            waiting_step, waiting = step, pending.get(step)
        if waiting is None or waiting.seen[rank]:
            break
        awaited = not missing or rank not in missing
        if waiting.need - awaited <= 0:
            break  # this row completes its step: the detector evaluates it
        moves = coordinator and ts > clock
        if moves and ts - last_report >= every:  # type: ignore[operator]
            break
        if coordinator and ts > end_ts and ts >= check_at:
            break
        if ts >= predict_at:
            break  # failure prediction evaluates
        # Quiet, unless its id was seen (``step`` counts the duplicate): the window's set is
        # looked up once (a set of the window's 200,000 ids, the row's costliest lookup).
        known = len(seen)
        seen.add(event_id)
        if len(seen) == known:
            break
        # Quiet: what ``step`` does with it, in its order.
        dedupe.push(event_id, window)
        if run.first_ts is None or ts < run.first_ts:
            run.first_ts = ts
        if ts > run.last_ts:
            run.last_ts = ts
        if moves:  # (only ever on the coordinator)
            advance(goodput, ts, False, gp)
            clock = ts
        if ts > state.last_seen_ts:
            state.last_seen_ts = ts
        compute_s = compute_of[j]
        state.note_step(step, ts, compute_s, total_of[j])
        record(stragglers, waiting, rank, compute_s, ts, event_id, node)
        if coordinator:  # (observe, below)
            start_ts, end_ts, observed = min(start_ts, ts), max(end_ts, ts), True
        j += 1
    if observed:  # baseline.observe of each row applied
        baseline.start_ts, baseline.end_ts, baseline.world_size = start_ts, end_ts, run.world_size
    return j
