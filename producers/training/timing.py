"""Timing a step's compute before the collective without a device sync: host clock marks
on CPU, CUDA events on a GPU (read once both have completed).

Compute time before the collective (seed §7 failure 2). After the all-reduce every rank
has waited for the slowest, so only the time before it tells ranks apart. Under DDP the
all-reduce overlaps backward and ``loss.backward()`` returns only after it, so timing
``backward()`` measures the collective too. The supervisor therefore registers a DDP
communication hook (:meth:`Supervisor.instrument_ddp`, automatic when `model` is a
``DistributedDataParallel``) that stamps the moment the LAST gradient bucket is handed to
the all-reduce: every gradient of this rank is computed then, and nothing waited for
another rank yet (earlier buckets' all-reduces are asynchronous). compute_s is step
start to that stamp (or to :meth:`StepScope.compute_done`, whichever comes first); total_s
is the whole scope. It keeps DDP's overlap of communication with backward (unlike
``no_sync()`` plus an explicit all-reduce). A user with a comm hook of their own passes it
as `inner`. On CUDA the stamps are CUDA events (host time only says when kernels were
queued); they are resolved a step or two later without waiting, so the StepTiming of a
step may be sent after the next one starts. FSDP (``fully_shard``) has no comm
hook: :mod:`.fsdp` measures the forward less its all-gather waits, on the host clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


class _HostMarks:
    """Step marks on the host clock (CPU training: what the host sees is what ran)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mark(self) -> Any:
        return self.clock()

    @staticmethod
    def ready(*marks: Any) -> bool:
        return True

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        return max(0.0, float(b - a))


class _CudaMarks:
    """Step marks as CUDA events on the current stream; resolved once they completed."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def ready(*marks: Any) -> bool:
        return all(m.query() for m in marks)

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        return max(0.0, a.elapsed_time(b) / 1000.0)


@dataclass
class _Pending:
    step: int
    start: Any
    compute: Any
    end: Any
    loss: float | None
    grad_norm: float | None


def compute_marking_hook(run: Callable[..., Any], compute_done: Callable[[], None]) -> Callable[..., Any]:
    """A DDP comm hook that calls `compute_done` when the LAST bucket goes to the
    all-reduce (every gradient of this rank is computed then, and nothing waited for
    another rank yet), then runs `run` (the all-reduce hook) on the bucket."""

    def hook(hook_state: Any, bucket: Any) -> Any:
        if bucket.is_last():
            compute_done()
        return run(hook_state, bucket)

    # DDP checks the hook's annotations as objects (this module's are strings).
    hook.__annotations__ = {
        "hook_state": object,
        "bucket": torch.distributed.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook
