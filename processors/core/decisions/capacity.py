"""Elastic training's decision in the core (issue 45; seed §9.4): an interruption that takes
nodes out of the pool (a quarantine) with no spare known to be ready leaves the run short
of capacity, and the core decides, by the shared rule (trainguard/common/elastic.py),
whether the launcher waits for a replacement or goes on at once with the survivors in a
smaller world and grows back at a checkpoint boundary. The decision travels on the
interruption's InterruptionDecided (``capacity``, ``world_size``, ``expected_replacement_s``,
its reason naming the numbers), which the timeline shows as a decision of its own.

The rule's inputs are the run's history where it has some, else the policy's priors:
  replacement  from a loss with no spare to the next attempt at full size (a wait's
               launch; a shrink's grow-back, later by up to a checkpoint interval)
  restart R    recoveries onto a ready node (not a wait, a shrink or a grow)
  shrink, grow the recoveries of the shrinks and the planned grow-backs
A launcher that says how many spares it holds (RunStarted.spares) gets no decision while
they cover the nodes lost; one that does not say gets one for every loss: what to do if
no spare is ready, which it applies only when none is.

The grow-back is a planned stop (InterruptionCause.ELASTIC, declared when the larger
world starts, like an eviction's): a cost to account, not a failure.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ....common.elastic import ElasticChoice, choose, worlds
from ....schemas import (
    Interruption,
    InterruptionCause,
    InterruptionDecided,
    InterruptionRecovered,
    QuarantineNode,
    Reason,
    ReasonCode,
    RunStarted,
)
from ..outputs import decided
from .capacity_state import CapacityState, ElasticPolicy

if TYPE_CHECKING:
    from ..policy import CorePolicy
    from ..state import RunState

#: Planned stops: a cost to account, not a failure (no baseline, page or quarantine).
PLANNED = frozenset({InterruptionCause.EVICTION, InterruptionCause.ELASTIC, InterruptionCause.DRAIN})


def on_run_started(state: CapacityState, run: RunState, event: RunStarted, policy: ElasticPolicy) -> None:
    """An attempt registers (call before the run takes its world size): the full world, the
    spares it starts with, a replacement's arrival measured, a grow-back to declare."""
    previous = run.world_size
    state.full_world = max(state.full_world, event.world_size)
    if event.attempt <= state.attempt:
        return  # the same attempt again
    state.attempt = event.attempt
    state.spares, state.taken, state.growing = event.spares, 0, ""
    if previous is not None and event.world_size > previous and state.shrunk_by:
        state.growing, state.grow_from = state.shrunk_by, previous
    if event.world_size < state.full_world:  # smaller: the loss it restarts after made it so
        opened = run.open_interruption
        loss = opened.interruption_id if opened is not None else state.last_loss
        state.shrunk_by = state.shrunk_by or loss
    else:
        state.shrunk_by = ""
    if event.world_size >= state.full_world and state.waiting:
        for detected_ts in state.waiting.values():
            _sample(state.eta_s, max(0.0, event.ts - detected_ts), policy.samples)
        state.waiting.clear()


def take_grow(state: CapacityState) -> str:
    """The loss whose shrink the attempt starting now grows back from ('' none), once."""
    grown, state.growing = state.growing, ""
    return grown


def grow_reason(run: RunState, loss_id: str, attempt: int) -> Reason:
    """Why attempt `attempt`, at a larger world, followed the smaller one (take_grow)."""
    return Reason(
        code=ReasonCode.CAPACITY_GROW,
        text=f"attempt {run.attempt} stopped at a checkpoint to grow back from {run.capacity.grow_from} "
        f"to {run.world_size} of {run.capacity.full_world} ranks (the replacement for interruption "
        f"{loss_id[:12]} is in): planned, not a failure",
    )


def on_recovered(state: CapacityState, recovered: InterruptionRecovered, policy: ElasticPolicy) -> None:
    """A restart was measured: a sample of what it was (a shrink: it resumed at a smaller
    world; a grow; a plain restart onto a ready node); a restart at full size after a
    capacity decision may have waited for the replacement: no sample of R."""
    iid = recovered.interruption_id
    decided = state.decided.pop(iid, "")
    if iid in state.grows:
        state.grows.discard(iid)
        _sample(state.grow_s, recovered.restart_s, policy.samples)
    elif decided and 0 < recovered.world_size < state.full_world:
        _sample(state.shrink_s, recovered.restart_s, policy.samples)
    elif not decided:
        _sample(state.restart_s, recovered.restart_s, policy.samples)


def decide(
    run: RunState, interruption: Interruption, outputs: Sequence[object], policy: CorePolicy
) -> InterruptionDecided:
    """The go-ahead for `interruption`, with the capacity decision when it takes nodes out
    that no ready spare covers. Call once per interruption, after its quarantines."""
    state = run.capacity
    if interruption.cause in PLANNED:
        if interruption.cause == InterruptionCause.ELASTIC:
            state.grows.add(interruption.interruption_id)
        return decided(interruption)
    lost = {
        o.node for o in outputs if isinstance(o, QuarantineNode) and o.attempt == interruption.attempt
    } & set(run.nodes)
    if not lost:
        return decided(interruption)
    short = state.spares is None or state.spares - state.taken < len(lost)
    state.taken += len(lost)
    if not short:
        return decided(interruption)  # a spare takes each place: the restart is at full size
    choice = _choose(run, lost, policy)
    action = choice.action if choice.action == "shrink" and policy.elastic.enabled else "wait"
    text = choice.reason
    if choice.action == "shrink" and not policy.elastic.enabled:
        text = f"wait: elastic training is off (policy elastic.enabled); the rule would {text}"
    if state.spares is None:  # the launcher did not say: it applies this only if it is short
        text = f"if no spare is ready: {text}"
    iid = state.last_loss = interruption.interruption_id
    state.decided[iid] = action
    state.waiting.setdefault(iid, interruption.ts)
    code = ReasonCode.CAPACITY_SHRINK if action == "shrink" else ReasonCode.CAPACITY_WAIT
    return decided(
        interruption,
        capacity=action,
        world_size=choice.world_size if action == "shrink" else None,
        expected_replacement_s=choice.replacement_eta_s,
        reason=Reason(code=code, text=text[:2000]),
    )


def _choose(run: RunState, lost: set[str], policy: CorePolicy) -> ElasticChoice:
    """The rule's inputs for this run: its world, the survivors, what each option costs."""
    state, elastic = run.capacity, policy.elastic
    world = run.world_size or len(run.ranks)
    full = max(state.full_world, world)
    per_node = max(1, run.ranks_per_node)
    gone = sum(
        len(range(i * per_node, min((i + 1) * per_node, world))) for i, n in enumerate(run.nodes) if n in lost
    )
    survivors = max(0, world - gone)
    allowed = worlds(survivors, elastic.world_multiple or per_node, elastic.batch_divisor)
    interval_s = run.interval.current_s or policy.interval.initial_s
    return choose(
        full,
        survivors,
        math.ceil(full * elastic.min_world_fraction),
        _median(state.eta_s, elastic.replacement_prior_s),
        _median(state.restart_s, policy.eviction.default_restart_s),
        _median(state.shrink_s, elastic.shrink_prior_s),
        _median(state.grow_s, elastic.grow_prior_s),
        allowed,
        boundary_s=interval_s / 2,
    )


def _median(samples: deque[float], prior: float) -> float:
    return statistics.median(samples) if samples else prior


def _sample(samples: deque[float], value: float, keep: int) -> None:
    samples.append(value)
    while len(samples) > keep:
        samples.popleft()
