"""A tiny, fully random-driven training loop for the checkpoint tests.

Every source of randomness a real loop has is exercised (dropout, torch, numpy and
python ``random``, the sampler's order), so a resume that misses any one of them
diverges and ``torch.equal`` on the parameters catches it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from trainguard.producers.checkpoint.train_state import ResumableSampler, TrainState

DATA = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) / 100.0


def make_state(seed: int, *, rank: int = 0, world_size: int = 1, ddp: bool = False) -> TrainState:
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 1))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ResumableSampler(len(DATA), rank=rank, world_size=world_size, seed=7)
    return TrainState(model, optimizer, sampler, {"note": "x"}, rank=rank)


@dataclass
class Loop:
    state: TrainState
    batch: int = 4
    _it: Iterator[int] | None = field(default=None, repr=False)

    def step(self) -> None:
        if self._it is None:
            self._it = iter(self.state.sampler)
        idx = []
        for _ in range(self.batch):
            try:
                idx.append(next(self._it))
            except StopIteration:
                self._it = iter(self.state.sampler)
                idx.append(next(self._it))
        x = DATA[idx] + 0.01 * torch.randn(len(idx), 8)
        x = x * float(np.random.uniform(0.9, 1.1)) * random.uniform(0.9, 1.1)
        loss = self.state.model(x).pow(2).mean()
        loss.backward()
        self.state.optimizer.step()
        self.state.optimizer.zero_grad()

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()


def params(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def next_randoms() -> tuple[Any, ...]:
    return (torch.rand(3), np.random.rand(3).tolist(), random.random())


class Recorder:
    """A CheckpointReporter that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def checkpoint_written(self, *args: Any) -> None:
        self.calls.append(("written", args))

    def checkpoint_validated(self, *args: Any) -> None:
        self.calls.append(("validated", args))

    def checkpoint_failed(self, *args: Any) -> None:
        self.calls.append(("failed", args))

    def checkpoint_rejected(self, *args: Any) -> None:
        self.calls.append(("rejected", args))

    def steps(self, kind: str) -> list[int]:
        return [args[0] for k, args in self.calls if k == kind]

    def reasons(self, step: int) -> list[str]:
        return [args[2] for k, args in self.calls if k == "failed" and args[0] == step]
