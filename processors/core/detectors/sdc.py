"""The silent-data-corruption detector (seed §7 failure 3, R3, R6).

Three defences, cheapest first, each a pure function of the state and one event:

* cheap invariants on every step's stats: a non-finite loss interrupts the attempt
  (once, however many ranks report it) with an all-rank stack-dump abort; a grad norm
  above ``multiplier x`` the running p99 of earlier steps skips that update and counts;
* the rotating bitwise self-check (one rank recomputes its own microbatch on the same
  device, ``==`` on digests): any difference names the node, quarantines it and commands
  a node self-test (seed §SDC (c));
* the ring cross-rank check (:mod:`.sdc_ring`): every rank also recomputes a neighbour's
  microbatch on another node, at a tolerance measured on good hardware; a device failing
  both of its comparisons is named at once, a lone failing comparison is bisected with a
  third rank (:mod:`.sdc_cross`, which also judges the pair checks of older logs). Its
  cadence follows from the cost budget (``SdcPolicy.cross_check_interval``).

Two watermarks (R6), one per kind of evidence: a passing self-check advances the
self-check watermark (``SdcState.last_passing_check_step``, global: it vouches against
transient faults), which a mismatch freezes until an attempt resumes at or before it; a
passing cross-rank check advances the cross-rank watermark of each rank it covered
(``SdcState.cross_verified``: it vouches against deterministic faults).

No clock, no I/O: steps and times come from the events, output ids from their causes,
commands are unsigned. The engine calls :func:`on_step_stats`, :func:`on_self_check`,
:func:`on_cross_check`, :func:`on_ring_check` for those events and
:func:`on_step_completed` when the job completes a new step.
"""

from __future__ import annotations

import math
from typing import Protocol

from ....schemas import (
    Command,
    Derived,
    GradSpike,
    Interruption,
    InterruptionCause,
    Reason,
    ReasonCode,
    RunRingCheck,
    RunSelfCheck,
    SdcSelfCheck,
    SkipUpdate,
    StepStats,
)
from ..ids import derived_id
from ..outputs import abort_for, node_of
from ..state import RunPhase, RunState
from .sdc_checks import mismatch, quarantine, watermark_text, world_of
from .sdc_cross import on_cross_check
from .sdc_ring import judge_due_rings, on_ring_check, ring_offset
from .sdc_state import REMEMBERED, AttemptSdc, SdcPolicy, SdcState, remember

__all__ = [
    "CROSS_CHECK_SCHEDULED",
    "SELF_CHECK_SCHEDULED",
    "Interrupt",
    "SdcPolicy",
    "SdcState",
    "on_cross_check",
    "on_ring_check",
    "on_self_check",
    "on_step_completed",
    "on_step_stats",
]

Output = Derived | Command

#: Reason codes of the *scheduled* check commands.
SELF_CHECK_SCHEDULED = ReasonCode.SDC_CHECK_SCHEDULED
CROSS_CHECK_SCHEDULED = ReasonCode.SDC_CHECK_SCHEDULED

_ENDED = (RunPhase.INTERRUPTED, RunPhase.FINISHED)


class Interrupt(Protocol):
    """Declares an interruption on the run: the engine's ``_interruption``."""

    def __call__(
        self,
        run: RunState,
        *,
        cause: InterruptionCause,
        detected_by: str,
        cause_id: str,
        at: float,
        culprit: int,
        reason: Reason,
    ) -> Interruption: ...


# --------------------------------------------------------------------------- step stats


def on_step_stats(
    state: SdcState, run: RunState, event: StepStats, policy: SdcPolicy, interrupt: Interrupt
) -> list[Output]:
    """Non-finite loss -> Interruption + Abort(stack_dump), once per attempt. A finite grad
    norm -> one spike decision per job step: the step's first report decides (in a
    synchronous job every rank reports the same all-reduced norm); the rest are ignored."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    grad = event.grad_norm
    if is_non_finite(event):
        state.non_finite_reports += 1
        if current.non_finite_declared or run.phase in _ENDED or run.pending_hang is not None:
            return []
        current.non_finite_declared = True
        return _non_finite(run, event, interrupt)
    if grad is None or grad < 0 or run.phase in _ENDED:
        return []  # unmeasured, or the attempt is already being torn down
    step = event.step
    if step <= current.highest_judged_step - REMEMBERED or not remember(current.judged_steps, step):
        return []
    current.highest_judged_step = max(current.highest_judged_step, step)
    if len(state.grad_norms) >= policy.grad_norm_min_samples:
        p99 = state.grad_norms.quantile(0.99)
        if grad > policy.grad_spike_multiplier * p99:  # never added: spikes must not raise the bar
            state.grad_spikes += 1
            return _grad_spike(state, run, event, grad, p99, policy)
    state.grad_norms.add(grad, policy.grad_norm_window)
    return []


def is_non_finite(event: StepStats) -> bool:
    grad = event.grad_norm
    return not (event.finite and math.isfinite(event.loss) and (grad is None or math.isfinite(grad)))


def _non_finite(run: RunState, event: StepStats, interrupt: Interrupt) -> list[Output]:
    reason = Reason(
        code=ReasonCode.NON_FINITE_LOSS,
        text=f"rank {event.rank} on {event.node or '?'} reported loss={event.loss} "
        f"grad_norm={event.grad_norm} at step {event.step}: abort with stack dumps and investigate",
    )
    interruption = interrupt(
        run,
        cause=InterruptionCause.NON_FINITE,
        detected_by="sdc",
        cause_id=event.event_id,
        at=event.ts,
        culprit=event.rank,
        reason=reason,
    )
    abort = abort_for(run, interruption, stack_dump=True)
    return [interruption, abort]


def _grad_spike(
    state: SdcState, run: RunState, event: StepStats, grad: float, p99: float, policy: SdcPolicy
) -> list[Output]:
    threshold = policy.grad_spike_multiplier * p99
    spike = GradSpike(  # id from the step, not the report: whichever rank's report came first
        event_id=derived_id("grad_spike", run.run_id, run.attempt, event.step),
        run_id=run.run_id,
        attempt=run.attempt,
        rank=-1,
        node="",
        step=event.step,
        ts=event.ts,
        reason=Reason(
            code=ReasonCode.GRAD_SPIKE,
            text=f"grad norm {grad:.4g} at step {event.step} is over {policy.grad_spike_multiplier:g} x "
            f"p99 {p99:.4g} of the last {len(state.grad_norms)} steps: update skipped, "
            f"anomaly {state.grad_spikes} of the run",
        ),
        caused_by=[event.event_id],
        grad_norm=grad,
        threshold=threshold,
        anomalies=state.grad_spikes,
    )
    skip = SkipUpdate(
        command_id=derived_id("skip_update", spike.event_id),
        run_id=run.run_id,
        attempt=run.attempt,
        ranks=None,
        issued_ts=event.ts,
        reason=spike.reason,
        caused_by=[spike.event_id],
        step=event.step,
    )
    return [spike, skip]


# --------------------------------------------------------------------------- check schedule


def on_step_completed(
    state: SdcState, run: RunState, step: int, ts: float, cause_event_id: str, policy: SdcPolicy
) -> list[Output]:
    """The job completed a new step (`ts`, `cause_event_id`: the event that showed it).
    Judges ring checks whose wait is over, then issues the checks that fell due: the
    self-check on rank k mod world_size (every rank covered once per world_size checks)
    and the ring cross-rank check (every rank). Each
    is issued once per interval, for the interval's boundary step; ranks run it on the
    first step at or after that step they can still recompute."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    world = world_of(run)
    if run.phase in _ENDED or world == 0:
        return []
    outputs: list[Output] = judge_due_rings(state, run, step, ts, policy)
    boundary = _due(step, current.last_self_check_step, policy.self_check_every)
    if boundary is not None:
        current.last_self_check_step = step
        rank = state.self_checks_issued % world
        state.self_checks_issued += 1
        text = (
            f"self-check {state.self_checks_issued} at step {boundary}: rank {rank} on "
            f"{node_of(run, rank) or '?'} recomputes a microbatch on the same device and compares "
            f"bitwise; every rank is covered once per {world} checks"
        )
        outputs.append(
            RunSelfCheck(
                command_id=derived_id("run_self_check", run.run_id, run.attempt, boundary),
                run_id=run.run_id,
                attempt=run.attempt,
                ranks=[rank],
                issued_ts=ts,
                reason=Reason(code=SELF_CHECK_SCHEDULED, text=text),
                caused_by=[cause_event_id],
                step=boundary,
            )
        )
    outputs += _ring_check(state, run, current, step, ts, cause_event_id, policy)
    return outputs


def _ring_check(
    state: SdcState,
    run: RunState,
    current: AttemptSdc,
    step: int,
    ts: float,
    cause_event_id: str,
    policy: SdcPolicy,
) -> list[Output]:
    """The ring cross-rank check, once per interval: every ``cross_check_calibration_every``
    steps until the ring's tolerance is measured, then every ``cross_check_interval()``."""
    world = world_of(run)
    interval = policy.cross_check_interval()
    calibrated = len(state.ring_spread) >= policy.cross_check_min_samples
    every = interval if calibrated else policy.cross_check_calibration_every
    boundary = _due(step, current.last_cross_check_step, every if interval else 0)
    if boundary is None:  # most steps: decided before the offset is worked out
        return []
    offset = ring_offset(world, run.ranks_per_node, state.cross_checks_issued)
    if offset is None:
        return []
    current.last_cross_check_step = step
    state.cross_checks_issued += 1
    if calibrated:
        judged = (
            f"tolerance {policy.cross_check_sigma:g}+ sigma of {len(state.ring_spread)} good-hardware gaps"
        )
    else:
        judged = f"calibrating ({len(state.ring_spread)}/{policy.cross_check_min_samples} good-hardware gaps)"
    cadence = f"every {interval} steps" + (
        f" (one microbatch of {policy.microbatches_per_step} per step = "
        f"{policy.cross_check_budget:g} of compute)"
        if policy.cross_check_every is None
        else ""
    )
    text = (
        f"ring check {state.cross_checks_issued} at step {boundary}: every rank r also recomputes rank "
        f"(r + {offset}) mod {world}'s microbatch (on another node) and both report; {judged}; {cadence}"
    )
    return [
        RunRingCheck(
            command_id=derived_id("run_ring_check", run.run_id, run.attempt, boundary),
            run_id=run.run_id,
            attempt=run.attempt,
            ranks=None,
            issued_ts=ts,
            reason=Reason(code=CROSS_CHECK_SCHEDULED, text=text),
            caused_by=[cause_event_id],
            step=boundary,
            check_id=f"ring-a{run.attempt}-s{boundary}",
            offset=offset,
        )
    ]


def _due(step: int, last: int, every: int) -> int | None:
    """The interval boundary crossed since `last`, if any: one per interval, even when
    the job's step jumped over several."""
    if every <= 0 or step // every <= last // every:
        return None
    return step // every * every


# --------------------------------------------------------------------------- self-check


def on_self_check(state: SdcState, run: RunState, event: SdcSelfCheck, policy: SdcPolicy) -> list[Output]:
    """Digests equal: the watermark advances. Different: the device is faulty -> SdcMismatch
    naming the rank and node, QuarantineNode and RunNodeSelfTest (once per node per attempt)."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    if not remember(current.seen_checks, ("self", event.microbatch_id, (event.rank,))):
        return []
    if event.passed:
        state.passed(event.step)
        return []
    state.suspect(event.step)
    state.mismatches += 1
    node = event.node or node_of(run, event.rank)
    found = mismatch(
        run,
        event,
        method="self_check",
        rank=event.rank,
        node=node,
        code=ReasonCode.SELF_CHECK_MISMATCH,
        text=f"rank {event.rank} on {node or '?'} computed microbatch {event.microbatch_id} twice "
        f"on the same device and got different digests ({event.digest_first[:16]} != "
        f"{event.digest_second[:16]}): a hardware fault. {watermark_text(state)}",
    )
    return [found, *quarantine(current, run, found)]
