"""The ring cross-rank check on real ranks (seed R3; the core's side is
processors/core/detectors/sdc_ring.py): the defence against a deterministically wrong device, which
passes its own bitwise self-check because it computes the same wrong answer twice.

At a ring check every rank r recomputes, with the weights of that step, its own
microbatch and the microbatch of rank (r + offset) mod W, and reports one value for
each (RingCheck). The processor compares r's recomputation of its neighbour's
microbatch with the neighbour's own value at a tolerance measured on good hardware; a
device wrong the same way every time fails both comparisons it takes part in. An edge that
fails alone is bisected with a third rank (RunCrossRankCheck, :mod:`.cross_check`), which
recomputes the same microbatch through the same :func:`recompute`.

The user's two hooks (on the :class:`~.supervisor.Supervisor`)::

    sup.replay_fn = lambda batch: loss_fn(model.module(batch)).backward()   # no collective
    sup.batch_fn = lambda rank, step: batch_of(rank, step)                  # ANY rank's batch

``replay_fn`` is the self-check's (forward + backward on one microbatch, on the unwrapped
model so that no collective runs). ``batch_fn(rank, step)`` returns the batch that rank
`rank` trains on at step `step`: the sampler knows every rank's indices, so it is a pure
function of (rank, step) and every rank gets the same inputs for the same (rank, step)
(e.g. ``ResumableSampler.indices(rank, step * batch, batch)``, docs/examples/train_tiny.py).
A rank's own value also comes from ``batch_fn`` (not from the batch the loop passed), so
both ends of a comparison read identical inputs by construction.

The value. The core compares floats at a relative tolerance, so each recomputation is
summarised by :func:`gradient_value`: the L2 norm of all gradients, accumulated in float64
(a one-bit change in one gradient element moves it far above float64 rounding). It is the
gradient the self-check digests, reduced to the number a tolerance can apply to. The
replay leaves the training state as it found it (gradients, buffers, RNG states;
:func:`.grad_checks.preserved_state`), so a run with ring checks continues bitwise like
one without.

When. The core issues RunRingCheck for a step the job has already passed, and the command
reaches each rank at its own step; the recomputations must use the same weights on every
rank. Under torch.distributed the ranks therefore agree on the step: the oldest pending
ring check joins the all-reduce that already agrees on skips and checkpoints
(``agreement.agree``; two more integers, no extra collective), and every rank runs it
after the update of the first step at which all ranks hold it. Without that agreement (a
single process, a loop that does not call ``check()``, or ``agree_on_skip=False``) a rank
runs it at its first step at or after the command's step; with several ranks their
weights may then differ and so may their values, so keep the agreement on.

A ring check that raises (the user's ``batch_fn`` or ``replay_fn``) is logged and sends
nothing: training goes on, and the core judges the ring on the reports it has without
blaming anyone for the missing one.

Cost: two replays (forward + backward of one microbatch each) per rank per check, run at
the check step only, after the update; the steps in between pay nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .grad_checks import preserved_state

#: A rank's batch at a step: ``batch_fn(rank, step)`` (see the module docstring).
BatchFn = Callable[[int, int], Any]


def gradient_value(params: Iterable[torch.Tensor]) -> float:
    """The L2 norm of every gradient, summed in float64 (NaN when one is not finite)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    if not norms:
        return 0.0
    total = float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))
    return total if math.isfinite(total) else math.nan


def reportable(value: float) -> float:
    """`value` as RingCheck can carry it: the schema takes finite numbers only, so a
    non-finite recomputation goes out as the largest float, which fails its comparisons
    (a missing report would blame nobody)."""
    return value if math.isfinite(value) else sys.float_info.max


def recompute(
    replay_fn: Callable[[Any], object],
    batch: Any,
    params: list[torch.Tensor],
    module: torch.nn.Module | None = None,
) -> float:
    """``replay_fn(batch)`` once with the current weights, leaving the training state as it
    was; the :func:`gradient_value` of the gradients it produced."""
    with preserved_state(params, module):
        for p in params:
            p.grad = None
        replay_fn(batch)
        return gradient_value(params)


@dataclass(frozen=True)
class RingResult:
    step: int
    check_id: str
    own_value: float
    peer_rank: int
    peer_value: float
    seconds: float


def ring_check(
    replay_fn: Callable[[Any], object],
    batch_fn: BatchFn,
    params: list[torch.Tensor],
    *,
    rank: int,
    world_size: int,
    step: int,
    check_id: str,
    offset: int,
    module: torch.nn.Module | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RingResult:
    """This rank's part of a ring check at `step`: its own microbatch and that of rank
    (rank + offset) mod world_size, recomputed with the current weights."""
    peer = (rank + offset) % world_size
    t0 = clock()
    own = reportable(recompute(replay_fn, batch_fn(rank, step), params, module))
    theirs = reportable(recompute(replay_fn, batch_fn(peer, step), params, module))
    return RingResult(step, check_id, own, peer, theirs, max(0.0, clock() - t0))


# --------------------------------------------------------------------------- agreement

#: What a rank with no pending ring check contributes to the agreement's MAX all-reduce.
_NONE = -1
_NONE_NEG = -(2**31) + 1


def agreement_codes(pending: int | None) -> list[int]:
    """This rank's three integers for the MAX all-reduce: (missing, step, -step), from the
    step of its oldest pending ring check (None: none)."""
    if pending is None:
        return [1, _NONE, _NONE_NEG]
    return [0, pending, -pending]


@dataclass(frozen=True)
class RingAgreement:
    """What the reduced codes say: `run` is the pending check's step every rank holds (run
    it now); `stale` is one some ranks hold and others never will (drop it)."""

    run: int | None = None
    stale: int | None = None


def agreed(codes: list[int]) -> RingAgreement:
    """Read the MAX-reduced (missing, step, -step). Every rank holds the same oldest
    pending check: run it. Every rank holds one but the oldest differ: commands reach each
    rank in order, so a rank holding a newer one without the older never gets the older,
    and the ranks holding the older (the smallest step) drop it."""
    missing, newest, neg_oldest = codes
    if missing or newest == _NONE:
        return RingAgreement()
    oldest = -neg_oldest
    if oldest == newest:
        return RingAgreement(run=newest)
    return RingAgreement(stale=oldest)
