"""The three-rank cross check on real ranks (RunCrossRankCheck; the core's side is
processors/core/detectors/sdc_cross.py): the bisection of a ring edge that failed alone.

A ring edge source -> target fails when the source's recomputation of the target's
microbatch differs from the target's own value (:mod:`.ring_check`). One of the two is
wrong, or neither was and the gap is noise; the core asks a third rank on a third node to
decide (``sdc_ring._bisect``): ``RunCrossRankCheck(ranks=[source, target, third], step,
microbatch_id, batch_rank=target)``. The three ranks each recompute ``batch_fn(batch_rank,
step)`` (the edge's microbatch) with the same weights, and ONE CrossRankCheck carries the
three values in the order of `ranks`; the core names the odd one out
(``sdc_checks.bisect_three``), or refutes the disagreement when all three agree.

Who holds the command. The actuator delivers a command to the ranks it names only, so
the other ranks never hear of it; yet the weights must be the same on the three and the
values must meet in one place. The check therefore rides the all-reduce that already
agrees on skips, checkpoints and ring checks (``agreement.agree``; three more integers
in its MAX all-reduce, no extra collective per step):

* each rank's *head* is its pending check with the smallest :attr:`CrossCheck.key` (a hash
  of the command's content, the same on every rank it names);
* slot i of the three carries -key of the head of the rank that is ``ranks[i]`` of its
  head (``ranks[0]`` also fills the third slot of a two-rank check); MAX keeps the
  smallest key per slot;
* all three slots equal -K: every rank K names holds K as its head. Every rank then knows
  K is run after this step's update, those it names included.

The globally smallest pending key is the head of every rank it names, so it runs as soon
as the last of them holds it; a larger key may wait behind it (when they share a slot),
never the other way round.

The run. After the update of the agreed step, each named rank recomputes the microbatch
with :func:`.ring_check.recompute` (the same replay and value as the ring, so a device
made wrong by producers/chaos/device_fault.py is wrong here too; the training state is left
bitwise as it was), and EVERY rank joins one SUM all-reduce of a float64 vector of three,
in which a named rank writes its value at its index and the others zeros (adding zeros is
exact, so each value arrives unchanged). ``ranks[0]`` reports the CrossRankCheck. A
recomputation that raises (the user's hooks) is logged and writes NaN: the rank still
joins the collective (a missing rank would hang all of them), and nothing is reported.

Without the agreement (a single process, a loop that does not call ``check()``, or
``agree_on_skip=False``) the values cannot be gathered: a pending check is logged and
dropped at the end of the step. A check a named rank never receives (it refused it, or
the command was lost) would block the keys above its own; each rank drops a check it has
held for :data:`PATIENCE_STEPS` steps without running it (the ranks drop it at different
steps; running needs every slot, so that cannot make a wrong run).

Cost: one replay (forward + backward of one microbatch) on each named rank, and one
all-reduce of three floats on every rank, at the agreed step only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...schemas import RunCrossRankCheck

log = logging.getLogger(__name__)

#: The most ranks a cross check names (two, or three to bisect): the slots of the agreement.
SLOTS = 3
#: Steps a rank holds a check that never runs (another named rank lacks it) before dropping it.
PATIENCE_STEPS = 200
#: A slot no rank fills, below every -key (keys are in [1, 2**62]).
_ABSENT = -(2**63)


@dataclass(frozen=True)
class CrossCheck:
    """A RunCrossRankCheck as this rank holds it; `since`: the step at which it arrived
    (-1: before the first step)."""

    step: int
    microbatch_id: str
    ranks: tuple[int, ...]
    batch_rank: int
    since: int = -1

    @property
    def key(self) -> int:
        """The check's identity in the agreement, from its content only (the same on each
        rank it names), in [1, 2**62] so that -key fits an int64 above :data:`_ABSENT`."""
        text = f"{self.step}|{self.microbatch_id}|{self.batch_rank}|{self.ranks}".encode()
        return (int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2) + 1

    def fills(self, slot: int, rank: int) -> bool:
        """Does `rank` fill agreement slot `slot` for this check?"""
        return self.ranks[slot if slot < len(self.ranks) else 0] == rank


def refusal(command: RunCrossRankCheck, world_size: int) -> str | None:
    """Why a rank cannot run `command` (None: it can)."""
    if command.batch_rank is None:
        return "no batch_rank: whose microbatch the ranks recompute is not known"
    ranks = command.ranks
    if ranks is None or not 2 <= len(ranks) <= SLOTS or len(set(ranks)) != len(ranks):
        return f"a cross-rank check needs 2 or 3 distinct ranks, got {ranks}"
    outside = sorted({r for r in [*ranks, command.batch_rank] if not 0 <= r < world_size})
    if outside:
        return f"ranks {outside} are outside world size {world_size}"
    return None


def from_command(command: RunCrossRankCheck, since: int) -> CrossCheck:
    """The check of a command :func:`refusal` accepted."""
    assert command.ranks is not None and command.batch_rank is not None
    return CrossCheck(command.step, command.microbatch_id, tuple(command.ranks), command.batch_rank, since)


# --------------------------------------------------------------------------- agreement


def head(pending: list[CrossCheck]) -> CrossCheck | None:
    """The pending check this rank offers to the agreement: the smallest key."""
    return min(pending, key=lambda c: c.key, default=None)


def agreement_codes(head: CrossCheck | None, rank: int) -> list[int]:
    """This rank's :data:`SLOTS` integers for the MAX all-reduce: -key of its head in the
    slots it fills (module docstring), :data:`_ABSENT` elsewhere."""
    return [-head.key if head is not None and head.fills(i, rank) else _ABSENT for i in range(SLOTS)]


def agreed(codes: list[int]) -> int | None:
    """The key of the check to run at this step (every rank it names holds it), or None."""
    first = codes[0]
    if first == _ABSENT or any(code != first for code in codes):
        return None
    return -first


def expired(check: CrossCheck, step: int) -> bool:
    return step - check.since > PATIENCE_STEPS


# --------------------------------------------------------------------------- the run


def contribution(check: CrossCheck | None, rank: int, value: float) -> list[float]:
    """This rank's vector for the SUM all-reduce: `value` at its index in the check's
    ranks, zeros elsewhere (all zeros on a rank the check does not name)."""
    if check is None:
        return [0.0] * SLOTS
    return [value if i < len(check.ranks) and check.ranks[i] == rank else 0.0 for i in range(SLOTS)]


def reported(check: CrossCheck, summed: list[float]) -> list[float] | None:
    """The values to report, in the order of the check's ranks; None when a named rank's
    recomputation failed (its NaN went through the sum)."""
    values = summed[: len(check.ranks)]
    return None if any(math.isnan(v) for v in values) else values


@dataclass(frozen=True)
class CrossResult:
    """One agreed check as this rank saw it: `check` None on a rank it does not name;
    `values` None there or when a recomputation failed."""

    step: int
    check: CrossCheck | None
    values: list[float] | None
    seconds: float


def gather(
    check: CrossCheck | None,
    rank: int,
    step: int,
    recompute: Callable[[int, int], float],
    sum_over_ranks: Callable[[list[float]], list[float]],
    clock: Callable[[], float] = time.perf_counter,
) -> CrossResult:
    """This rank's part of the agreed check at `step`: its recomputation of
    ``(batch_rank, check.step)`` when named (``recompute(rank, step)`` gives the value),
    then the all-reduce every rank joins, whatever happened before it."""
    t0 = clock()
    value = math.nan
    if check is not None:
        try:
            value = recompute(check.batch_rank, check.step)
        except Exception:  # the user's hooks: never end training over a check
            log.exception("rank %d step %d: cross check %s not recomputed", rank, step, check.microbatch_id)
    summed = sum_over_ranks(contribution(check, rank, value))
    values = None if check is None else reported(check, summed)
    if check is not None and values is None and rank == check.ranks[0]:
        log.warning(
            "rank %d step %d: cross check %s not reported: a recomputation failed",
            rank,
            step,
            check.microbatch_id,
        )
    return CrossResult(step, check, values, max(0.0, clock() - t0))
