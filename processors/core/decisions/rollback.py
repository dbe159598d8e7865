"""Rollback to the clean ancestor (seed R6): when an SDC check proves a device wrong, the
weights written since the last check that vouched for it may be corrupt, so the run goes
back to the newest validated checkpoint at or before that check (:func:`bound_for`): for
a deterministically wrong device (named by a cross-rank check) the last passing
cross-rank check that covered it; for a transient fault (a self-check mismatch) the
self-check watermark. The reason names the checkpoints skipped. When no validated
checkpoint is that old any more, it says so: a page, because a human must choose between
an older milestone elsewhere and accepting the risk.

The index of validated checkpoints is the core's own record of CheckpointValidated
events (step, uri, ts, and the last_verified_step each carries), pruned on every new one
to what retention keeps (:mod:`.retention`): at least 3 x (sdc_check_interval /
checkpoint_interval) + 2 recent ones plus a milestone every 6 h. The rollback can only
choose a retained checkpoint, so when retention has dropped every one at or before the
watermark, the page says so. `retention_count` is the same rule in steps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ....schemas import CheckpointValidated, Page, Reason, ReasonCode, Rollback, SdcMismatch
from ..accounting.retention import RetentionPolicy, keep_count_for, retained, watermark_interval_steps
from ..ids import derived_id
from .paging import page
from .rollback_state import KEEP_ALL, RollbackState, Validated

if TYPE_CHECKING:
    from ..detectors.sdc_state import SdcState
    from ..policy import CorePolicy
    from ..state import RunState


def retention_count(sdc_check_interval_steps: int, checkpoint_interval_steps: int) -> int:
    """Validated checkpoints to keep so that a clean ancestor survives a late detection."""
    return 3 * math.ceil(sdc_check_interval_steps / max(1, checkpoint_interval_steps)) + 2


def on_validated(
    state: RollbackState,
    event: CheckpointValidated,
    keep_count: int,
    policy: RetentionPolicy,
    pin: int | None = None,
) -> list[int]:
    """Index the checkpoint, then prune the index to what retention keeps (`keep_count`
    recent ones, the milestones, and the newest at or before `pin`). Returns the steps
    pruned now, oldest first. A redelivered validation of a checkpoint already pruned is
    ignored (prunes nothing)."""
    record = Validated(event.checkpoint_step, event.uri, event.last_verified_step, event.ts)
    if (record.step, record.ts) in state._pruned_keys:
        return []
    state.validated[record.step] = record
    if state.origin_ts is None:
        state.origin_ts = record.ts
    if state.last_ts is None or record.ts > state.last_ts:
        if state.last_ts is not None:
            state.gaps_s.append(record.ts - state.last_ts)
        state.last_ts = record.ts
    keep = retained(state.validated.values(), keep_count, policy, state.origin_ts, pin)
    gone = sorted((v for v in state.validated.values() if v.step not in keep), key=lambda v: (v.ts, v.step))
    for v in gone:
        del state.validated[v.step]
        state.pruned.append(v)
        state._pruned_keys.add((v.step, v.ts))
    return [v.step for v in gone]


def keep_count(run: RunState, policy: CorePolicy) -> int:
    """Recent validated checkpoints the run keeps now: :func:`.retention.keep_count_for`
    with W = the watermark's staleness in steps x the median step time, and T = the
    checkpoint interval in force (the core's published one, else the launcher's initial
    one) or the measured gap between validations, whichever is shorter: a launcher that
    checkpoints more often than the core believes gets a larger count, never a smaller one.
    Until a step time has been measured, nothing is pruned."""
    configured = run.interval.current_s or policy.interval.initial_s
    gaps = run.rollback.gaps_s
    interval_s = min(configured, statistics.median(gaps)) if gaps else configured
    steps = watermark_interval_steps(policy.sdc)
    if steps == 0:
        return keep_count_for(0.0, interval_s)
    if not run.step_times:
        return KEEP_ALL
    return keep_count_for(steps * statistics.median(run.step_times), interval_s)


def clean_ancestor(state: RollbackState, watermark: int) -> Validated | None:
    """The newest validated checkpoint at or before the watermark."""
    steps = [s for s in state.validated if s <= watermark]
    return state.validated[max(steps)] if steps else None


#: Methods whose named device is wrong deterministically: a cross-rank comparison caught
#: it (a self-check cannot: it computes the same wrong answer twice).
DETERMINISTIC_METHODS = ("cross_rank", "ring")


@dataclass(frozen=True)
class Bound:
    """The step a rollback must not go past, and what vouches for it (for the reason)."""

    step: int
    #: What vouched for the weights at `step`, as a noun phrase.
    what: str
    #: Why that and nothing newer ('' when it goes without saying).
    note: str = ""


def bound_for(sdc: SdcState, found: SdcMismatch) -> Bound:
    """Where the weights were last known clean against the kind of fault `found` is.

    A device named by a cross-rank (ring or pair) check is wrong deterministically: its
    self-checks passed all along, so only the last passing cross-rank check that covered
    it vouches for it. A self-check mismatch, or a cross-rank one naming nobody, is
    transient: the self-check watermark, as before."""
    if found.method in DETERMINISTIC_METHODS and found.rank >= 0:
        return Bound(
            sdc.cross_watermark(found.rank),
            f"the last passing cross-rank check that covered rank {found.rank}",
            "a self-check cannot vouch for a deterministic fault",
        )
    return Bound(sdc.last_passing_check_step, "the verification watermark")


def _steps(steps: list[int], limit: int = 24) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f" and {len(steps) - limit} more" if len(steps) > limit else "")


def on_mismatch(state: RollbackState, found: SdcMismatch, bound: Bound) -> list[Rollback | Page]:
    if found.attempt in state.handled:
        return []
    state.handled.add(found.attempt)
    watermark = bound.step
    target = clean_ancestor(state, watermark)
    skipped = sorted(s for s in state.validated if s > watermark)
    if target is None:
        newest = max(state.validated, default=-1)
        dropped = max((v.step for v in state.pruned if v.step <= watermark), default=None)
        why = f"; retention already dropped step {dropped}" if dropped is not None else ""
        where = f"step {watermark}" if watermark >= 0 else "step -1: no check ever vouched for it"
        text = (
            f"SDC at step {found.step} on {found.node or '?'}: no validated checkpoint at or before "
            f"{bound.what} ({where}){why}; the newest is step {newest}, written after it. Choose an "
            "older milestone or accept the risk."
        )
        return [page(found, "no_clean_ancestor", ReasonCode.NO_CLEAN_ANCESTOR, text, [found.event_id])]
    if skipped:
        skips = (
            f"skipping checkpoint(s) {_steps(skipped)}: written after step {watermark}, they may hold "
            "corrupt weights"
        )
    else:
        skips = "no newer checkpoint is skipped"
    text = (
        f"SDC at step {found.step} on {found.node or '?'}: roll back to checkpoint {target.step}, the "
        f"newest validated one at or before {bound.what} (step {watermark})"
        + (f"; {bound.note}" if bound.note else "")
        + f"; {skips}"
    )
    return [
        Rollback(
            command_id=derived_id("rollback", found.event_id),
            run_id=found.run_id,
            attempt=found.attempt,
            ranks=None,
            issued_ts=found.ts,
            reason=Reason(code=ReasonCode.ROLLBACK, text=text),
            caused_by=[found.event_id],
            checkpoint_step=target.step,
            uri=target.uri,
        )
    ]
