"""What the ranks agree on at every step, in one MAX all-reduce of a few integers.

Every rank skips the update if one does (its own NaN loss, a grad spike, a SkipUpdate that
reached it first), checkpoints if one wants to, runs a ring check once every rank holds
it, and joins a cross check once every rank it names holds it. A CheckpointNow, the
interval or a RunRingCheck reaches each rank at its own step; a checkpoint is collective
and a ring check compares weights, so all ranks must act at the same step; so must a
sharded model's self-check, whose replay all-gathers (:mod:`.fsdp`). One tensor of
(verdict code, checkpoint wanted, a self-check offered, the oldest pending ring check's
codes, the cross check's slots) carries all of it: no extra collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..rank.handlers import RankControl
from . import cross_check, inprocess, ring_check
from .config import _CODES, UpdateVerdict

log = logging.getLogger(__name__)


def agree(
    control: RankControl,
    verdict: UpdateVerdict,
    wants_checkpoint: int,
    rank: int,
    device: Callable[[], torch.device],
    enabled: bool = True,
    self_check: bool = False,
) -> tuple[UpdateVerdict, int, int | None, int | None, bool | None]:
    """(the verdict, checkpoint now (``wants_checkpoint``'s codes: 0 no, 1 yes, 2 yes and
    then leave the attempt for a resize: :class:`.inprocess.WorldResize`), the ring check
    to run at this step's end, the cross check to run, the self-check replay). The ring
    check: -1 none; None no agreement ran, so each rank runs its own at its first step >=
    the command's. The cross check: the
    key, 0 none, None no agreement ran. The self-check replay: True when a rank offered
    `self_check` (a sharded model's, whose replay every rank joins: :mod:`.fsdp`), None
    when no agreement ran. No agreement runs without torch.distributed, in a world of one,
    or when not `enabled` (SupervisorConfig.agree_on_skip); `device` says where the
    collective's tensor lives (NCCL needs a CUDA one)."""
    dist = torch.distributed
    if not (enabled and dist.is_available() and dist.is_initialized()):
        return verdict, wants_checkpoint, None, None, None
    if dist.get_world_size() < 2:
        return verdict, wants_checkpoint, None, None, None
    pending = control.oldest_ring_check()
    head, expired = control.cross_check_head(control.current_step)
    for check in expired:
        log.warning("rank %d: cross check %s dropped: a rank it names never held it", rank, check)
    mine = [
        _CODES[verdict],
        int(wants_checkpoint),  # MAX: one rank's resize makes it everyone's
        int(self_check),
        *ring_check.agreement_codes(pending),
        *cross_check.agreement_codes(head, rank),
    ]
    codes = torch.tensor(mine, dtype=torch.int64, device=device())
    work = dist.all_reduce(codes, op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None
    inprocess.wait(work)  # work.wait(), unless the launcher ends the attempt meanwhile
    worst, checkpoint, replay, *rest = (int(v) for v in codes.tolist())
    ring = ring_check.agreed(rest[:3])
    if ring.stale is not None and ring.stale == pending:
        dropped = control.take_ring_check(ring.stale)
        log.warning("rank %d: ring check %s dropped: not every rank holds it", rank, dropped)
    due = -1 if ring.run is None else ring.run
    cross = cross_check.agreed(rest[3:]) or 0
    if verdict is not UpdateVerdict.APPLY or worst == 0:
        return verdict, checkpoint, due, cross, bool(replay)
    return UpdateVerdict.PEER, checkpoint, due, cross, bool(replay)
