"""Timing a step's compute before the collective without a device sync: host clock marks
on CPU, CUDA events on a GPU (read once both have completed)."""

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
