"""Small builders shared by the detectors' outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ...schemas import Abort, Derived, Envelope, Interruption, InterruptionDecided, Reason
from ...schemas.codec import RejectReason
from .ids import derived_id

if TYPE_CHECKING:
    from .state import RunState


def node_of(run: RunState, rank: int) -> str:
    """The node a rank reported from in this attempt ('' when unknown)."""
    state = run.ranks.get(rank)
    return state.node if state is not None else ""


def abort_for(run: RunState, cause: Derived, stack_dump: bool) -> Abort:
    """Abort every rank of the current attempt because of `cause` (id derived from it)."""
    return Abort(
        command_id=derived_id("abort", cause.event_id),
        run_id=run.run_id,
        attempt=run.attempt,
        ranks=None,
        issued_ts=cause.ts,
        reason=cause.reason,
        caused_by=[cause.event_id],
        stack_dump=stack_dump,
    )


def decided(
    interruption: Interruption,
    capacity: Literal["wait", "shrink"] | None = None,
    world_size: int | None = None,
    expected_replacement_s: float | None = None,
    reason: Reason | None = None,
) -> InterruptionDecided:
    """The launcher may restart after `interruption`: everything decided about it was
    output before this (issue 18: no fixed wait for decisions); with the capacity decision
    when it took nodes out that no ready spare covers (decisions/capacity.py, issue 45)."""
    return InterruptionDecided(
        command_id=derived_id("decided", interruption.event_id),
        run_id=interruption.run_id,
        attempt=interruption.attempt,
        ranks=None,
        issued_ts=interruption.ts,
        reason=reason or interruption.reason,
        caused_by=[interruption.event_id],
        interruption_id=interruption.interruption_id,
        capacity=capacity,
        world_size=world_size,
        expected_replacement_s=expected_replacement_s,
    )


@dataclass(frozen=True, slots=True)
class Forward:
    """A report that a non-coordinator shard may not decide on (schemas/sharding.py): the
    driver re-publishes `event`, unchanged (same event_id), to the run's shard 0."""

    event: Envelope
    why: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Input the core refuses (a rank outside the run's world size): the driver parks
    `event` in the dead-letter topic with `reason` and `detail`, as the decoder does with
    what it refuses, so live and replay reject the same records for the same reason."""

    event: Envelope
    reason: RejectReason
    detail: str
