"""Goodput accounting (seed §6, "What goodput actually is"): where a run's time went, in
event time, over trailing windows (1 h, 24 h, 7 d), reported as GoodputReport events.

    goodput = (1 - overhead) x ideal/actual step time
    overhead = (checkpoint + lost + restart) / elapsed

measured, not modelled: `checkpoint` is the blocking time of the checkpoints written,
`lost` the steps re-done after each interruption (lost_steps x the median step time,
charged to the minutes in which that work was done, so that no window loses more time
than it holds),
`restart` the time from each interruption's detection to the next attempt's first step,
and ideal/actual = 1 - (straggler + narrow) / (elapsed - restart), where `straggler` accrues,
while a straggler is flagged, (1 - 1/slowdown) of the training time (the job runs at its
slowest rank's pace; the seed's "a single 20%-slow rank multiplies the second term by 0.83"),
and `narrow`, while the run trains at W' of its full W ranks (elastic training, issue 45: the
same global batch, each step W/W' as long), (1 - W'/W) of it: the effective training time
ratio's reduced width (Meta, "Revisiting Reliability in Large-Scale ML Research Clusters",
HPCA 2025). Both together: a second at width w behind a rank `slowdown` times slower does
w/slowdown of a second's work.

Time is kept in one-minute buckets of the run's clock (its newest event ts), and the
state of a week-long run stays small. A window's sum is kept incrementally: running totals
of every bucket ever filled, minus, per window, the buckets that have slid out of it (a
cursor that only moves forward), so a report costs the minutes since the previous one, not
the 10,080 (or 43,200) minutes of its window.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from ....schemas import CheckpointWritten, Envelope, GoodputReport, Interruption, Reason, ReasonCode
from ..ids import derived_id
from .goodput_state import GoodputState, Minute, Slid

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


@dataclass(frozen=True)
class Breakdown:
    window_s: float
    elapsed: float
    checkpoint: float
    lost: float
    restart: float
    straggler: float
    interruptions: int = 0
    narrow: float = 0.0

    @property
    def goodput(self) -> float:
        if self.elapsed <= 0:
            return 1.0
        overhead = (self.checkpoint + self.lost + self.restart) / self.elapsed
        training = self.elapsed - self.restart
        pace = 1.0 - (self.straggler + self.narrow) / training if training > 0 else 1.0
        return max(0.0, min(1.0, (1.0 - overhead) * pace))


def _minute(state: GoodputState, key: int) -> Minute:
    bucket = state.minutes.get(key)
    if bucket is None:
        bucket = state.minutes[key] = Minute()
    return bucket


def _add(state: GoodputState, ts: float, amount: Minute) -> None:
    """Charge `amount` to the minute of `ts` (which may be behind the clock: a late event),
    keeping the totals and every window that minute has already slid out of consistent."""
    key = int(ts // _MINUTE)
    _minute(state, key).add(amount)
    state.totals.add(amount)
    for slid in state.slid.values():
        if key <= slid.cursor:
            slid.out.add(amount)


def advance(state: GoodputState, ts: float, interrupted: bool, policy: GoodputPolicy) -> None:
    """The run's clock moved to `ts` (call on every event; cheap when it did not move)."""
    if state.clock is None:
        state.clock = ts
        return
    dt = ts - state.clock
    if dt <= 0:
        return
    previous, state.clock = state.clock, ts
    slow = 0.0 if interrupted or not state.slowdowns else 1.0 - 1.0 / max(state.slowdowns.values())
    width = state.width
    narrow = 0.0 if interrupted else 1.0 - width
    # The time since the previous event belongs to the minutes it spans (a quiet gap, such
    # as a long restart, is not all charged to the minute that ends it). Those minutes are
    # newer than every window's cursor: no window to correct.
    totals, t = state.totals, previous
    while t < ts:
        key = int(t // _MINUTE)
        until = min(ts, (key + 1) * _MINUTE)
        part, t = until - t, until
        bucket = _minute(state, key)
        bucket.elapsed += part
        totals.elapsed += part
        if interrupted:
            bucket.restart += part
            totals.restart += part
            continue
        if slow:
            bucket.straggler += part * slow * width
            totals.straggler += part * slow * width
        if narrow:
            bucket.narrow += part * narrow
            totals.narrow += part * narrow
    # Drop minutes older than the longest window once that window's sum has passed them.
    longest = state.slid.get(max(policy.windows_s))
    horizon = int((ts - max(policy.windows_s)) // _MINUTE)
    if longest is not None:
        horizon = min(horizon, longest.cursor + 1)
        while state.minutes and next(iter(state.minutes)) < horizon:
            state.minutes.popitem(last=False)


def set_width(state: GoodputState, world_size: int, full_world: int) -> None:
    """The run trains at `world_size` of its `full_world` ranks from now (RunStarted)."""
    state.width = min(1.0, world_size / full_world) if full_world > 0 else 1.0


def on_interruption(state: GoodputState, interruption: Interruption, step_times: list[float]) -> None:
    if interruption.interruption_id in state.counted:
        return
    state.counted.add(interruption.interruption_id)
    step_s = statistics.median(step_times) if step_times else 0.0
    _add(state, interruption.ts, Minute(interruptions=1))
    _charge_lost(state, interruption.ts, interruption.lost_steps * step_s)


def recharge_lost(state: GoodputState, interruption_ts: float, step_s: float, was: int, now: int) -> None:
    """The restart resumed from another checkpoint than the one counted at detection: `now`
    steps were re-done, not `was`. The difference moves out of (or into) the same minutes."""
    _charge_lost(state, interruption_ts, was * step_s, sign=-1.0)
    _charge_lost(state, interruption_ts, now * step_s)


def _charge_lost(state: GoodputState, until_ts: float, seconds: float, sign: float = 1.0) -> None:
    """The lost work was done in the minutes before the interruption: charge it there."""
    t = until_ts - seconds
    while t < until_ts:
        key = int(t // _MINUTE)
        end = min(until_ts, (key + 1) * _MINUTE)
        _add(state, key * _MINUTE, Minute(lost=sign * (end - t)))
        t = end


def on_checkpoint(state: GoodputState, event: CheckpointWritten) -> None:
    key = (event.attempt, event.checkpoint_step)
    if key not in state.checkpoints:  # one checkpoint, reported by several ranks
        state.checkpoints.add(key)
        _add(state, event.ts, Minute(checkpoint=event.blocking_s))


def breakdown(state: GoodputState, now: float, window_s: float) -> Breakdown:
    """The minutes after `now - window_s`. `now` must not go back for a given window (the
    run's clock does not): the window's cursor only moves forward."""
    since = math.ceil((now - window_s) / _MINUTE) - 1  # the minutes that start in the window
    slid = state.slid.get(window_s)
    if slid is None:  # first use of this window: everything but its minutes is out of it
        inside = Minute()
        for key, bucket in state.minutes.items():
            if key > since:
                inside.add(bucket)
        t = state.totals
        slid = state.slid[window_s] = Slid(since)
        slid.out = Minute(
            t.elapsed - inside.elapsed,
            t.restart - inside.restart,
            t.lost - inside.lost,
            t.checkpoint - inside.checkpoint,
            t.straggler - inside.straggler,
            t.interruptions - inside.interruptions,
            t.narrow - inside.narrow,
        )
    elif since > slid.cursor:
        minutes = state.minutes
        if since - slid.cursor <= len(minutes):
            for key in range(slid.cursor + 1, since + 1):
                found = minutes.get(key)
                if found is not None:
                    slid.out.add(found)
        else:  # a long quiet gap: walk the buckets instead of the empty minutes
            for key, bucket in minutes.items():
                if slid.cursor < key <= since:
                    slid.out.add(bucket)
        slid.cursor = since
    t, out = state.totals, slid.out
    return Breakdown(
        window_s,
        elapsed=t.elapsed - out.elapsed,
        checkpoint=t.checkpoint - out.checkpoint,
        lost=t.lost - out.lost,
        restart=t.restart - out.restart,
        straggler=t.straggler - out.straggler,
        interruptions=t.interruptions - out.interruptions,
        narrow=t.narrow - out.narrow,
    )


def total(state: GoodputState) -> Breakdown:
    """Everything kept: the longest window reported so far (everything, before any report)."""
    if state.slid and state.clock is not None:
        return breakdown(state, state.clock, max(state.slid))
    t = state.totals
    return Breakdown(
        _MINUTE * len(state.minutes),
        t.elapsed,
        t.checkpoint,
        t.lost,
        t.restart,
        t.straggler,
        t.interruptions,
        t.narrow,
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
            f"stragglers {b.straggler:,.0f} s" + (f", a smaller world {b.narrow:,.0f} s" if b.narrow else "")
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
                narrow_s=b.narrow,
                goodput=b.goodput,
                interruptions=b.interruptions,
            )
        )
    return out


def _span(seconds: float) -> str:
    if seconds % 86_400 == 0:
        return f"{seconds / 86_400:g} d"
    return f"{seconds / 3600:g} h"
