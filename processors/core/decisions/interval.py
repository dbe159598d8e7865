"""The checkpoint interval (seed §6): `auto` picks the T that maximises goodput from the
run's own measured checkpoint cost C and MTBF M, and publishes it only when it matters.

Goodput loses, per unit of run time, C/T to writing checkpoints, T/2M to re-doing the
work since the last one after a failure, and R/M to restarting (R does not depend on T):

    overhead(T) = C/T + T/(2M) + R/M

Young's T* = sqrt(2·C·M) minimises the first two terms. When C is not small against M,
Daly's higher-order estimate is used instead (J. T. Daly, "A higher order estimate of the
optimum checkpoint interval for restart dumps", FGCS 2006):

    T = sqrt(2·C·M) · [1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C     for C < 2M,  else T = M

Hysteresis. Every checkpoint (a new C sample) and every MTBF update re-derives T, but a
set-interval command goes out only when the interval in force costs more than
`min_gain` of run time over the new optimum: overhead(T_now) − overhead(T*) > min_gain.
Because the overhead is flat around its minimum, M drifting by 10% moves T* by 5% and
costs ~0.01% of goodput: not worth a command. The first optimum replaces the launcher's
interval under the same rule.

Every attempt starts with the interval in force. A command carries the attempt it was
issued in, and a rank refuses another attempt's commands, so the set-interval command of
an earlier attempt does not reach the ranks of a restarted one, and re-deriving sends
nothing (the interval in force is already the optimum). So when an attempt's first step
completes (its ranks are up and reading their commands, a spare node's too), the interval
in force is sent again for that attempt (:func:`on_attempt_training`). The launcher also
hands the last interval it received to the next attempt's ranks in their environment
(producers/launcher/commands.py, rank_env.py), so they start with it even before this command arrives.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ....common.checkpoint_interval import DALY_ABOVE_C_OVER_M, MAX_S, MIN_S
from ....common.checkpoint_interval import daly_s as daly_s  # re-exported: one home
from ....common.checkpoint_interval import optimal_s as common_optimal_s
from ....common.checkpoint_interval import young_s as young_s
from ....schemas import CheckpointWritten, Envelope, IntervalUpdate, Reason, ReasonCode, SetCheckpointInterval
from ..ids import derived_id


class IntervalPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["auto", "fixed"] = Field(
        "auto", description="auto: derive T from measured C and M (seed §6); fixed: keep initial_s."
    )
    initial_s: float = Field(
        1800.0, gt=0, description="The interval in force until the first derivation (the launcher's)."
    )
    min_gain: float = Field(
        0.005,
        ge=0,
        description="Publish a new interval only when the one in force costs more than this fraction "
        "of run time over the optimum (0.005: half a percent of goodput).",
    )
    daly_above_c_over_m: float = Field(
        DALY_ABOVE_C_OVER_M,
        ge=0,
        description="Use Daly's higher-order estimate instead of Young's when C/M exceeds this.",
    )
    min_s: float = Field(MIN_S, gt=0, description="Never checkpoint more often than this.")
    max_s: float = Field(MAX_S, gt=0, description="Never checkpoint less often than this.")
    cost_samples: int = Field(
        20, ge=1, description="C is the median blocking time of this many latest checkpoints."
    )

    @model_validator(mode="after")
    def _ordered(self) -> IntervalPolicy:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s ({self.min_s}) must not exceed max_s ({self.max_s})")
        return self


# --------------------------------------------------------------------------- formulas


def overhead(t: float, c: float, m: float, r: float = 0.0) -> float:
    """Fraction of run time lost at interval t: C/T + T/2M + R/M (seed §6)."""
    return c / t + t / (2 * m) + r / m


def optimal_s(c: float, m: float, policy: IntervalPolicy) -> tuple[float, str]:
    """The interval that maximises goodput, clamped to [min_s, max_s], and the formula used."""
    return common_optimal_s(c, m, policy.min_s, policy.max_s, policy.daly_above_c_over_m)


# --------------------------------------------------------------------------- state


@dataclass
class IntervalState:
    """One run's checkpoint cost samples and the interval in force (kept across attempts)."""

    costs: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    seen_steps: set[tuple[int, int]] = field(default_factory=set)
    current_s: float | None = None
    published: int = 0
    #: The attempt the interval in force was last sent to (-1: never sent).
    sent_attempt: int = -1

    def cost_s(self) -> float | None:
        return statistics.median(self.costs) if self.costs else None


def on_checkpoint(
    state: IntervalState, run_id: str, event: CheckpointWritten, mtbf_s: float, policy: IntervalPolicy
) -> list[IntervalUpdate | SetCheckpointInterval]:
    """A checkpoint is durable: its blocking time is a sample of C. Re-derive T."""
    key = (event.attempt, event.checkpoint_step)
    if key in state.seen_steps:  # one checkpoint, reported by several ranks: one sample
        return []
    state.seen_steps.add(key)
    if state.costs.maxlen != policy.cost_samples:
        state.costs = deque(state.costs, maxlen=policy.cost_samples)
    state.costs.append(event.blocking_s)
    return rederive(state, run_id, event, mtbf_s, policy)


def rederive(
    state: IntervalState, run_id: str, cause: Envelope, mtbf_s: float, policy: IntervalPolicy
) -> list[IntervalUpdate | SetCheckpointInterval]:
    """Derive T* from the current C and M; publish it if the interval in force costs more
    than `min_gain` over it (see the module docstring)."""
    c = state.cost_s()
    current = state.current_s if state.current_s is not None else policy.initial_s
    if policy.mode != "auto" or c is None or c <= 0 or mtbf_s <= 0:
        return []
    best, formula = optimal_s(c, mtbf_s, policy)
    gain = overhead(current, c, mtbf_s) - overhead(best, c, mtbf_s)
    if gain <= policy.min_gain:
        return []
    state.current_s = best
    state.published += 1
    state.sent_attempt = max(state.sent_attempt, cause.attempt)
    reason = Reason(
        code=ReasonCode.CHECKPOINT_INTERVAL,
        text=f"checkpoint every {best / 60:.1f} min ({formula}: C={c:.1f} s, M={mtbf_s / 3600:.2f} h); "
        f"the interval in force ({current / 60:.1f} min) lost {100 * gain:.2f}% more of run time "
        f"(overhead {100 * overhead(current, c, mtbf_s):.1f}% -> {100 * overhead(best, c, mtbf_s):.1f}% "
        "before restarts)",
    )
    update = IntervalUpdate(
        event_id=derived_id("interval_update", run_id, cause.event_id),
        run_id=run_id,
        attempt=cause.attempt,
        rank=-1,
        node="",
        step=cause.step,
        ts=cause.ts,
        reason=reason,
        caused_by=[cause.event_id],
        mtbf_s=mtbf_s,
        checkpoint_cost_s=c,
        interval_s=best,
    )
    command = SetCheckpointInterval(
        command_id=derived_id("set_checkpoint_interval", update.event_id),
        run_id=run_id,
        attempt=cause.attempt,
        ranks=None,
        issued_ts=cause.ts,
        reason=reason,
        caused_by=[update.event_id],
        interval_s=best,
    )
    return [update, command]


def on_attempt_training(
    state: IntervalState, run_id: str, first_step: Envelope, policy: IntervalPolicy
) -> list[SetCheckpointInterval]:
    """An attempt completed its first step: send it the interval in force, once per attempt,
    if the core ever published one (before that, the launcher's interval is in force)."""
    if policy.mode != "auto" or state.current_s is None or first_step.attempt <= state.sent_attempt:
        return []
    previous = state.sent_attempt
    state.sent_attempt = first_step.attempt
    reason = Reason(
        code=ReasonCode.CHECKPOINT_INTERVAL,
        text=f"attempt {first_step.attempt} started: the interval in force, checkpoint every "
        f"{state.current_s / 60:.1f} min ({state.current_s:g} s), sent again to its ranks (the command "
        f"sent to attempt {previous} is refused by a later attempt's ranks)",
    )
    return [
        SetCheckpointInterval(
            command_id=derived_id("set_checkpoint_interval", run_id, first_step.event_id),
            run_id=run_id,
            attempt=first_step.attempt,
            ranks=None,
            issued_ts=first_step.ts,
            reason=reason,
            caused_by=[first_step.event_id],
            interval_s=state.current_s,
        )
    ]
