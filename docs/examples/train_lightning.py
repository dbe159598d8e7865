"""A PyTorch Lightning job supervised by trainguard: one line, the callback.

    .venv/bin/trainguard launch --nproc 2 --ranks-per-node 1 --run-id lit \\
        --checkpoint-dir .trainguard/lit/ckpt -- .venv/bin/python docs/examples/train_lightning.py

The launcher sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and TORCHELASTIC_RUN_ID, so Lightning
joins the launcher's process group (gloo here, NCCL on GPUs) and spawns nothing; `devices`
is the ranks on this host, `num_nodes` the hosts. The callback measures each step before
the all-reduce, checks and (when commanded) skips updates, runs the self-check replays,
executes the processors' commands, saves trainguard's validated checkpoints when one is
due, and resumes from the launcher's validated step after a restart: the line marked
`# trainguard` is all this script has of trainguard.

The data and model are deterministic (fixed seeds), so a run that was interrupted and
resumed ends with the weights of an uninterrupted one; rank 0 writes them to
TRAINGUARD_RUN_DIR/final.pt for tests to compare. TRAIN_STEPS (default 48) bounds the run;
TRAIN_CHECKPOINT_EVERY=N saves after every N-th step instead of the policy's interval.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainguard.lightning import TrainguardLightningCallback

STEPS = int(os.environ.get("TRAIN_STEPS", "48"))
EVERY = os.environ.get("TRAIN_CHECKPOINT_EVERY")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    # Lightning shards it across the ranks with a DistributedSampler (seeded, by epoch).
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    every = int(EVERY) if EVERY else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_host,
        num_nodes=world // per_host,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        callbacks=[TrainguardLightningCallback(checkpoint_every_steps=every)],  # trainguard
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, train_dataloaders=data())
    if trainer.global_rank == 0:
        run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, run_dir / "final.pt")


if __name__ == "__main__":
    main()
