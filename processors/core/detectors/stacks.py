"""Naming a hang's culprit from the ranks' stack dumps (the odd stack out), or, when no
dump names one, from their last reported training phases (the odd phase out):
:func:`hang_culprit`, with the reason it gives.

In a synchronous job stuck in a collective, every healthy rank waits in the same
all-reduce; the culprit is somewhere else (a kernel, another collective, I/O).
So the culprit is the rank whose stack signature belongs to a small minority: the rule
(:func:`~trainguard.common.stacks.odd_stack`) is shared with the launcher, which names
the rank an in-process restart leaves out with it (trainguard/common/stacks.py).
"""

from __future__ import annotations

from collections import Counter

from ....common.stacks import odd_stack
from ....schemas import Reason, ReasonCode

#: Phases in which a rank waits for the others (Heartbeat.phase): a hang's bystanders.
WAITING_PHASES = frozenset({"allreduce"})


def odd_phase(phases: dict[int, str], minority_fraction: float = 0.1) -> tuple[int, str, str, int] | None:
    """(culprit, its phase, the majority's phase, how many ranks reported the majority's)
    when a clear majority waits in the collective and exactly one rank is elsewhere (at
    most `minority_fraction` differ at all); None otherwise: a phase is weaker evidence
    than a stack, so two ranks out of step name nobody, and neither does one rank waiting
    in the collective for a majority stuck elsewhere (it is the one waiting)."""
    if len(phases) < 2:
        return None
    counts = Counter(phases.values())
    (majority, majority_n), *rest = counts.most_common()
    if not rest or majority_n <= len(phases) / 2 or majority not in WAITING_PHASES:
        return None
    odd = [rank for rank, phase in phases.items() if phase != majority]
    if len(odd) != 1 or len(odd) > max(1, int(minority_fraction * len(phases))):
        return None
    return odd[0], phases[odd[0]], majority, majority_n


def hang_culprit(answered: dict[int, str], phases: dict[int, str], expected: int) -> tuple[int, Reason]:
    """The hang's culprit from evidence only: the odd stack out among the dumps (`answered`:
    rank -> stack signature, '' for an exit without a dump), else the rank whose last
    reported phase (`phases`) differs from everyone else's (all waiting in the collective,
    one still in forward or data), else unknown (-1: nothing is quarantined). Never a rank
    only for not answering the dump: at thousands of ranks many may miss the window, and
    the first of them is rank 0. `expected`: the ranks that should have answered."""
    dumped = {r: sig for r, sig in answered.items() if sig}  # an exit without a dump is no evidence
    verdict = odd_stack(dumped)
    if verdict is not None:
        culprit = verdict.culprits[0]
        return culprit, Reason(
            code=ReasonCode.ODD_STACK,
            text=f"rank {culprit} was in {verdict.odd_signature!r} while "
            f"{len(dumped) - len(verdict.culprits)} ranks waited in {verdict.majority_signature!r}",
        )
    silent = expected - len(dumped)
    dumps = f"{len(dumped)} of {expected} stack dumps, no odd one out" if dumped else "no stack dump"
    if silent > 0:
        dumps += f" ({silent} rank(s) sent none in the window)"
    found = odd_phase(phases)
    if found is not None:
        culprit, odd, majority, others = found
        return culprit, Reason(
            code=ReasonCode.ODD_PHASE,
            text=f"{dumps}; rank {culprit} last reported phase {odd!r} while {others} ranks "
            f"reported {majority!r}",
        )
    why = "no phases reported" if not phases else "no single rank's phase stands out"
    code = ReasonCode.NO_ODD_STACK if silent == 0 and dumped else ReasonCode.CULPRIT_UNKNOWN
    return -1, Reason(code=code, text=f"{dumps}; {why}: culprit unknown, nothing quarantined")
