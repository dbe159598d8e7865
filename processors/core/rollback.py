"""Rollback to the clean ancestor (seed R6): when an SDC check proves a device wrong, the
weights written since the last passing check may be corrupt, so the run goes back to the
newest validated checkpoint at or before the verification watermark (the newest step at
which a check passed with no mismatch at or before it). When no validated checkpoint is
that old any more, it says so: a page, because a human must choose between an older
milestone elsewhere and accepting the risk.

The index of validated checkpoints is the core's own record of CheckpointValidated
events (step, uri, and the last_verified_step each carries). Retention must keep enough
of them for a clean ancestor to exist: `retention_count` is the seed's rule, at least
3 x (sdc_check_interval / checkpoint_interval) + 2 (plus a milestone every 6 h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...schemas import CheckpointValidated, Page, Reason, ReasonCode, Rollback, SdcMismatch
from .ids import derived_id
from .paging import page


def retention_count(sdc_check_interval_steps: int, checkpoint_interval_steps: int) -> int:
    """Validated checkpoints to keep so that a clean ancestor survives a late detection."""
    return 3 * math.ceil(sdc_check_interval_steps / max(1, checkpoint_interval_steps)) + 2


@dataclass(frozen=True)
class Validated:
    step: int
    uri: str
    last_verified_step: int


@dataclass
class RollbackState:
    validated: dict[int, Validated] = field(default_factory=dict)
    #: Attempts already rolled back (one rollback per attempt, however many mismatches).
    handled: set[int] = field(default_factory=set)


def on_validated(state: RollbackState, event: CheckpointValidated) -> None:
    state.validated[event.checkpoint_step] = Validated(
        event.checkpoint_step, event.uri, event.last_verified_step
    )


def clean_ancestor(state: RollbackState, watermark: int) -> Validated | None:
    """The newest validated checkpoint at or before the watermark."""
    steps = [s for s in state.validated if s <= watermark]
    return state.validated[max(steps)] if steps else None


def on_mismatch(state: RollbackState, found: SdcMismatch, watermark: int) -> list[Rollback | Page]:
    if found.attempt in state.handled:
        return []
    state.handled.add(found.attempt)
    target = clean_ancestor(state, watermark)
    if target is None:
        newest = max(state.validated, default=-1)
        text = (
            f"SDC at step {found.step} on {found.node or '?'}: no validated checkpoint at or before the "
            f"verification watermark (step {watermark}); the newest is step {newest}, written after "
            "the last passing check. Choose an older milestone or accept the risk."
        )
        return [page(found, "no_clean_ancestor", ReasonCode.NO_CLEAN_ANCESTOR, text, [found.event_id])]
    text = (
        f"SDC at step {found.step} on {found.node or '?'}: roll back to checkpoint {target.step}, the "
        f"newest validated one at or before the verification watermark (step {watermark}); "
        f"{len([s for s in state.validated if s > watermark])} newer checkpoint(s) may hold corrupt weights"
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
