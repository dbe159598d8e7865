"""One step of a supervised loop, as the loop sees it: ``with sup.step(step, batch) as s``.

The scope marks the step's start, the end of this rank's compute (:meth:`StepScope.
compute_done`, or the supervisor's DDP comm hook), the invariants and the ranks' agreement
(:meth:`StepScope.check`), and hands the step back to its supervisor at the end. It
holds what the supervisor decided for the step (the verdict, a checkpoint, the SDC checks
due), so the work at the step's end reads one object.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol

import torch

from ..rank.agent import RankAgent
from .config import NonFiniteLoss, UpdateVerdict
from .timing import _CudaMarks, _HostMarks


class StepOwner(Protocol):
    """What a scope calls on its supervisor (producers/training/supervisor.py)."""

    agent: RankAgent
    _marks: _HostMarks | _CudaMarks

    def _begin(self, scope: StepScope) -> None: ...

    def _check(
        self, scope: StepScope, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None
    ) -> bool: ...

    def _end(self, scope: StepScope, failed: bool) -> None: ...


class StepScope:
    """One step; use through ``with sup.step(step, batch) as s``."""

    def __init__(self, sup: StepOwner, step: int, batch: Any, microbatch_id: str) -> None:
        self.sup = sup
        self.step = step
        self.batch = batch
        self.microbatch_id = microbatch_id
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.verdict: UpdateVerdict | None = None
        #: Save a checkpoint at the end of this step: decided in check(), agreed over ranks.
        self.checkpoint_due: bool | None = None
        #: ...and then leave the attempt: the launcher resizes the world (elastic.py).
        self.resize_due = False
        #: The ranks agreed in check() (None: no agreement ran): run the pending ring check
        #: due from this step (-1: none) at the end of this step.
        self.ring_check_due: int | None = None
        #: The key of the cross check agreed to run at this step's end (0: none; None: no
        #: agreement ran, so a pending one is dropped).
        self.cross_check_due: int | None = None
        #: A sharded model (:mod:`.fsdp`): this rank took a self-check at check(), and
        #: whether the ranks agreed to replay at this step's end (None: no agreement ran).
        self.self_check_mine = False
        self.self_check_due: bool | None = None
        self._start: Any = None
        self._compute: Any = None

    def __enter__(self) -> StepScope:
        self.sup._begin(self)
        self._start = self.sup._marks.mark()
        self.sup.agent.phase = "forward"
        return self

    def compute_done(self, excluding_s: float = 0.0) -> None:
        """Mark the end of this rank's compute, before any gradient collective. Under an
        instrumented DDP or FSDP model the hooks have marked it already; this is then a
        no-op. `excluding_s` (host clock only): seconds waited in collectives before it
        (FSDP's forward all-gathers, :mod:`.fsdp`), left out of the compute time."""
        if self._compute is None:
            self._compute = self.sup._marks.mark() - excluding_s if excluding_s else self.sup._marks.mark()
            self.sup.agent.phase = "allreduce"

    def check(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None) -> bool:
        """The invariants; True: apply the update. Reads the loss (and grad norm) as host
        floats, which waits for the device to compute them."""
        self.sup.agent.phase = "allreduce"  # the ranks agree on the verdict with one all-reduce
        applied = self.sup._check(self, loss, grad_norm)
        self.sup.agent.phase = "optimizer"
        return applied

    @property
    def applied(self) -> bool:
        return self.verdict is UpdateVerdict.APPLY

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sup._end(self, failed=exc_type is not None and not isinstance(exc, NonFiniteLoss))
