"""What the Lightning callback costs per step: the same Lightning fit with and without
``TrainguardLightningCallback`` (docs/examples/train_lightning.py's one line), in one run.

    .venv/bin/python bench/bench_lightning.py [--steps 1000] [--hidden 256 1024] [--rounds 5]

Two settings, each a real Lightning fit on CPU (forward, backward, optimizer, Lightning's
own loop and hooks):

* single process (Lightning's single-device strategy);
* DDP, 1 gloo rank (Lightning's DDP strategy): the callback's supervisor also installs its
  comm hook and agrees on skips with one scalar all-reduce per step.

The callback's telemetry goes to an in-memory sink (which stands for the shipper's
bounded queue), without checkpoints (their cost is bench_checkpoint.py's). Fits with and
without the callback alternate in `--rounds` rounds; a step's time is measured inside the
fit (from the first batch's start to the last batch's end, over the steps between), so the
fit's set-up is not in it; each column is the median round.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainguard.lightning import TrainguardLightningCallback
from trainguard.producers.rank.agent import MemorySink


class Mlp(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class StepClock(pl.Callback):
    """Seconds per step, from the first batch's start to the last batch's end."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.last = time.perf_counter()
        self.steps += 1

    def per_step(self) -> float:
        assert self.first is not None and self.steps > 1
        return (self.last - self.first) / (self.steps - 1)


def fit(hidden: int, ddp: bool, steps: int, supervised: bool) -> float:
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    if supervised:
        callbacks.append(TrainguardLightningCallback(sink=MemorySink(), gpu_reader=None))
    x = torch.randn(64 * 64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(64 * 64, 1, generator=torch.Generator().manual_seed(2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp" if ddp else "auto",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Mlp(hidden), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=64))
    return clock.per_step()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024], help="MLP widths, a row each")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("trainguard").setLevel(logging.ERROR)
    os.environ.setdefault("TRAINGUARD_RUN_ID", "bench-lightning")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print(f"torch {torch.__version__}, pytorch-lightning {pl.__version__}, "
          f"{platform.processor() or platform.machine()}, 1 thread, MLP 64-H-H-1 (tanh), batch 64, SGD; "
          f"{args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print()
    print("| fit | parameters | without the callback | with it | cost per step | cost / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for hidden in args.hidden:
        params = sum(p.numel() for p in Mlp(hidden).parameters())
        for name, ddp in (("single process", False), ("DDP, 1 gloo rank", True)):
            fit(hidden, ddp, 100, False)
            fit(hidden, ddp, 100, True)  # warm-up
            bare, sup = [], []
            for _ in range(args.rounds):
                bare.append(fit(hidden, ddp, args.steps, False))
                sup.append(fit(hidden, ddp, args.steps, True))
            b, w = statistics.median(bare), statistics.median(sup)
            print(f"| {name} | {params:,} | {b * 1e6:,.1f} µs | {w * 1e6:,.1f} µs "
                  f"| {(w - b) * 1e6:,.1f} µs | {(w - b) / b:.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
