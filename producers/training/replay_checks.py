"""The silent-data-corruption checks a rank runs at the end of a step, by replaying work
with the weights of that step (seed R3). The supervisor calls them; the commands that
ask for them reach the rank through its handlers (producers/rank/handlers.py).

Self-check (:mod:`.grad_checks`): when a RunSelfCheck command names this rank, at the
first step at or after its step the scope's batch is replayed twice by ``replay_fn``
after the update, and the two gradient digests are reported. The replay must not run a
collective: under DDP call the unwrapped ``model.module``. A sharded (FSDP) model's
replay all-gathers, so every rank replays at the step the ranks agree on (:mod:`.fsdp`);
its ring checks run as any (every rank recomputes at the agreed step), each rank reading
its own unreduced gradients; in a cross check the ranks it does not name replay a batch
of their own too (value discarded), so that the named ranks' all-gathers have every rank.

Ring cross-rank check (:mod:`.ring_check`): when a RunRingCheck arrives, every rank
recomputes its own microbatch and its ring neighbour's with the weights of the same step,
after that step's update, and reports both values (RingCheck). It needs ``replay_fn`` and
``batch_fn(rank, step)``, the batch ANY rank trains on at a step (the sampler knows every
rank's indices)::

    sup.batch_fn = lambda rank, step: batch_of(rank, step)

The ranks agree on the step inside the all-reduce of ``check()`` (:mod:`.agreement`, no
extra collective).

Three-rank cross check (:mod:`.cross_check`): a RunCrossRankCheck (the bisection of a
ring edge that failed alone) names three ranks, which recompute ``batch_fn(batch_rank,
step)`` after the update of the step at which all three hold it, agreed in the same
all-reduce; every rank then joins one all-reduce of three floats that gathers the values,
and the first named rank reports them (CrossRankCheck). It needs the same two hooks, and
the agreement: without it (a single process, no ``check()``, ``agree_on_skip=False``) the
check is logged and dropped.

A check never ends training: the user's hooks failing is logged and the check not run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ...schemas import RunCrossRankCheck
from ..rank.agent import RankAgent
from ..rank.handlers import RankControl
from . import cross_check, fsdp, grad_checks, ring_check
from .config import SupervisorCounters

log = logging.getLogger(__name__)


def is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def is_sharded(model: Any) -> bool:
    """An FSDP model (``fully_shard``, or the older FullyShardedDataParallel wrapper)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, torch.nn.Module) and any(
        isinstance(m, FSDPModule | FullyShardedDataParallel) for m in model.modules()
    )


class Step(Protocol):
    """What a check reads of the step that just ended (the supervisor's StepScope)."""

    step: int
    batch: Any
    microbatch_id: str
    ring_check_due: int | None
    cross_check_due: int | None
    self_check_mine: bool
    self_check_due: bool | None


class CheckHost(Protocol):
    """What the checks read of the supervisor: its hooks, model and reporting."""

    replay_fn: Callable[[Any], object] | None
    batch_fn: ring_check.BatchFn | None
    model: torch.nn.Module | None
    params: list[torch.Tensor]
    rank: int
    world_size: int
    control: RankControl
    counters: SupervisorCounters
    agent: RankAgent
    self_check_results: list[grad_checks.SelfCheckResult]
    ring_results: list[ring_check.RingResult]
    cross_results: list[cross_check.CrossResult]
    checkpoint: Any  # its CheckpointManager (or the loop's own saving: None)

    def collective_device(self) -> torch.device: ...


class ReplayChecks:
    def __init__(self, host: CheckHost) -> None:
        self.host = host

    # ------------------------------------------------------------------ can this rank run them
    def self_check_missing(self) -> str | None:
        if self.host.replay_fn is None:
            return "no replay function registered (Supervisor.replay_fn)"
        return None

    def hooks_missing(self) -> str | None:
        if (missing := self.self_check_missing()) is not None:
            return missing
        if self.host.batch_fn is None:
            return "no batch function registered (Supervisor.batch_fn(rank, step))"
        return None

    def ring_check_missing(self) -> str | None:
        if (missing := self.hooks_missing()) is not None:
            return missing
        if self.host.world_size < 2:
            return "a ring check needs 2+ ranks"
        return None

    def cross_check_refusal(self, command: RunCrossRankCheck) -> str | None:
        return self.hooks_missing() or cross_check.refusal(command, self.host.world_size)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[tuple[list[torch.Tensor], torch.nn.Module | None]]:
        """The parameters whose gradients a replay reads, and the module whose buffers it
        restores. A sharded model's: its unsharded parameters, the reduce-scatter off, so
        each rank reads its own unreduced gradients (:mod:`.fsdp`)."""
        model = self.host.model
        if model is not None and is_sharded(model):
            with fsdp.unsynced(model):
                yield fsdp.unsharded_params(model), model
        else:
            yield self.host.params, self.replay_module()

    def replay_module(self) -> torch.nn.Module | None:
        """The model the replays run on: DDP's inner module (a replay runs no collective)."""
        module = self.host.model
        if module is not None and is_ddp(module):
            inner = module.module
            module = inner if isinstance(inner, torch.nn.Module) else None
        return module

    # ------------------------------------------------------------------ the checks
    def offer_self_check(self, scope: Step) -> bool:
        """At check(), before the agreement: a sharded model's rank takes its due self-check
        now, and offers it to the agreement (every rank must replay; :mod:`.fsdp`)."""
        if is_sharded(self.host.model):
            scope.self_check_mine = self.host.control.take_self_check(scope.step)
        return scope.self_check_mine

    def end_of_step(self, scope: Step) -> None:
        """Run the self-check due at the end of this step, if any."""
        host = self.host
        if not is_sharded(host.model):
            if host.control.take_self_check(scope.step):
                self.self_check(scope)
            return
        if scope.self_check_due is None:  # no agreement ran (a world of one, or no check())
            mine = scope.self_check_mine or host.control.take_self_check(scope.step)
            alone = not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)
            if mine and alone:
                self.self_check(scope)
            elif mine:
                log.warning("rank %d: self-check at step %d dropped: a sharded model's replay needs "
                            "every rank, agreed in check()", host.rank, scope.step)  # fmt: skip
            return
        if scope.self_check_due:  # every rank replays (the forward all-gathers)
            self.self_check(scope, report=scope.self_check_mine)

    def self_check(self, scope: Step, report: bool = True) -> None:
        """Replay the step's batch twice and digest the gradients; `report`: send the
        result (a mismatch is always sent)."""
        host = self.host
        missing = self.self_check_missing() or ("no batch" if scope.batch is None else None)
        if missing is not None or host.replay_fn is None:
            log.warning("rank %d: self-check due at step %d not run: %s", host.rank, scope.step, missing)
            return
        with self.replaying() as (params, module):
            result = grad_checks.self_check(
                host.replay_fn, scope.batch, params, scope.step, scope.microbatch_id, module=module
            )
        if not report and result.passed:
            log.info("rank %d step %d: self-check (joined) %s", host.rank, scope.step, result.passed)
            return
        host.self_check_results.append(result)
        host.counters.self_checks += 1
        if not result.passed:
            host.counters.self_check_mismatches += 1
            log.error("rank %d step %d: self-check MISMATCH %s", host.rank, scope.step, result)
        host.agent.self_check(scope.step, result.microbatch_id, result.digest_first, result.digest_second)

    def ring_check(self, scope: Step) -> None:
        """Run the ring check due at the end of this step, if any (see :mod:`.ring_check`)."""
        host, control = self.host, self.host.control
        if scope.ring_check_due is None:  # no agreement: the first step >= the command's
            oldest = control.oldest_ring_check()
            first = oldest if oldest is not None and oldest <= scope.step else None
        else:
            first = scope.ring_check_due if scope.ring_check_due >= 0 else None
        taken = None if first is None else control.take_ring_check(first)
        if taken is None or host.replay_fn is None or host.batch_fn is None:
            return
        check_id, offset = taken
        if scope.ring_check_due is None and is_sharded(host.model):
            log.warning("rank %d: ring check %s dropped: a sharded model's replays need every "
                        "rank at the step agreed in check()", host.rank, check_id)  # fmt: skip
            return
        try:
            with self.replaying() as (params, module):
                result = ring_check.ring_check(
                    host.replay_fn,
                    host.batch_fn,
                    params,
                    rank=host.rank,
                    world_size=host.world_size,
                    step=scope.step,
                    check_id=check_id,
                    offset=offset,
                    module=module,
                )
        except Exception:  # the user's hooks: never end training over a check
            log.exception("rank %d step %d: ring check %s not run", host.rank, scope.step, check_id)
            return
        host.ring_results.append(result)
        # Retention keeps the checkpoint a rollback to this check would name (catalog.py).
        if (marks := getattr(host.checkpoint, "watermarks", None)) is not None:
            marks.append(scope.step)
        host.counters.ring_checks += 1
        host.counters.ring_check_s += result.seconds
        host.agent.ring_check(scope.step, check_id, result.own_value, result.peer_rank, result.peer_value)

    def cross_check(self, scope: Step) -> None:
        """Join the cross check agreed at this step, if any (see :mod:`.cross_check`)."""
        host, control = self.host, self.host.control
        if scope.cross_check_due is None:  # no agreement: nowhere to gather the values
            for dropped in control.drop_cross_checks():
                log.warning("rank %d: cross check %s dropped: no agreement to run it", host.rank, dropped)
            return
        if scope.cross_check_due == 0:
            return
        check = control.take_cross_check(scope.cross_check_due)
        if check is None and is_sharded(host.model):  # the named ranks' forwards all-gather
            self._join_replay(scope)
        result = cross_check.gather(check, host.rank, scope.step, self._recompute_of, self._sum_over_ranks)
        host.counters.cross_check_s += result.seconds
        if check is None:  # it names other ranks: this one only joined the all-reduce
            return
        host.cross_results.append(result)
        host.counters.cross_checks += 1
        if result.values is not None and check.ranks[0] == host.rank:
            host.agent.cross_rank_check(scope.step, check.microbatch_id, list(check.ranks), result.values)

    def _recompute_of(self, rank: int, step: int) -> float:
        """The value of `rank`'s microbatch at `step`, recomputed with the current weights."""
        host = self.host
        if host.replay_fn is None or host.batch_fn is None:
            raise RuntimeError(self.hooks_missing())
        with self.replaying() as (params, module):
            value = ring_check.recompute(host.replay_fn, host.batch_fn(rank, step), params, module)
        return ring_check.reportable(value)

    def _join_replay(self, scope: Step) -> None:
        """A sharded model's rank that a cross check does not name replays one batch of its
        own, value discarded, so that the named ranks' all-gathers have every rank."""
        host = self.host
        replay_fn, batch_fn, batch = host.replay_fn, host.batch_fn, scope.batch
        if replay_fn is None or (batch is None and batch_fn is None):
            log.warning("rank %d: cannot join a cross check's replays: %s", host.rank, self.hooks_missing())
            return
        try:
            if batch is None and batch_fn is not None:
                batch = batch_fn(host.rank, scope.step)
            with self.replaying() as (params, module):
                ring_check.recompute(replay_fn, batch, params, module)
        except Exception:  # the user's hooks: never end training over a check
            log.exception("rank %d step %d: joining a cross check's replays failed", host.rank, scope.step)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        dist = torch.distributed
        tensor = torch.tensor(values, dtype=torch.float64, device=self.host.collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) for v in tensor.tolist()]
