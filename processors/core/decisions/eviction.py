"""Straggler eviction (seed §7 step 3 and R2): evict only after diagnosis, only when it pays
back soon enough, at most once an hour, and never twice in a row in one rack.

A diagnosed straggler whose action recommends eviction (EVICT, EVICT_ONCE,
EVICT_AND_REPLACE) is evicted when the planned restart pays back within the horizon:

    straggler_cost = 1 - 1/slowdown         the job runs at its slowest rank's pace, so a
                                            rank 1.25x slow costs the job 20% of its steps
    benefit        = P(healthy) x straggler_cost
    payback_s      = R / benefit            R: the run's measured restart seconds

Seed example: a straggler costing 20% (slowdown 1.25), R = 600 s, P = 1: 3000 s = 50 min.

P(healthy) is the mean of a Beta posterior over the outcomes of this run's past evictions,
(a + resolved) / (a + b + resolved + unresolved), with the prior a = prior_healthy x w,
b = (1 - prior_healthy) x w. There is no floor on P: when evictions stop resolving
stragglers P falls, R / (P x cost) grows past the horizon and eviction stops by itself;
when they resolve again P rises and it resumes (seed R2: "self-correcting").

An eviction's outcome: the straggle is resolved when the first attempt after the one the
eviction was issued in completes `outcome_steps` job steps past its first step without
the evicted rank being flagged again; the rank flagged in a later attempt before that is
an unresolved eviction. The rank number is what is followed: an evicted rank keeps its
number on the replacement node, and an environmental cause (a hot rack) that diagnosis
missed makes that rank straggle again. (If the eviction was never carried out, e.g. the
attempt crashed before its checkpoint boundary, the next attempt still judges it.)

A node counts once (issue 14): a straggler on a node that is already leaving the job in
this attempt (an eviction issued for another of its GPUs, or a quarantine) is recorded
"not evicted" (NODE_ALREADY_LEAVING): the node's eviction replaces every GPU of it, so
there is no second EvictRank, no same-rack page, no deferral to act on later.

Guards, checked in this order once the payback is short enough:

1. same rack: the run's most recent eviction was in this straggler's rack: a Page
   (rule ``same_rack_eviction``) instead of an eviction, once per earlier eviction;
   later candidates of that rack are "paged" without paging again. An eviction in
   another rack ends it. An unknown rack never matches.
2. rate limit: an eviction less than `min_gap_s` of event time ago: the candidate is
   "deferred" and decided again (all rules, current P and R) by :func:`on_time` once the
   gap has passed: the one with the shortest payback first, one per gap. A deferred
   candidate is dropped when its straggle clears (:func:`on_cleared`) or a newer attempt
   starts (its EvictRank would name a dead attempt; if it still straggles, it is flagged
   and diagnosed again in the new attempt).

The EvictRank command goes out at once: the rank-side actuator carries it out at the next
checkpoint boundary. Pure: time is the events' ts; no clock, no I/O, no randomness.
"""

from __future__ import annotations

import statistics
from collections import deque

from ....schemas import (
    EvictionDecision,
    EvictionVerdict,
    EvictRank,
    InterruptionRecovered,
    Page,
    Reason,
    ReasonCode,
    StragglerDiagnosed,
    StragglerFlagged,
)
from ..ids import derived_id
from .eviction_state import (
    _HANDLED_MAX,
    EVICTING_ACTIONS,
    NEVER_S,
    EvictionOutcome,
    EvictionPolicy,
    EvictionState,
    _Candidate,
    _Outcome,
)
from .paging import page

# --------------------------------------------------------------------------- state


# --------------------------------------------------------------------------- formulas


def p_healthy(state: EvictionState, policy: EvictionPolicy) -> float:
    """P(a replacement is healthy): the Beta posterior mean over this run's eviction outcomes."""
    a = policy.prior_healthy * policy.prior_weight
    b = (1 - policy.prior_healthy) * policy.prior_weight
    return (a + state.resolved) / (a + b + state.resolved + state.unresolved)


def straggler_cost(slowdown: float) -> float:
    """Fraction of the job's throughput a rank `slowdown` x slow costs (the job runs at its pace)."""
    return max(0.0, 1.0 - 1.0 / slowdown) if slowdown > 0 else 0.0


def payback_s(restart_s: float, benefit: float) -> float:
    """R / benefit, NEVER_S when there is no benefit (or it would be longer than that)."""
    if benefit <= 0:
        return NEVER_S
    return min(NEVER_S, restart_s / benefit)


def restart_estimate_s(state: EvictionState, policy: EvictionPolicy) -> float:
    """R: the median of the run's measured restarts, or the policy default before any."""
    return statistics.median(state.restarts) if state.restarts else policy.default_restart_s


# --------------------------------------------------------------------------- decisions


def on_diagnosed(
    state: EvictionState,
    diagnosed: StragglerDiagnosed,
    rack: str | None,
    restart_s: float | None,
    policy: EvictionPolicy,
) -> list[EvictionDecision | EvictRank | Page]:
    """Decide about one diagnosed straggler (once per diagnosed event id). `rack` is the
    rack of diagnosed.node (None: unknown); `restart_s` overrides R (None: measured/default).
    Call :func:`on_flagged` for the flag first, so that its outcome counts in P."""
    if diagnosed.event_id in state.handled:
        return []
    state.handled[diagnosed.event_id] = None
    if len(state.handled) > _HANDLED_MAX:
        state.handled.popitem(last=False)
    decision_id = derived_id("eviction_decision", diagnosed.event_id)
    return _decide(state, diagnosed, rack, restart_s, policy, decision_id, diagnosed.ts, [])


def on_time(
    state: EvictionState, ts: float, attempt: int, policy: EvictionPolicy, restart_s: float | None = None
) -> list[EvictionDecision | EvictRank | Page]:
    """Event time advanced to `ts` in `attempt`: a deferred candidate whose gap has passed is
    decided again (call on every event; O(1) while nothing is deferred or the gap is open)."""
    if not state.deferred:
        return []
    stale = [rank for rank, c in state.deferred.items() if c.diagnosed.attempt < attempt]
    for rank in stale:
        del state.deferred[rank]
    if not state.deferred or (state.last_ts is not None and ts - state.last_ts < policy.min_gap_s):
        return []
    r = restart_s if restart_s is not None else restart_estimate_s(state, policy)
    p = p_healthy(state, policy)
    rank, candidate = min(
        state.deferred.items(),
        key=lambda item: (payback_s(r, p * straggler_cost(_slowdown(item[1].diagnosed))), item[0]),
    )
    del state.deferred[rank]
    decision_id = derived_id("eviction_decision", candidate.diagnosed.event_id, "after", state.last_id)
    return _decide(
        state,
        candidate.diagnosed,
        candidate.rack,
        restart_s,
        policy,
        decision_id,
        ts,
        [candidate.decision_id],
    )


def on_node_leaving(state: EvictionState, node: str, attempt: int, cause_id: str) -> None:
    """`node` leaves the job at the end of `attempt` (a quarantine): its other GPUs'
    straggles are that node's, not new evictions."""
    if node:
        state.leaving[node] = (attempt, cause_id)
        state.deferred = {r: c for r, c in state.deferred.items() if c.diagnosed.node != node}


def on_cleared(state: EvictionState, rank: int) -> None:
    """The rank is back within the threshold (StragglerCleared): forget its deferred eviction."""
    state.deferred.pop(rank, None)


def on_recovered(state: EvictionState, recovered: InterruptionRecovered, policy: EvictionPolicy) -> None:
    """A restart was measured: one more sample of R."""
    if state.restarts.maxlen != policy.restart_samples:
        state.restarts = deque(state.restarts, maxlen=policy.restart_samples)
    state.restarts.append(recovered.restart_s)


# --------------------------------------------------------------------------- outcomes


def on_flagged(
    state: EvictionState, flagged: StragglerFlagged, policy: EvictionPolicy
) -> EvictionOutcome | None:
    """A rank was flagged: if it is an evicted rank, flagged in a later attempt within
    `outcome_steps` of that attempt's first step, its eviction did not resolve the straggle.
    O(1) while no eviction is waiting for its outcome."""
    if not state.pending:
        return None
    for outcome in state.pending:
        if outcome.rank != flagged.rank or flagged.attempt <= outcome.attempt:
            continue
        state.pending.remove(outcome)
        late = (
            flagged.attempt == outcome.judged_attempt
            and flagged.step - outcome.first_step >= policy.outcome_steps
        )
        if late:  # on_step missed the window's end: the eviction had resolved it by then
            state.resolved += 1
        else:
            state.unresolved += 1
        return EvictionOutcome(outcome.decision_id, outcome.rank, resolved=late)
    return None


def issued_in(state: EvictionState, attempt: int) -> tuple[str, int] | None:
    """(decision id, rank) of the eviction issued in `attempt`, if any: the restart that
    ends that attempt is the eviction's, not a failure."""
    for outcome in state.pending:
        if outcome.attempt == attempt:
            return outcome.decision_id, outcome.rank
    return None


def on_step(state: EvictionState, attempt: int, step: int, policy: EvictionPolicy) -> EvictionOutcome | None:
    """The job completed `step` in `attempt` (call once per new job step): an eviction whose
    next attempt got `outcome_steps` past its first step without a flag resolved the straggle.
    O(1): returns at once when no eviction is waiting for its outcome."""
    if not state.pending:
        return None
    for outcome in state.pending:
        if attempt <= outcome.attempt:
            continue
        if attempt != outcome.judged_attempt:  # the first attempt after the eviction (or a restart of it)
            outcome.judged_attempt, outcome.first_step = attempt, step
        if step - outcome.first_step >= policy.outcome_steps:
            state.pending.remove(outcome)
            state.resolved += 1
            return EvictionOutcome(outcome.decision_id, outcome.rank, resolved=True)
    return None


# --------------------------------------------------------------------------- internals


def _slowdown(diagnosed: StragglerDiagnosed) -> float:
    return float(diagnosed.evidence.get("slowdown", 1.0))


def _decide(
    state: EvictionState,
    diagnosed: StragglerDiagnosed,
    rack: str | None,
    restart_s: float | None,
    policy: EvictionPolicy,
    decision_id: str,
    ts: float,
    earlier: list[str],
) -> list[EvictionDecision | EvictRank | Page]:
    slowdown = _slowdown(diagnosed)
    cost = straggler_cost(slowdown)
    p = p_healthy(state, policy)
    r = restart_s if restart_s is not None else restart_estimate_s(state, policy)
    benefit = p * cost
    payback = payback_s(r, benefit)
    rank, node = diagnosed.rank, diagnosed.node or "unknown node"
    where = f"{node}, {rack}" if rack else node
    history = (
        f"P(healthy replacement) {p:.2f} ({state.resolved} of {state.resolved + state.unresolved} "
        f"past evictions resolved the straggle, prior {policy.prior_healthy:g} worth {policy.prior_weight:g})"
    )
    numbers = (
        f"{slowdown:.2f}x slow costs {cost:.1%} of throughput; {history}; benefit {benefit:.1%}; "
        f"payback R/benefit = {r:.0f} s / {benefit:.4f} = {_duration(payback)} "
        f"(horizon {_duration(policy.horizon_s)})"
    )
    why = diagnosed.reason.text[:300]

    def decision(verdict: EvictionVerdict, code: ReasonCode, text: str) -> EvictionDecision:
        return EvictionDecision(
            event_id=decision_id,
            run_id=diagnosed.run_id,
            attempt=diagnosed.attempt,
            rank=rank,
            node=diagnosed.node,
            step=diagnosed.step,
            ts=ts,
            reason=Reason(code=code, text=text[:2000]),
            caused_by=[diagnosed.event_id, *earlier],
            decision=verdict,
            slowdown=slowdown,
            straggler_cost=cost,
            p_healthy=p,
            restart_s=r,
            benefit=benefit,
            payback_s=payback,
            horizon_s=policy.horizon_s,
            evictions_resolved=state.resolved,
            evictions_unresolved=state.unresolved,
        )

    leaving = state.leaving.get(diagnosed.node) if diagnosed.node else None
    if leaving is not None and leaving[0] == diagnosed.attempt:
        text = (
            f"rank {rank} ({where}) not evicted again: {node} already leaves the job at this attempt's "
            f"end ({leaving[1][:12]}), and with it every GPU of it; one node, one eviction"
        )
        return [decision(EvictionVerdict.NOT_EVICTED, ReasonCode.NODE_ALREADY_LEAVING, text)]
    if not policy.enabled:
        text = f"rank {rank} ({where}) not evicted: automatic eviction is disabled by policy; {numbers}"
        return [decision(EvictionVerdict.NOT_EVICTED, ReasonCode.EVICTION_DECLINED, text)]
    if diagnosed.action not in EVICTING_ACTIONS:
        text = (
            f"rank {rank} ({where}) not evicted: diagnosed {diagnosed.diagnosis}, action "
            f"{diagnosed.action} ({why})"
        )
        return [decision(EvictionVerdict.NOT_EVICTED, ReasonCode.EVICTION_DECLINED, text)]
    if payback > policy.horizon_s:
        text = (
            f"rank {rank} ({where}) not evicted: the restart would not pay back within the horizon: {numbers}"
        )
        return [decision(EvictionVerdict.DECLINED, ReasonCode.EVICTION_DECLINED, text)]
    if rack is not None and state.last_ts is not None and state.last_rack == rack:
        first = state.last_id not in state.paged_after
        text = (
            f"rank {rank} ({where}) not evicted: the run's previous eviction was in {rack} too; two "
            "consecutive evictions in one rack point at the rack, not the nodes: a human decides"
            f"{'' if first else ' (already paged)'}; {numbers}"
        )
        made = decision(EvictionVerdict.PAGED, ReasonCode.PAGE_SAME_RACK, text)
        if not first:
            return [made]
        state.paged_after.add(state.last_id)
        evidence = [state.last_id, diagnosed.event_id]
        return [made, page(made, "same_rack_eviction", ReasonCode.PAGE_SAME_RACK, text, evidence)]
    if state.last_ts is not None and ts - state.last_ts < policy.min_gap_s:
        wait = state.last_ts + policy.min_gap_s - ts
        text = (
            f"rank {rank} ({where}) eviction deferred {_duration(wait)}: the run's previous eviction was "
            f"{_duration(ts - state.last_ts)} ago (at most one per {_duration(policy.min_gap_s)}); {numbers}"
        )
        made = decision(EvictionVerdict.DEFERRED, ReasonCode.EVICTION_DEFERRED, text)
        state.deferred[rank] = _Candidate(diagnosed, rack, made.event_id)
        return [made]
    text = f"evict rank {rank} ({where}) at the next checkpoint boundary: {numbers}; diagnosis: {why}"
    made = decision(EvictionVerdict.EVICT, ReasonCode.EVICTION, text)
    command = EvictRank(
        command_id=derived_id("evict_rank", made.event_id),
        run_id=diagnosed.run_id,
        attempt=diagnosed.attempt,
        ranks=None,
        issued_ts=ts,
        reason=made.reason,
        caused_by=[made.event_id],
        rank=rank,
    )
    state.last_ts, state.last_rack, state.last_id = ts, rack, made.event_id
    state.evictions += 1
    state.deferred.pop(rank, None)
    on_node_leaving(state, diagnosed.node, diagnosed.attempt, made.event_id)
    state.pending.append(_Outcome(made.event_id, rank, diagnosed.attempt))
    return [made, command]


def _duration(seconds: float) -> str:
    if seconds >= NEVER_S:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
