"""Failure prediction, the decision (issue 46): drain a node predicted to fail, at a
checkpoint boundary, when that pays in expected goodput; and the lemon node's page.

A drain turns an unplanned failure (the restart R, and the work since the last
checkpoint, L: half an interval on average) into a planned stop at a checkpoint boundary
(the checkpoint's blocking time C and the swap to a pre-tested spare, measured on the
run's drains, else the policy's prior). So drain when

    P(failure within the horizon) x (R + L) > C + swap

with R the run's measured restarts (eviction's estimate), L half the interval in force,
C the run's measured checkpoint cost. The decision, either way, is a DrainDecision with
its numbers; a drain is a DrainNode for the launcher (which takes the boundary within
``drain_within_s``), one per node per run. Noise never gets here: hazard.py predicts only
past its false-alarm threshold. Decided on shard 0 (a shard's prediction is forwarded).

A node the launcher kept out of the launch for its history across runs (NodeExcluded:
trainguard/common/lemons.py) pages ``lemon_node`` once per node per run.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ....schemas import (
    DrainDecision,
    DrainNode,
    FailurePredicted,
    InterruptionRecovered,
    NodeExcluded,
    Page,
    Reason,
    ReasonCode,
)
from ..ids import derived_id
from .eviction import restart_estimate_s
from .paging import page

if TYPE_CHECKING:
    from ..policy import CorePolicy
    from ..state import RunState


def drain_cost_s(run: RunState, policy: CorePolicy) -> float:
    """C + swap: the run's measured checkpoint cost (else none yet) and its measured drains
    (else the prior)."""
    checkpoint = run.interval.cost_s() or 0.0
    swap = statistics.median(run.drain.costs) if run.drain.costs else policy.prediction.drain_swap_prior_s
    return checkpoint + swap


def drain_wait_s(
    probability: float, horizon_s: float, at_stake_s: float, run: RunState, policy: CorePolicy
) -> float:
    """How long the drain may wait for the checkpoint the cadence makes due (saving the
    checkpoint's blocking cost C) before it checkpoints at once: while the failure it risks,
    P x (wait / horizon) x (R + L), costs less than C; at most drain_within_s. An urgent
    prediction, or a run whose checkpoint cost is not measured yet, checkpoints at once."""
    checkpoint = run.interval.cost_s() or 0.0
    risk_per_s = probability * at_stake_s / max(horizon_s, 1.0)
    if risk_per_s <= 0:
        return policy.prediction.drain_within_s
    return min(policy.prediction.drain_within_s, checkpoint / risk_per_s)


def on_predicted(
    run: RunState, event: FailurePredicted, policy: CorePolicy
) -> list[DrainDecision | DrainNode]:
    """Decide about one prediction (shard 0). A node already drained, out, or not in the
    run's world is not decided again."""
    state, node = run.drain, event.node
    if node in state.drained or node in run.paging.out or (run.nodes and node not in run.nodes):
        return []
    restart = restart_estimate_s(run.eviction, policy.eviction)
    interval = run.interval.current_s or policy.interval.initial_s
    lost = interval / 2
    cost = drain_cost_s(run, policy)
    saving = event.probability * (restart + lost) - cost
    drain = saving > 0
    within = drain_wait_s(event.probability, event.horizon_s, restart + lost, run, policy)
    decision_id = derived_id("drain_decision", event.event_id)
    arithmetic = (
        f"P {event.probability:.0%} x (restart {restart:.0f} s + lost work {lost:.0f} s, half the "
        f"{interval:.0f} s interval) = {event.probability * (restart + lost):.0f} s expected "
        f"{'>' if drain else '<='} the drain's {cost:.0f} s (checkpoint and swap to a spare)"
    )
    decision = DrainDecision(
        event_id=decision_id,
        run_id=run.run_id,
        attempt=run.attempt,
        rank=event.rank,
        node=node,
        step=run.job_step,
        ts=event.ts,
        reason=Reason(
            code=ReasonCode.DRAIN if drain else ReasonCode.DRAIN_DECLINED,
            text=(
                f"drain {node} at the checkpoint boundary within {within:.0f} s (waiting longer risks "
                f"more than the checkpoint it saves): {arithmetic}"
                if drain
                else f"keep {node}: {arithmetic}"
            ),
        ),
        caused_by=[event.event_id],
        decision="drain" if drain else "decline",
        probability=event.probability,
        horizon_s=event.horizon_s,
        restart_s=restart,
        lost_work_s=lost,
        drain_cost_s=cost,
        expected_saving_s=saving,
        within_s=within,
    )
    if not drain:
        state.declined[node] = event.ts
        return [decision]
    command_id = derived_id("drain_node", decision_id)
    state.drained[node] = (command_id, run.attempt)
    command = DrainNode(
        command_id=command_id,
        run_id=run.run_id,
        attempt=run.attempt,
        issued_ts=event.ts,
        reason=decision.reason,
        caused_by=[decision_id],
        node=node,
        within_s=within,
    )
    return [decision, command]


def on_recovered(run: RunState, recovered: InterruptionRecovered) -> None:
    """A drain's planned stop was measured: one more sample of its cost (the restart and
    any work re-done)."""
    if recovered.interruption_id in run.drain.interruptions:
        run.drain.interruptions.discard(recovered.interruption_id)
        run.drain.costs.append(recovered.restart_s + recovered.lost_s)


def issued_in(run: RunState, attempt: int) -> tuple[str, str] | None:
    """The drain (command id, node) issued during `attempt`, if any: the next attempt's
    start is its planned stop."""
    for node, (command_id, made_in) in run.drain.drained.items():
        if made_in == attempt:
            return command_id, node
    return None


def on_excluded(run: RunState, event: NodeExcluded) -> list[Page]:
    """A lemon node kept out of the launch: page once per node per run, with the reason."""
    key = ("lemon_node", event.node)
    if key in run.paging.paged:
        return []
    run.paging.paged.add(key)
    text = (
        f"{event.node} kept out of the launch: {event.failures} failures or quarantines in "
        f"{event.window_days:g} days across runs ({', '.join(event.runs[:8]) or 'runs not named'}); "
        f"{event.reason.text[:400]}"
    )
    return [page(event, "lemon_node", ReasonCode.LEMON_NODE, text, [event.event_id])]
