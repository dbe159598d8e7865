"""A small DDP training job supervised by trainguard: the README's worked example.

Run it under the launcher (which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and the
TRAINGUARD_* variables, and restarts it from the newest validated checkpoint):

    .venv/bin/trainguard launch --nproc 4 --ranks-per-node 2 --run-id tiny \\
        --checkpoint-dir .trainguard/tiny/ckpt -- .venv/bin/python docs/examples/train_tiny.py

The lines marked `# trainguard` are all a user adds to an ordinary DDP loop. The data
and the model are deterministic (fixed seeds), so a run that was interrupted and resumed
ends with exactly the weights of an uninterrupted one: the final weights are written to
TRAINGUARD_RUN_DIR/final.pt for tests to compare.

Optional fault plan for tests, TRAINGUARD_EXAMPLE_FAULT="kind:rank:step:attempt" with
kind one of kill (SIGKILL itself before the step), hang (sleep inside the step, so the
others wait in the all-reduce), slow (0.05 s more compute per step from that step on).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.producers.checkpoint import CheckpointManager  # trainguard
from trainguard.producers.train_state import ResumableSampler, TrainState  # trainguard
from trainguard.producers.training import Supervisor  # trainguard

STEPS = int(os.environ.get("TRAIN_STEPS", "60"))
CHECKPOINT_EVERY = int(os.environ.get("TRAIN_CHECKPOINT_EVERY", "10"))
BATCH = 16


def fault_plan() -> tuple[str, int, int, int] | None:
    plan = os.environ.get("TRAINGUARD_EXAMPLE_FAULT")
    if not plan:
        return None
    kind, rank, step, attempt = plan.split(":")
    return kind, int(rank), int(step), int(attempt)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ResumableSampler(len(inputs), rank=rank, world_size=world, seed=3)

    sup = Supervisor.from_env(model=model, optimizer=optimizer)  # trainguard
    ckpt = CheckpointManager(  # trainguard
        Path(os.environ["TRAINGUARD_CHECKPOINT_DIR"]),
        TrainState(model, optimizer, sampler),
        rank=rank,
        world_size=world,
        run_id=sup.run_id,
        reporter=sup.agent,
    )
    sup.checkpoint = ckpt  # trainguard: CheckpointNow commands save through it
    resume = int(os.environ.get("TRAINGUARD_RESUME_STEP", "-1"))
    start = ckpt.load(resume) + 1 if resume >= 0 else 0  # trainguard: validated checkpoints only

    fault = fault_plan()
    attempt = int(os.environ.get("TRAINGUARD_ATTEMPT", "0"))
    order = (index for _ in iter(int, 1) for index in sampler)  # epoch after epoch, resumable
    for step in range(start, STEPS):
        batch = torch.tensor([next(order) for _ in range(BATCH)])
        hit = fault is not None and fault[1] == rank and fault[3] == attempt and step >= fault[2]
        if hit and fault is not None and fault[0] == "kill" and step == fault[2]:
            os.kill(os.getpid(), signal.SIGKILL)
        with sup.step(step) as s:  # trainguard
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            if hit and fault is not None and fault[0] == "slow":
                time.sleep(0.05)  # before the collective: this rank computes slower
            if hit and fault is not None and fault[0] == "hang" and step == fault[2]:
                time.sleep(3600)  # stuck: the others wait in the all-reduce
            loss.backward()
            s.compute_done()  # trainguard (DDP: already marked by its comm hook)
            if s.check(loss):  # trainguard: invariants and commanded skips
                optimizer.step()
            optimizer.zero_grad()
        if (step + 1) % CHECKPOINT_EVERY == 0:
            ckpt.save(step)  # trainguard: async; validated in the background
    ckpt.close()
    if rank == 0:
        run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
        run_dir.mkdir(parents=True, exist_ok=True)
        weights = {name: value.detach().clone() for name, value in model.module.state_dict().items()}
        torch.save(weights, run_dir / "final.pt")
    sup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
