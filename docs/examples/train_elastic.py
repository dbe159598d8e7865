"""An elastic DDP job (issue 45, docs/elastic.md): the same training at any world size.

    trainguard launch --nproc 4 --min-nproc 2 -- python docs/examples/train_elastic.py
    trainguard launch --nnodes 1:2 --nproc-per-node 2 --restart in-process ... train_elastic.py

A lost rank (or host) with no warm spare ready: the survivors go on in a smaller world, in
their processes; the world grows back to 4 at a checkpoint boundary once the new process is
ready (across hosts: once a host joins). What a user writes differently from train_tiny.py
(lines marked `# elastic`): the data comes from :class:`ElasticBatches` (a fixed global
batch cut into shards, each shard's dropout seeded by its step and index), each rank sums
its shards' weighted losses, and the state has no per-rank part (``per_rank=False``), so a
checkpoint loads at any world size. Dropout, AdamW and a learning-rate schedule: the run
ends within floating-point tolerance of an uninterrupted one (the shards' gradients are
summed in another order), and bitwise equal to another run that resized at the same steps.

Settings (tests): TRAIN_STEPS, TRAIN_CHECKPOINT_EVERY (a checkpoint after every N-th
step; default: trainguard's cadence), TRAIN_SAMPLES_FILE (each rank appends, per step, the
sample ids it trained), TRAIN_EVENTS_FILE (as train_tiny.py's: first steps, kills, and a
"step" line from rank 0 every 10 steps), TRAIN_KILL=rank:step:attempt (that rank
SIGKILLs itself before that step, once the newest checkpoint is validated, so that the
resume step is known; a node name in place of the rank: that host's local rank 0 notes
the kill and waits there, for the test to SIGKILL the host, its agent and ranks),
TRAIN_GROW_AT=step (a smaller world waits before that step until the launcher asks it to
grow back, so that it grows back at that step's checkpoint, whenever the new capacity is
ready).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.torch import (
    CheckpointManager,
    ElasticBatches,  # elastic
    Supervisor,
    TrainState,
    init_process_group,
    inprocess,
)

STEPS = int(os.environ.get("TRAIN_STEPS", "200"))
EVERY = os.environ.get("TRAIN_CHECKPOINT_EVERY")
GLOBAL_BATCH = 64
EVENTS = os.environ.get("TRAIN_EVENTS_FILE")
GROW_AT = int(os.environ.get("TRAIN_GROW_AT", "-1"))


def note(event: str, **fields: object) -> None:
    """One line of TRAIN_EVENTS_FILE (appended in one write)."""
    if EVENTS:
        with open(EVENTS, "a") as fh:
            fh.write(json.dumps({"event": event, "pid": os.getpid(), "ts": time.time(), **fields}) + "\n")


def await_grow(world: int, shards: int) -> None:
    """TRAIN_GROW_AT: a smaller world waits (at most 2 min) for the launcher's resize."""
    restartable = inprocess.current()
    deadline = time.monotonic() + 120
    while world < shards and restartable is not None and not restartable.resizing.is_set():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def main() -> None:
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TRAINGUARD_ATTEMPT", "0"))
    torch.manual_seed(0)
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    data = ElasticBatches(len(inputs), global_batch=GLOBAL_BATCH, seed=3)  # elastic

    every = int(EVERY) if EVERY else None
    sup = Supervisor.from_env(model=model, optimizer=optimizer, checkpoint_every_steps=every)
    state = TrainState(model, optimizer, data, {"schedule": schedule}, per_rank=False)  # elastic
    ckpt = CheckpointManager(
        os.environ["TRAINGUARD_CHECKPOINT_DIR"], state, rank=rank, world_size=world,
        run_id=sup.run_id, reporter=sup.agent,
    )  # fmt: skip
    sup.checkpoint = ckpt
    resume = int(os.environ.get("TRAINGUARD_RESUME_STEP", "-1"))
    start = ckpt.load(resume) + 1 if resume >= 0 else 0
    kill = os.environ.get("TRAIN_KILL", "").split(":")
    samples = os.environ.get("TRAIN_SAMPLES_FILE")

    for step in range(start, STEPS):
        if len(kill) == 3 and int(kill[2]) == attempt and int(kill[1]) == step:
            ckpt.wait_validated()  # the resume step is then the newest checkpoint's
            dist.barrier()
            if kill[0] == str(rank):
                note("kill", rank=rank, attempt=attempt, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if kill[0] == os.environ.get("TRAINGUARD_NODE") and os.environ.get("LOCAL_RANK") == "0":
                note("kill", rank=rank, attempt=attempt, step=step, node=kill[0])
                time.sleep(3600)  # the whole host is killed meanwhile
        if step == GROW_AT:
            await_grow(world, data.shards)
        mine = data.mine(step, rank, world)  # elastic: this rank's shards of the global batch
        with sup.step(step, torch.tensor([i for _, ids in mine for i in ids])) as s:
            loss = torch.zeros(())
            for shard, ids in mine:
                with data.rng(step, shard):  # elastic: the shard's dropout, whoever trains it
                    out = model(inputs[ids])
                loss = loss + data.weight(world) * nn.functional.mse_loss(out, targets[ids])
            loss.backward()
            s.compute_done()
            if s.check(loss):
                optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            if samples:  # inside the step: a resize ends the attempt at the step's end
                with open(samples, "a") as fh:
                    ids = [i for _, batch in mine for i in batch]
                    fh.write(json.dumps({"a": attempt, "s": step, "r": rank, "w": world, "ids": ids}) + "\n")
        if step == start:
            note("first_step", rank=rank, attempt=attempt, step=step, world=world)
        if rank == 0 and step % 10 == 0:
            note("step", attempt=attempt, step=step, world=world)
    ckpt.close()
    if rank == 0:
        run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
        weights = {name: value.detach().clone() for name, value in model.module.state_dict().items()}
        torch.save(weights, run_dir / "final.pt")
        torch.save(optimizer.state_dict(), run_dir / "final_optimizer.pt")
    sup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    inprocess.run(main)
