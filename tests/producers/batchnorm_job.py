"""A user's job unlike the examples, for tests/producers/test_batchnorm_resume.py: a small
CNN with two BatchNorm2d layers (running statistics each rank updates in its own forward),
Adam and a StepLR schedule, trained through one of three front ends with trainguard's
defaults only (no cadence argument, offline):

    python batchnorm_job.py lightning|hf|hand

Every rank writes its final model (buffers included), optimizer and scheduler state to
TRAINGUARD_RUN_DIR/final-<rank>.pt. TRAIN_STEPS bounds the run; TRAIN_STEP_SLEEP_S slows
each step (outside the numerics), so that a test can kill a rank mid-run after the first
checkpoint is validated.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = int(os.environ.get("TRAIN_STEPS", "60"))
SLEEP_S = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0.03"))
BATCH = 8


def cnn() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 3, 8, 8, generator=g) * 2 + 0.5  # statistics far from BN's initial ones
    return x, torch.randint(0, 4, (512,), generator=g)


def optimizer_and_schedule(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.Adam(params, lr=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)


def save_final(rank: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
    run_dir.mkdir(parents=True, exist_ok=True)
    final = {"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict()}
    torch.save(final, run_dir / f"final-{rank}.pt")


def lightning() -> None:
    import pytorch_lightning as pl

    from trainguard.lightning import TrainguardLightningCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = cnn()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(SLEEP_S)
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer, scheduler = optimizer_and_schedule(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_host,
        num_nodes=world // per_host,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        callbacks=[TrainguardLightningCallback()],  # the defaults: no cadence argument
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier()
    x, y = images()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    trainer.fit(model, train_dataloaders=loader)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    save_final(trainer.global_rank, model, trainer.optimizers[0], scheduler)


class _Images(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = images()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class _HFClassifier(nn.Module):
    """What the Trainer wants of a model: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = cnn()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(SLEEP_S)
        logits = self.net(pixel_values)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def hf() -> None:
    from transformers import Trainer, TrainingArguments

    from trainguard.transformers import TrainguardTrainerCallback

    run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = TrainingArguments(
        output_dir=str(run_dir / "hf"),
        use_cpu=True,
        ddp_backend="gloo" if distributed else None,
        ddp_find_unused_parameters=False,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    model = _HFClassifier()
    optimizer, scheduler = optimizer_and_schedule(model.parameters())
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Images(),
        optimizers=(optimizer, scheduler),
        callbacks=[TrainguardTrainerCallback()],  # the defaults
    )
    trainer.train()
    save_final(args.process_index, model, optimizer, scheduler)


def hand() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.producers.checkpoint.manager import CheckpointManager
    from trainguard.producers.checkpoint.train_state import ResumableSampler, TrainState
    from trainguard.producers.training.config import init_process_group
    from trainguard.producers.training.supervisor import Supervisor

    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(cnn())
    optimizer, scheduler = optimizer_and_schedule(model.parameters())
    x, y = images()
    sampler = ResumableSampler(len(x), rank=rank, world_size=world, seed=3)
    sup = Supervisor.from_env(model=model, optimizer=optimizer)  # the defaults: no cadence
    ckpt = CheckpointManager(
        os.environ["TRAINGUARD_CHECKPOINT_DIR"],
        TrainState(model, optimizer, sampler, extra={"scheduler": scheduler}),
        rank=rank,
        world_size=world,
        run_id=sup.run_id,
        reporter=sup.agent,
    )
    sup.checkpoint = ckpt
    resume = int(os.environ.get("TRAINGUARD_RESUME_STEP", "-1"))
    start = ckpt.load(resume) + 1 if resume >= 0 else 0
    order = (index for _ in iter(int, 1) for index in sampler)
    for step in range(start, STEPS):
        batch = torch.tensor([next(order) for _ in range(BATCH)])
        with sup.step(step, batch) as s:
            time.sleep(SLEEP_S)
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            s.compute_done()
            if s.check(loss):
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad()
    ckpt.close()
    save_final(rank, model.module, optimizer, scheduler)
    sup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"lightning": lightning, "hf": hf, "hand": hand}[sys.argv[1]]()
