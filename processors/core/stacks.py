"""Naming a hang's culprit from the ranks' stack dumps (the odd stack out), or, when no
dump names one, from their last reported training phases (the odd phase out).

In a synchronous job stuck in a collective, every healthy rank waits in the same
all-reduce; the culprit is somewhere else (a kernel, another collective, I/O).
So the culprit is the rank whose stack signature belongs to a small minority.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: A signature held by at most this share of the ranks is a minority (the odd stack out).
MINORITY_FRACTION = 0.1


@dataclass(frozen=True)
class Verdict:
    culprits: list[int]
    odd_signature: str
    majority_signature: str


def odd_stack(signatures: dict[int, str], minority_fraction: float = MINORITY_FRACTION) -> Verdict | None:
    """The ranks whose signature is rare (at most `minority_fraction` of ranks, and
    at least one other signature is shared by a majority), or None when no rank stands out."""
    if len(signatures) < 2:
        return None
    counts = Counter(signatures.values())
    (majority, majority_n), *rest = counts.most_common()
    if not rest or majority_n <= len(signatures) / 2:
        return None
    limit = max(1, int(minority_fraction * len(signatures)))
    rare = [sig for sig, n in rest if n <= limit]
    if not rare:
        return None
    odd = min(rare, key=lambda sig: (counts[sig], sig))
    culprits = sorted(rank for rank, sig in signatures.items() if sig == odd)
    return Verdict(culprits, odd, majority)


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
