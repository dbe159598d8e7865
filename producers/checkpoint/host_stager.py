"""The staging copy of an asynchronous checkpoint: a host-memory snapshot of a state dict.

``stage`` copies every tensor of a (live) state dict to CPU memory, so training may
modify the originals while the copy is written; that copy is the whole blocking cost
of an asynchronous save. To make it a plain memcpy rather than an allocation plus
page faults, buffers of a released snapshot are reused by the next ``stage`` when the
shapes and dtypes match (steady state: every checkpoint after the first). GPU tensors
are copied into pinned buffers. Non-tensor leaves are deep-copied.

A snapshot is owned by its caller until ``release``; snapshots kept while storage is down
are simply not released, so each holds its own buffers.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

__all__ = ["HostStager", "state_nbytes"]


def _copy(src: Any, spare: Any) -> Any:
    if isinstance(src, torch.Tensor):
        data = src.detach()
        if (
            type(data) is torch.Tensor
            and isinstance(spare, torch.Tensor)
            and spare.shape == data.shape
            and spare.dtype == data.dtype
        ):
            spare.copy_(data)
            return spare
        if type(data) is not torch.Tensor:  # DTensor and other subclasses: let them copy themselves
            return data.to("cpu", copy=True)
        if data.is_cuda:
            buf = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            buf.copy_(data)
            return buf
        return data.clone(memory_format=torch.contiguous_format)
    if isinstance(src, dict):
        other = spare if isinstance(spare, dict) else {}
        return {key: _copy(value, other.get(key)) for key, value in src.items()}
    if type(src) is list or type(src) is tuple:
        others = spare if isinstance(spare, list | tuple) and len(spare) == len(src) else [None] * len(src)
        items = [_copy(value, other) for value, other in zip(src, others, strict=True)]
        return items if type(src) is list else tuple(items)
    return copy.deepcopy(src)


def state_nbytes(state: Any) -> int:
    """Bytes held by the tensors of a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_nbytes(v) for v in state)
    return 0


class HostStager:
    """Snapshots state dicts into host memory, reusing released buffers."""

    def __init__(self, spares: int = 1) -> None:
        self._spares = spares
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def stage(self, state: Any) -> Any:
        with self._lock:
            spare = self._free.pop() if self._free else None
        return _copy(state, spare)

    def release(self, staged: Any) -> None:
        """The snapshot is no longer needed; its buffers may back the next one."""
        with self._lock:
            if len(self._free) < self._spares:
                self._free.append(staged)
