"""The straggler detector (seed §7 "Failure 2"; what follows a flag: R2).

Per step, every rank's compute time measured BEFORE the collective is compared with
the other ranks' of the same step: robust z = (t - median) / (1.4826 x MAD). A rank
over `sigma` for `consecutive_steps` evaluated steps is flagged once; after
`clear_steps` consecutive steps back in the band it is cleared. The post-collective
total_s is never read: after the all-reduce every rank has waited for the slowest,
so it identifies nobody (seed §10, "Rejected: measuring step time after the
collective").

A step is evaluated, in step order, when every expected rank has reported it, or when
it is `max_pending_steps` older than the newest step seen (late ranks are then absent
from it). A rank absent from `missing_after_steps` consecutive evaluated steps is
reported once in :class:`RanksMissing`; it is reported again only if it comes back
and goes missing anew. Ranks known to be missing are not waited for.

One report per (attempt, step, rank) counts: the first emitted (smallest ts, then
event_id), whatever the delivery order, so a redelivery or a re-report of the same step
after an agent restart counts once and the decision does not depend on how per-node
batches interleave. Reports for an already evaluated step are counted and ignored.

State is keyed by attempt: the first event of a newer attempt resets it (steps restart
from the resumed checkpoint), events of an older one are ignored, so the engine need
not call :func:`reset` itself.

Deterministic and pure: time is the events' ts; the per-step statistics are a handful of
numpy calls over preallocated buffers (well under a millisecond at 16,384 ranks, see
bench/bench_straggler.py), the per-rank streak work is Python over the slow ranks only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ....schemas import (
    Derived,
    RanksMissing,
    Reason,
    ReasonCode,
    StepTiming,
    StragglerCleared,
    StragglerFlagged,
)
from ..ids import derived_id
from .straggler_state import _NAN, _NEVER, MAD_TO_SIGMA, StragglerPolicy, StragglerState, _Flag, _Pending

if TYPE_CHECKING:  # state.py embeds this module's state: no import cycle at run time
    from ..state import RunState


def reset(state: StragglerState, attempt: int) -> None:
    """Forget everything of the previous attempt (counters are kept)."""
    counters = state.evaluated, state.duplicates, state.late, state.out_of_range
    fresh = StragglerState(attempt=attempt)
    for f in fields(fresh):  # (field by field: a compiled state has no __dict__)
        setattr(state, f.name, getattr(fresh, f.name))
    state.evaluated, state.duplicates, state.late, state.out_of_range = counters


#: Called with each evaluated step, its compute times by rank (NaN: no report; a view of a
#: buffer that is reused, so read it, do not keep it), how many ranks reported, and the
#: event that completed it.
StepSink = Callable[[int, np.ndarray, int, StepTiming], None]


def observe_step(
    state: StragglerState,
    run: RunState,
    event: StepTiming,
    policy: StragglerPolicy,
    on_step: StepSink | None = None,
) -> list[Derived]:
    """Record one rank's step timing; evaluate, in step order, every step that became ready
    (each also handed to `on_step`: the group slowdown detector reads the same steps)."""
    if event.attempt != state.attempt:
        if event.attempt < state.attempt:
            return []
        reset(state, event.attempt)
    drain = False
    owned = run.owned()
    first, expected = (0, None) if owned is None else (owned.start, owned.stop)
    if expected != state.expected or first != state.first:
        _set_expected(state, first, expected)
        drain = True
    rank, step = event.rank, event.step
    if rank < first or step < 0 or (state.expected is not None and rank >= state.expected):
        state.out_of_range += 1
        return []
    if step <= state.evaluated_through:
        state.late += 1
        return []
    if rank >= state.capacity:
        _grow(state, rank + 1)
    pending = state.pending.get(step)
    if pending is None:
        pending = state.pending[step] = _new_pending(state)
        if step > state.newest_step:
            state.newest_step = step
            drain = True  # an older step may have aged out
    if pending.seen[rank]:
        state.duplicates += 1
        kept = pending.stamps[rank], pending.ids[rank] or ""
        if (event.ts, event.event_id) < kept:  # delivered out of order: the earlier report wins
            pending.values[rank], pending.stamps[rank] = event.compute_s, event.ts
            pending.ids[rank] = event.event_id
        return []
    record(state, pending, rank, event.compute_s, event.ts, event.event_id, event.node)
    if pending.need > 0 and not drain:
        return []
    outputs: list[Derived] = []
    while state.pending:
        oldest = min(state.pending)
        ready = state.pending[oldest]
        if ready.need > 0 and state.newest_step - oldest < policy.max_pending_steps:
            break
        del state.pending[oldest]
        state.evaluated_through = oldest
        outputs += _evaluate(state, run, oldest, ready, event, policy)
        if on_step is not None:
            on_step(oldest, np.frombuffer(ready.values), ready.count, event)
    return outputs


def record(
    state: StragglerState, pending: _Pending, rank: int, compute_s: float, ts: float, event_id: str, node: str
) -> None:
    """A rank's first report of a pending step (also the block fold's: processors/core/folds/block.py)."""
    pending.seen[rank] = 1
    pending.values[rank] = compute_s
    pending.stamps[rank] = ts
    pending.ids[rank] = event_id
    pending.count += 1
    if not state.missing or rank not in state.missing:  # (most runs miss no rank: no lookup)
        pending.need -= 1
    if state.nodes[rank] != node:
        state.nodes[rank] = node


# --------------------------------------------------------------------------- internals


def _set_expected(state: StragglerState, first: int, world_size: int | None) -> None:
    state.first, state.expected = first, world_size
    if world_size is not None and world_size > state.capacity:
        _grow(state, world_size)
    _recount(state)


def _grow(state: StragglerState, capacity: int) -> None:
    extra = capacity - state.capacity
    state.nodes += [""] * extra
    state.slow_run += [0] * extra
    state.last_slow += [_NEVER] * extra
    state.onset += [-1] * extra
    state.z_sum += [0.0] * extra
    state.ratio_sum += [0.0] * extra
    state.absent = np.concatenate([state.absent, np.zeros(extra, np.int32)])
    state.missing_mask = np.concatenate([state.missing_mask, np.zeros(extra, np.bool_)])
    state.spare = None
    state.scratch = (np.empty(capacity), np.empty(capacity), np.empty(capacity, np.bool_))
    for p in state.pending.values():
        p.values.extend(_NAN * extra)
        p.stamps.extend(_NAN * extra)
        p.seen.extend(bytes(extra))
        p.ids += [None] * extra
    state.capacity = capacity


def _need(state: StragglerState, p: _Pending) -> int:
    if state.expected is None:
        return 1 << 62  # completeness unknowable: evaluate on age only
    lo, n = state.first, state.expected
    if lo == 0 and n == state.capacity:
        reported = p.count
    else:
        reported = int(np.count_nonzero(np.frombuffer(p.seen, np.bool_)[lo:n]))
    excused = 0
    if state.missing:
        mask = state.missing_mask[lo:n]
        if p.count:
            mask = mask & ~np.frombuffer(p.seen, np.bool_)[lo:n]
        excused = int(np.count_nonzero(mask))
    return n - lo - reported - excused


def _new_pending(state: StragglerState) -> _Pending:
    n, p = state.capacity, state.spare
    if p is not None and len(p.seen) == n:
        state.spare = None
        np.frombuffer(p.values).fill(np.nan)
        p.seen[:] = bytes(n)  # ids and stamps are read only where seen
        p.count = 0
    else:
        p = _Pending(_NAN * n, _NAN * n, bytearray(n), [None] * n, 0, 0)
    p.need = _need(state, p)
    return p


def _recount(state: StragglerState) -> None:
    for p in state.pending.values():
        p.need = _need(state, p)


def _node(state: StragglerState, run: RunState, rank: int) -> str:
    if state.nodes[rank]:
        return state.nodes[rank]
    known = run.ranks.get(rank)
    return known.node if known is not None else ""


def _envelope(
    state: StragglerState, run: RunState, rank: int, step: int, trigger: StepTiming
) -> dict[str, Any]:
    node = _node(state, run, rank) if rank >= 0 else ""
    return dict(run_id=run.run_id, attempt=state.attempt, rank=rank, node=node, step=step, ts=trigger.ts)


def _median(part: np.ndarray) -> float:
    """The median of `part`, which is reordered in place. np.median (a copy, a two-element
    selection, NaN checks) is several times slower, and at 16,384 ranks it shows."""
    k = part.size // 2
    part.partition(k)
    if part.size % 2:
        return float(part[k])
    return float(part[k] + part[:k].max()) / 2


def _evaluate(
    state: StragglerState, run: RunState, step: int, p: _Pending, trigger: StepTiming, policy: StragglerPolicy
) -> list[Derived]:
    state.evaluated += 1
    outputs = _track_absence(state, run, step, p, trigger, policy)
    if p.count >= policy.min_ranks:
        outputs += _score(state, run, step, p, trigger, policy)
    state.spare = p
    return outputs


def _score(
    state: StragglerState, run: RunState, step: int, p: _Pending, trigger: StepTiming, policy: StragglerPolicy
) -> list[Derived]:
    """Robust z of every reporting rank; streaks, flags and clears. Few numpy calls, into
    preallocated buffers (a cold numpy call costs tens of microseconds in a busy process,
    a fresh 128 KiB array its page faults); the per-rank work is Python over the slow
    ranks only."""
    values = np.frombuffer(p.values)
    idx = None if p.count == state.capacity else np.flatnonzero(np.frombuffer(p.seen, np.bool_))
    x = values if idx is None else values[idx]
    work, dev, above = (buffer[: x.size] for buffer in state.scratch)
    np.copyto(work, x)
    median = _median(work)
    if median <= 0:
        return []
    np.subtract(x, median, out=dev)
    np.abs(dev, out=work)
    mad = max(_median(work), policy.mad_floor_fraction * median)
    scale = MAD_TO_SIGMA * mad
    np.greater(dev, policy.sigma * scale, out=above)
    slow_at = np.flatnonzero(above)
    slow_ranks = (slow_at if idx is None else idx[slow_at]).tolist()
    slow_dev, slow_x = dev[slow_at].tolist(), x[slow_at].tolist()

    now, hits = state.evaluated, []
    run_len, last, onset = state.slow_run, state.last_slow, state.onset
    z_sum, ratio_sum = state.z_sum, state.ratio_sum
    for rank, d, t in zip(slow_ranks, slow_dev, slow_x, strict=True):
        z, ratio = d / scale, t / median
        if now - last[rank] - 1 > policy.max_gap_steps:  # a new streak
            run_len[rank], onset[rank], z_sum[rank], ratio_sum[rank] = 1, step, z, ratio
        else:
            run_len[rank] += 1
            z_sum[rank] += z
            ratio_sum[rank] += ratio
        last[rank] = now
        if run_len[rank] >= policy.consecutive_steps and rank not in state.flagged:
            hits.append(rank)

    outputs = _clear(state, run, step, idx, dev, x, median, scale, p, trigger, policy)
    outputs += [_flag(state, run, rank, step, p, trigger, policy) for rank in hits]
    return outputs


def _track_absence(
    state: StragglerState, run: RunState, step: int, p: _Pending, trigger: StepTiming, policy: StragglerPolicy
) -> list[Derived]:
    n = state.expected if state.expected is not None else state.capacity
    lo = state.first
    newly: list[int] = []
    if lo == 0 and p.count == n == state.capacity:  # everyone reported: no vector work
        if state.any_absent:
            state.absent.fill(0)
            state.any_absent = False
    else:
        seen, absent = np.frombuffer(p.seen, np.bool_)[lo:n], state.absent[lo:n]
        absent += 1
        absent *= ~seen  # a rank that reported back to 0 (whole-array passes: no mask indexing)
        state.any_absent = True
        newly = (np.flatnonzero(absent == policy.missing_after_steps) + lo).tolist()
    returned: list[int] = []
    if state.missing:
        back = state.missing_mask[lo:n] & np.frombuffer(p.seen, np.bool_)[lo:n]
        returned = (np.flatnonzero(back) + lo).tolist()
    if not newly and not returned:
        return []
    state.missing.difference_update(returned)
    state.missing.update(newly)
    state.missing_mask[returned] = False
    state.missing_mask[newly] = True
    _recount(state)
    if not newly:
        return []
    first = newly[0]
    since = step - policy.missing_after_steps + 1
    return [
        RanksMissing(
            event_id=derived_id("ranks_missing", run.run_id, state.attempt, step),
            **_envelope(state, run, -1, step, trigger),
            reason=Reason(
                code=ReasonCode.MISSING_RANKS,
                text=f"{len(newly)} rank(s) reported no step timing for steps {since}..{step} while "
                f"the others did (first: rank {first} on {_node(state, run, first) or 'unknown node'}); "
                f"{len(state.missing)} missing in all",
            ),
            caused_by=[trigger.event_id],
            ranks=newly,
        )
    ]


def _clear(
    state: StragglerState,
    run: RunState,
    step: int,
    idx: np.ndarray | None,
    dev: np.ndarray,
    x: np.ndarray,
    median: float,
    scale: float,
    p: _Pending,
    trigger: StepTiming,
    policy: StragglerPolicy,
) -> list[Derived]:
    outputs: list[Derived] = []
    for rank, flag in list(state.flagged.items()):
        if not p.seen[rank]:
            continue
        at = rank if idx is None else int(np.searchsorted(idx, rank))
        z = float(dev[at]) / scale
        flag.steps += 1
        flag.in_band = 0 if z > policy.sigma else flag.in_band + 1
        if flag.in_band < policy.clear_steps:
            continue
        del state.flagged[rank]
        node = _node(state, run, rank)
        outputs.append(
            StragglerCleared(
                event_id=derived_id("straggler_cleared", flag.event_id, step),
                **_envelope(state, run, rank, step, trigger),
                reason=Reason(
                    code=ReasonCode.STRAGGLER_RECOVERED,
                    text=f"rank {rank} on {node} back within {policy.sigma:g} sigma for "
                    f"{flag.in_band} steps (now z {z:.1f}, {float(x[at]) / median:.2f}x the median) "
                    f"after {flag.steps} steps flagged since step {flag.flagged_step}",
                ),
                caused_by=[flag.event_id, *(kept for kept in (p.ids[rank],) if kept)],
                flagged_steps=flag.steps,
            )
        )
    return outputs


def _flag(
    state: StragglerState,
    run: RunState,
    rank: int,
    step: int,
    p: _Pending,
    trigger: StepTiming,
    policy: StragglerPolicy,
) -> StragglerFlagged:
    streak = state.slow_run[rank]
    onset = state.onset[rank]
    robust_z = state.z_sum[rank] / streak
    slowdown = state.ratio_sum[rank] / streak
    event_id = derived_id("straggler_flagged", run.run_id, state.attempt, rank, onset)
    state.flagged[rank] = _Flag(event_id, step)
    node = _node(state, run, rank)
    return StragglerFlagged(
        event_id=event_id,
        **_envelope(state, run, rank, step, trigger),
        reason=Reason(
            code=ReasonCode.STRAGGLER,
            text=f"rank {rank} on {node} computes {slowdown:.2f}x the median step (robust z "
            f"{robust_z:.1f} > {policy.sigma:g}) for {streak} steps since step {onset}",
        ),
        caused_by=[p.ids[rank] or trigger.event_id],
        robust_z=robust_z,
        slowdown=slowdown,
        consecutive_steps=streak,
        onset_step=onset,
    )
