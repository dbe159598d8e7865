"""The job of bench/bench_restart.py as a user writes it for plain torchrun, without
trainguard: the README example's model (16 -> 32 -> tanh -> dropout -> 1, AdamW, batch 16,
the same data and seeds) under DDP on gloo, a torch DCP checkpoint after every
TRAIN_CHECKPOINT_EVERY-th step, and on start the newest complete checkpoint found and
loaded by the script itself (torchrun passes no resume step).

    torchrun --nproc-per-node 4 --max-restarts 1 ... bench/restart_torchrun.py

TRAIN_KILL="rank:step": that rank SIGKILLs itself before that step in the first attempt.
TRAIN_EVENTS_FILE: the same JSON lines as docs/examples/train_tiny.py ("kill", and
"first_step" after the first step a process completes), plus the moments that explain a
restart ("imported", "pg_init", "model_built", "restored"), each with the wall clock.
CKPT_DIR: where the checkpoints go (step-N/, a COMPLETE marker written after the save).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: they are part of a restart

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

STEPS = int(os.environ.get("TRAIN_STEPS", "200"))
EVERY = int(os.environ.get("TRAIN_CHECKPOINT_EVERY", "20"))
BATCH = 16
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def note(event: str, rank: int, step: int, ts: float | None = None) -> None:
    path = os.environ.get("TRAIN_EVENTS_FILE")
    if path:
        line = {"event": event, "rank": rank, "attempt": ATTEMPT, "step": step, "pid": os.getpid()}
        line["ts"] = ts if ts is not None else time.time()
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def newest_complete(root: Path) -> int | None:
    steps = [int(d.name[5:]) for d in root.glob("step-*") if (d / "COMPLETE").exists()]
    return max(steps, default=None)


def main() -> None:
    rank_env = int(os.environ["RANK"])
    note("start", rank_env, -1, STARTED)
    note("imported", rank_env, -1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    note("pg_init", rank, -1)
    torch.manual_seed(0)
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(3 + rank))
    note("model_built", rank, -1)

    root = Path(os.environ["CKPT_DIR"])
    start = 0
    resume = newest_complete(root)
    if resume is not None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=str(root / f"step-{resume}"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(torch.load(root / f"step-{resume}" / f"rng-{rank}.pt"))
        start = resume + 1
    note("restored", rank, start - 1)

    kill_rank, _, kill_step = os.environ.get("TRAIN_KILL", "-1:-1").partition(":")
    for step in range(start, STEPS):
        if ATTEMPT == 0 and rank == int(kill_rank) and step == int(kill_step):
            note("kill", rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        at = (step * BATCH) % len(inputs)
        batch = order[at : at + BATCH]
        loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == start:
            note("first_step", rank, step)
        if (step + 1) % EVERY == 0:  # between steps, on the default group: no DDP collective runs
            target = root / f"step-{step}"
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp.save(state, checkpoint_id=str(target))
            torch.save(torch.get_rng_state(), target / f"rng-{rank}.pt")
            dist.barrier()
            if rank == 0:
                (target / "COMPLETE").touch()
    if rank == 0 and (final := os.environ.get("FINAL_OUT")):
        torch.save(model.module.state_dict(), final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
