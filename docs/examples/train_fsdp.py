"""A small FSDP (``fully_shard``) training job supervised by trainguard: the hand-written
loop of docs/examples/train_tiny.py with its parameters sharded instead of replicated.

Run it under the launcher (which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and the
TRAINGUARD_* variables, and restarts it from the newest validated checkpoint):

    .venv/bin/trainguard launch --nproc 4 --ranks-per-node 2 --run-id fsdp \\
        --checkpoint-dir .trainguard/fsdp/ckpt -- .venv/bin/python docs/examples/train_fsdp.py

The lines marked `# trainguard` are all a user adds to an ordinary FSDP loop, the same as
for DDP. What the supervisor does differently for a sharded model
(trainguard/producers/training/fsdp.py): the compute time is the forward less its
parameter all-gathers (FSDP has no comm hook); a commanded self-check and a ring cross-rank
check are replayed by every rank at the step they agree on (the forward all-gathers),
each reading its own unreduced gradients (in a three-rank cross check, a ring edge's
bisection, the ranks it does not name replay a batch of their own). The checkpoint is a
sharded DCP one: each rank writes and validates its own shards, and a restart loads them
back into the sharded model.

The data and the model are deterministic (fixed seeds), so a run that was interrupted and
resumed ends with exactly the weights of an uninterrupted one: the final weights,
gathered whole, are written to TRAINGUARD_RUN_DIR/final.pt for tests to compare.
TRAIN_STEPS (default 60) and TRAIN_CHECKPOINT_EVERY (a fixed cadence instead of the
interval in force) as for train_tiny.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from trainguard.torch import (  # trainguard
    CheckpointManager,
    ResumableSampler,
    Supervisor,
    TrainState,
    init_process_group,
)

STEPS = int(os.environ.get("TRAIN_STEPS", "60"))
EVERY = os.environ.get("TRAIN_CHECKPOINT_EVERY")  # a fixed cadence instead of the interval
BATCH = 16


def main() -> None:
    init_process_group("gloo")  # trainguard: torch's, timed for the restart phases
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank, then sharded
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    for layer in (model[0], model[2], model):
        fully_shard(layer)  # each layer's parameters sharded over the ranks, then the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = ResumableSampler(len(inputs), rank=rank, world_size=world, seed=3)

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(inputs[batch]), targets[batch])

    every = int(EVERY) if EVERY else None
    sup = Supervisor.from_env(model=model, optimizer=optimizer, checkpoint_every_steps=every)  # trainguard
    sup.replay_fn = lambda batch: loss_of(batch).backward()  # trainguard: the self-check replay (every rank)
    # trainguard: any rank's batch at a step, for the ring cross-rank check (rank r trains
    # step s on the BATCH indices of its stream from s * BATCH: see `order` below)
    sup.batch_fn = lambda r, step: torch.tensor(sampler.indices(r, step * BATCH, BATCH))
    ckpt = CheckpointManager(  # trainguard: sharded DCP checkpoints, validated per shard
        os.environ["TRAINGUARD_CHECKPOINT_DIR"],
        TrainState(model, optimizer, sampler),
        rank=rank,
        world_size=world,
        run_id=sup.run_id,
        reporter=sup.agent,
    )
    sup.checkpoint = ckpt  # trainguard: it saves when one is due (the interval in force, a CheckpointNow)
    resume = int(os.environ.get("TRAINGUARD_RESUME_STEP", "-1"))
    start = ckpt.load(resume) + 1 if resume >= 0 else 0  # trainguard: validated checkpoints only

    order = (index for _ in iter(int, 1) for index in sampler)  # epoch after epoch, resumable
    for step in range(start, STEPS):
        batch = torch.tensor([next(order) for _ in range(BATCH)])
        with sup.step(step, batch) as s:  # trainguard
            loss = loss_of(batch)
            loss.backward()
            s.compute_done()  # trainguard (FSDP: already marked at the forward's end)
            if s.check(loss):  # trainguard: invariants and commanded skips
                optimizer.step()
            optimizer.zero_grad()
    ckpt.close()
    weights = {name: value.full_tensor() for name, value in model.state_dict().items()}  # every rank gathers
    if rank == 0:
        run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.save(weights, run_dir / "final.pt")
    sup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
