"""When the stack dumps of a hang's abort have all been collected (the window closes).

The window is counted in event time, but it must not open at the detection: a lagging
processor decides the hang late, and the heartbeats already queued behind the one that
revealed it carry later timestamps although they were sent BEFORE the abort existed. A
window opened at the detection then closed on them, before any rank could answer (at
2,048 ranks live: "2048 rank(s) did not answer"). So it opens at the first event that
was certainly sent after the abort was published: the first answer (a rank's requested
exit or stack signature), or the first Tick (the live driver writes ticks, stamped when
written, only while a hang is pending, so after the abort was published).

It closes, whichever comes first, when every rank has answered, when the odd stack out
is certain (no answer still missing could change it), or `stack_collect_s` after it
opened.
"""

from __future__ import annotations

from collections import Counter

from ....common.stacks import MINORITY_FRACTION
from ....schemas import Envelope, RankExit, Tick
from ..policy import HangPolicy
from ..state import PendingHang


def open_window(pending: PendingHang, event: Envelope, run_ts: float) -> None:
    """Open the window at the first event sent after the abort (see the module docstring).
    `run_ts` is the run's clock (the newest event time it has seen): a tick opens the window
    there rather than at its own stamp, the driver's wall clock, which a simulated run
    played faster or slower than real time does not share."""
    if pending.window_from is not None:
        return
    if isinstance(event, Tick):
        opened = run_ts
    elif isinstance(event, RankExit) and (event.requested or event.stack_signature):
        opened = event.ts
    else:
        return
    # never before the detection: another host's clock may run a little behind
    pending.window_from = max(opened, pending.detected_ts)


def odd_one_certain(answered: dict[int, str], expected: int) -> bool:
    """True when some answered ranks share a rare signature that stays rare, under a
    majority that stays the majority, whatever the `expected - len(answered)` missing
    ranks answer: the ranks named by the odd stack now would be named with every answer."""
    answered = {r: sig for r, sig in answered.items() if sig}  # an exit without a dump proves nothing
    missing = expected - len(answered)
    if missing <= 0 or len(answered) < 2:
        return False
    counts = Counter(answered.values())
    (_, majority_n), *rest = counts.most_common()
    limit = max(1, int(MINORITY_FRACTION * expected))
    return bool(rest) and 2 * majority_n > expected and min(n for _, n in rest) + missing <= limit


def window_closed(
    pending: PendingHang, answered: dict[int, str], expected: int, now_ts: float, policy: HangPolicy
) -> bool:
    if len(answered) >= expected or odd_one_certain(answered, expected):
        return True
    opened = pending.window_from
    return opened is not None and now_ts - opened >= policy.stack_collect_s
