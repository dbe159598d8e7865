"""Goodput accounting (seed §6, "What goodput actually is"): where a run's time went, in
event time, over trailing windows (1 h, 24 h, 7 d), reported as GoodputReport events.

    goodput = (1 - overhead) x ideal/actual step time
    overhead = (checkpoint + lost + restart) / elapsed

measured, not modelled: `checkpoint` is the blocking time of the checkpoints written,
`lost` the steps re-done after each interruption (lost_steps x the median step time),
`restart` the time from each interruption's detection to the next attempt's first step,
and ideal/actual = 1 - straggler / (elapsed - restart), where `straggler` accrues, while a
straggler is flagged, (1 - 1/slowdown) of the training time (the job runs at its slowest
rank's pace; the seed's "a single 20%-slow rank multiplies the second term by 0.83").

Time is kept in one-minute buckets of the run's clock (its newest event ts), so a window
is a sum over at most 10,080 buckets and the state of a week-long run stays small.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ...schemas import CheckpointWritten, Envelope, GoodputReport, Interruption, Reason, ReasonCode
from .ids import derived_id

_MINUTE = 60.0


class GoodputPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    windows_s: tuple[float, ...] = Field(
        (3600.0, 86_400.0, 604_800.0), min_length=1, description="Trailing windows reported (1 h, 24 h, 7 d)."
    )
    report_every_s: float = Field(600.0, gt=0, description="A report per window every this much event time.")
    page_below: float = Field(
        0.3, ge=0, le=1, description="R5: page when the first window's goodput falls below this."
    )
    page_min_elapsed_s: float = Field(
        1800.0, ge=0, description="...once that window holds at least this much run time."
    )


@dataclass
class Minute:
    elapsed: float = 0.0
    restart: float = 0.0
    lost: float = 0.0
    checkpoint: float = 0.0
    straggler: float = 0.0


@dataclass(frozen=True)
class Breakdown:
    window_s: float
    elapsed: float
    checkpoint: float
    lost: float
    restart: float
    straggler: float

    @property
    def goodput(self) -> float:
        if self.elapsed <= 0:
            return 1.0
        overhead = (self.checkpoint + self.lost + self.restart) / self.elapsed
        training = self.elapsed - self.restart
        pace = 1.0 - self.straggler / training if training > 0 else 1.0
        return max(0.0, min(1.0, (1.0 - overhead) * pace))


@dataclass
class GoodputState:
    clock: float | None = None
    minutes: OrderedDict[int, Minute] = field(default_factory=OrderedDict)
    #: Slowdown of each flagged straggler (rank -> compute / median compute).
    slowdowns: dict[int, float] = field(default_factory=dict)
    checkpoints: set[tuple[int, int]] = field(default_factory=set)
    counted: set[str] = field(default_factory=set)
    last_report_ts: float | None = None


def _minute(state: GoodputState, ts: float) -> Minute:
    key = int(ts // _MINUTE)
    bucket = state.minutes.get(key)
    if bucket is None:
        bucket = state.minutes[key] = Minute()
    return bucket


def advance(state: GoodputState, ts: float, interrupted: bool, policy: GoodputPolicy) -> None:
    """The run's clock moved to `ts` (call on every event; cheap when it did not move)."""
    if state.clock is None:
        state.clock = ts
        return
    dt = ts - state.clock
    if dt <= 0:
        return
    state.clock = ts
    bucket = _minute(state, ts)
    bucket.elapsed += dt
    if interrupted:
        bucket.restart += dt
    elif state.slowdowns:
        bucket.straggler += dt * (1.0 - 1.0 / max(state.slowdowns.values()))
    horizon = int((ts - max(policy.windows_s)) // _MINUTE)
    while state.minutes and next(iter(state.minutes)) < horizon:
        state.minutes.popitem(last=False)


def on_interruption(state: GoodputState, interruption: Interruption, step_times: list[float]) -> None:
    if interruption.interruption_id in state.counted:
        return
    state.counted.add(interruption.interruption_id)
    step_s = statistics.median(step_times) if step_times else 0.0
    _minute(state, interruption.ts).lost += interruption.lost_steps * step_s


def on_checkpoint(state: GoodputState, event: CheckpointWritten) -> None:
    key = (event.attempt, event.checkpoint_step)
    if key not in state.checkpoints:  # one checkpoint, reported by several ranks
        state.checkpoints.add(key)
        _minute(state, event.ts).checkpoint += event.blocking_s


def breakdown(state: GoodputState, now: float, window_s: float) -> Breakdown:
    since = int((now - window_s) // _MINUTE)
    return _sum(window_s, [m for key, m in state.minutes.items() if key > since])


def total(state: GoodputState) -> Breakdown:
    """Everything kept (the longest window)."""
    return _sum(_MINUTE * len(state.minutes), list(state.minutes.values()))


def _sum(window_s: float, parts: list[Minute]) -> Breakdown:
    return Breakdown(
        window_s,
        elapsed=sum(m.elapsed for m in parts),
        checkpoint=sum(m.checkpoint for m in parts),
        lost=sum(m.lost for m in parts),
        restart=sum(m.restart for m in parts),
        straggler=sum(m.straggler for m in parts),
    )


def reports(state: GoodputState, run_id: str, cause: Envelope, policy: GoodputPolicy) -> list[GoodputReport]:
    """A report per window once every `report_every_s` of event time."""
    now = state.clock
    if now is None:
        return []
    if state.last_report_ts is not None and now - state.last_report_ts < policy.report_every_s:
        return []
    if state.last_report_ts is None:
        state.last_report_ts = now  # the first report comes one period after the start
        return []
    state.last_report_ts = now
    out = []
    for window in policy.windows_s:
        b = breakdown(state, now, window)
        text = (
            f"goodput {b.goodput:.3f} over the last {_span(window)}: of {b.elapsed:,.0f} s, "
            f"checkpoints {b.checkpoint:,.0f} s, lost work {b.lost:,.0f} s, restarts {b.restart:,.0f} s, "
            f"stragglers {b.straggler:,.0f} s"
        )
        out.append(
            GoodputReport(
                event_id=derived_id("goodput_report", run_id, f"{window:g}", f"{now:.3f}"),
                run_id=run_id,
                attempt=cause.attempt,
                rank=-1,
                node="",
                step=cause.step,
                ts=now,
                reason=Reason(code=ReasonCode.GOODPUT, text=text),
                caused_by=[cause.event_id],
                window_s=window,
                elapsed_s=b.elapsed,
                checkpoint_s=b.checkpoint,
                lost_s=b.lost,
                restart_s=b.restart,
                straggler_s=b.straggler,
                goodput=b.goodput,
            )
        )
    return out


def _span(seconds: float) -> str:
    if seconds % 86_400 == 0:
        return f"{seconds / 86_400:g} d"
    return f"{seconds / 3600:g} h"
