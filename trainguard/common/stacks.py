"""The odd stack out: in a synchronous job stuck in a collective, every healthy rank waits
in the same all-reduce and the culprit is somewhere else (a kernel, another collective,
I/O), so the culprit is the rank whose stack signature belongs to a small minority.

One rule for both sides (issue 48): the core names a hang's culprit with it
(processors/core/detectors/stacks.py) and the launcher's in-process restart names the
rank to leave out with it (producers/launcher/hot.py). Imports nothing of the project
(trainguard/common).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

#: A signature held by at most this share of the ranks is a minority (the odd stack out).
MINORITY_FRACTION = 0.1


@dataclass(frozen=True)
class OddStack:
    """The odd stack out: the ranks in it, their signature and the majority's."""

    culprits: list[int]
    odd_signature: str
    majority_signature: str


def odd_stack(signatures: dict[int, str], minority_fraction: float = MINORITY_FRACTION) -> OddStack | None:
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
    return OddStack(culprits, odd, majority)
