"""The pair cross-rank SDC check (seed R3): two ranks compute the same microbatch and
compare at a tolerance measured on good hardware; a disagreement is bisected with a
third rank on a third node, and the odd one out is the device that lies.

This is the defence against a deterministically wrong GPU, which passes its own bitwise
self-check because it computes the same wrong answer twice. The scheduler now issues the
ring check (:mod:`.sdc_ring`), which covers every rank each time; this module judges the
pair checks of older logs and the three-rank bisection of a ring's lone failing edge.
A passing check moves the cross-rank watermark of the ranks it covered (not the
self-check one: a cross-rank check vouches against deterministic faults).
"""

from __future__ import annotations

import math

from ....schemas import Command, CrossRankCheck, Derived, Reason, ReasonCode, RunCrossRankCheck, SdcMismatch
from ..ids import derived_id
from ..outputs import node_of
from ..state import RunState
from .sdc_checks import bisect_three, mismatch, quarantine, third_rank, watermark_text, world_of
from .sdc_state import PendingBisection, SdcPolicy, SdcState, remember


def on_cross_check(
    state: SdcState, run: RunState, event: CrossRankCheck, policy: SdcPolicy
) -> list[Derived | Command]:
    """Two values: within tolerance -> a good-hardware sample and the watermark advances;
    beyond -> RunCrossRankCheck with a third rank. Three values: the odd one out gets an
    SdcMismatch and its node a QuarantineNode and a RunNodeSelfTest; if nobody can be named, SdcMismatch with
    rank -1 says why, unless all three agree and the disagreement bisected was within
    ``unreproduced_margin`` tolerances (refuted: the watermark moves on). Before the
    tolerance is calibrated, the spread is recorded only."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    ranks, values = list(event.ranks), list(event.values)
    if len(ranks) != len(values) or len(set(ranks)) != len(ranks):
        return []  # malformed report: nothing can be judged from it
    if not remember(current.seen_checks, ("cross", event.microbatch_id, tuple(ranks))):
        return []
    tolerance = state.tolerance(policy)
    if tolerance is None:  # calibrating: assume good hardware, judge nothing
        for i in range(len(values)):
            for j in range(i + 1, len(values)):
                _sample(state, abs(values[i] - values[j]), policy)
        return []
    where = ", ".join(
        f"rank {r} on {node_of(run, r) or '?'} = {v!r}" for r, v in zip(ranks, values, strict=True)
    )
    if len(values) == 2:
        gap = abs(values[0] - values[1])
        if gap <= tolerance:
            _sample(state, gap, policy)
            state.vouch(ranks, event.step)
            return []
        third = third_rank(world_of(run), run.ranks_per_node, ranks)
        if third is None:
            state.suspect(event.step)
            text = f"{where}: differ by {gap:.3g} > tolerance {tolerance:.3g}; no third rank to bisect"
            return [_mismatch(state, run, event, -1, "", text, tolerance, gap)]
        current.bisecting[event.microbatch_id] = PendingBisection(event.event_id, event.step, gap / tolerance)
        state.hold(event.step)
        reason = Reason(
            code=ReasonCode.CROSS_RANK_MISMATCH,
            text=f"{where}: differ by {gap:.3g} > tolerance {tolerance:.3g}, one of them is lying; "
            f"bisecting with rank {third} on {node_of(run, third) or '?'}",
        )
        bisect = RunCrossRankCheck(
            command_id=derived_id("run_cross_rank_check", event.event_id),
            run_id=run.run_id,
            attempt=run.attempt,
            ranks=[*ranks, third],
            issued_ts=event.ts,
            reason=reason,
            caused_by=[event.event_id],
            step=max(0, event.step),
            microbatch_id=event.microbatch_id,
        )
        return [bisect]

    pending: PendingBisection | str | None = current.bisecting.pop(event.microbatch_id, None)
    if isinstance(pending, str):  # a snapshot from before PendingBisection: judged as before
        pending = PendingBisection(pending, event.step, math.inf)
    if pending is not None:
        tolerance = pending.tolerance(state, policy, values) or tolerance
    verdict = bisect_three(values, tolerance)
    if verdict.liar is not None or verdict.all_agree:
        for i, j in verdict.agreeing:
            _sample(state, abs(values[i] - values[j]), policy)
    refuted = pending is not None and pending.excess <= policy.unreproduced_margin
    if verdict.all_agree and (pending is None or refuted):
        # Nothing disagrees now; a disagreement within reach of the noise tail that the
        # third rank does not reproduce is refuted (a transient fault is the self-check's).
        state.vouch(ranks, event.step)
        if pending is not None:
            state.release(pending.step, confirmed=False)
        return []
    if pending is not None:
        state.release(pending.step, confirmed=True)
    state.suspect(event.step if pending is None else min(pending.step, event.step))
    first = pending.event_id if pending is not None else None
    if verdict.liar is not None:
        liar = ranks[verdict.liar]
        state.vouch([r for r in ranks if r != liar], event.step)
        node = node_of(run, liar) or (event.node if event.rank == liar else "")
        text = (
            f"{where}: rank {liar} on {node or '?'} is the odd one out, off by "
            f"{verdict.deviation:.3g} (tolerance {tolerance:.3g})"
        )
        found = _mismatch(state, run, event, liar, node, text, tolerance, verdict.deviation, first)
        return [found, *quarantine(current, run, found)]
    if verdict.all_agree:
        what = (
            "all three agree now: the first disagreement did not reproduce, and it was "
            f"{pending.excess if pending else math.nan:.3g} tolerances off, past the noise "
            f"(unreproduced_margin {policy.unreproduced_margin:g}): a transient fault"
        )
    elif verdict.agreeing:
        what = "a chain (one value agrees with two that disagree): nobody can be named"
    else:
        what = "all three disagree: nobody can be named"
    text = f"{where}: {what}; tolerance {tolerance:.3g}"
    return [_mismatch(state, run, event, -1, "", text, tolerance, verdict.deviation, first)]


def _mismatch(
    state: SdcState,
    run: RunState,
    event: CrossRankCheck,
    rank: int,
    node: str,
    text: str,
    tolerance: float,
    deviation: float,
    first: str | None = None,
) -> SdcMismatch:
    state.mismatches += 1
    return mismatch(
        run,
        event,
        method="cross_rank",
        rank=rank,
        node=node,
        code=ReasonCode.CROSS_RANK_MISMATCH,
        text=f"{text}. {watermark_text(state, rank)}",
        tolerance=tolerance,
        deviation=deviation,
        caused_by=[event.event_id] + ([first] if first else []),
    )


def _sample(state: SdcState, gap: float, policy: SdcPolicy) -> None:
    if math.isfinite(gap):
        state.spread.add(gap, policy.cross_check_window)
