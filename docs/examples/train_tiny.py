"""A small DDP training job supervised by trainguard: the README's worked example.

Run it under the launcher (which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and the
TRAINGUARD_* variables, and restarts it from the newest validated checkpoint):

    .venv/bin/trainguard launch --nproc 4 --ranks-per-node 2 --run-id tiny \\
        --checkpoint-dir .trainguard/tiny/ckpt -- .venv/bin/python docs/examples/train_tiny.py

The lines marked `# trainguard` are all a user adds to an ordinary DDP loop. The data
and the model are deterministic (fixed seeds), so a run that was interrupted and resumed
ends with exactly the weights of an uninterrupted one: the final weights are written to
TRAINGUARD_RUN_DIR/final.pt for tests to compare.

Checkpoints: the Supervisor saves (asynchronously; validated in the background) at the step
boundary where its ``should_checkpoint`` says one is due, the same step on every rank: the
interval in force (`interval: auto` in the policy: the processor's SetCheckpointInterval,
else the launcher's TRAINGUARD_CHECKPOINT_INTERVAL_S) counted in steps of the measured
step time, or a CheckpointNow; TRAIN_CHECKPOINT_EVERY=N saves after every N-th step instead
(tests that compare which steps were saved).

TRAIN_MODEL=dropout-adamw trains the same network with a dropout layer and AdamW: the
per-rank RNG state the dropout masks come from is in the checkpoint (TrainState), so
that run too resumes bitwise.

Optional fault plan for tests, TRAINGUARD_EXAMPLE_FAULT="kind:rank:step:attempt[:steps]"
(in that attempt, from that step on; several plans separated by commas, the first one
armed for this rank and attempt applies) with kind one of kill (the rank SIGKILLs itself
before the step), hang (it sleeps inside the step, so the others wait in the
all-reduce), slow (0.05 s more compute per step, before the collective), flip (its
device turns faulty: every second gradient it computes has one mantissa bit flipped,
training and self-check replays alike) or storage (every rank's checkpoint writes fail
from its save at that step until its save `steps` steps later, default 15: measured in
saves, not in the loop's steps, because the writes run in the background and may lag the
loop; the rank field is ignored). A deterministically wrong device (every matrix product
off by a fixed factor, so the self-check passes and only the ring cross-rank check
catches it) is the supervisor's chaos knob TRAINGUARD_INJECT_WRONG_DEVICE
(producers/chaos/device_fault.py), not a fault of this script's.

TRAIN_EVENTS_FILE=path: every rank appends one JSON line when it kills itself (a kill
fault) and after the first step it completes in each call of main(), with its pid and the
wall clock: R by the script's own clock, and which processes survived a restart
(bench/bench_restart.py, tests/producers/test_inprocess_restart.py).

TRAIN_HOLD_AT=step: under in-process restart, the first attempt's ranks wait before that
step (at most 2 min) until the launcher asks them for a planned leave (a DrainNode: the
resize key), so that a drain the processor decides from the ranks' health reports comes
while the run is still going, however long its prediction takes
(tests/producers/launcher/test_drain_e2e.py). The math is the same with or without it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.torch import (  # trainguard
    CheckpointManager,
    ResumableSampler,
    Supervisor,
    TrainState,
    flip_bit,
    init_process_group,
    inprocess,
)

STEPS = int(os.environ.get("TRAIN_STEPS", "60"))
EVERY = os.environ.get("TRAIN_CHECKPOINT_EVERY")  # a fixed cadence instead of the interval
BATCH = 16
MODEL = os.environ.get("TRAIN_MODEL", "sgd")  # or "dropout-adamw"
HOLD_AT = int(os.environ.get("TRAIN_HOLD_AT", "-1"))


class Fault:
    """The injected fault of TRAINGUARD_EXAMPLE_FAULT (module docstring); inert when unset."""

    def __init__(self, plans: str, rank: int, attempt: int) -> None:
        mine = [plan.split(":") for plan in plans.split(",") if plan]
        mine = [p for p in mine if int(p[3]) == attempt and (p[0] == "storage" or int(p[1]) == rank)]
        kind, _, step, _, *steps = mine[0] if mine else ["none", "-1", "0", "-1"]
        self.kind, self.step, self.steps = kind, int(step), int(steps[0]) if steps else 15
        self.armed = bool(mine)
        self.now = -1  # the loop's current step
        self.saving = -1  # the step of the newest save the loop asked for
        self.backwards = 0  # gradients this rank computed since the device turned faulty

    def active(self, kind: str) -> bool:
        return self.armed and self.kind == kind and self.now >= self.step

    def watch(self, manager: CheckpointManager) -> None:
        """Note the step of every save the loop asks `manager` for (the storage window)."""
        save = manager.save

        def noted(step: int, *args: Any, **kwargs: Any) -> Any:
            self.saving = step
            return save(step, *args, **kwargs)

        manager.save = noted  # type: ignore[method-assign]

    def storage(self) -> None:  # CheckpointManager's storage probe: raise = unavailable
        if self.armed and self.kind == "storage" and self.step <= self.saving < self.step + self.steps:
            raise OSError(f"injected: storage unavailable since the save of step {self.step}")

    def gradient(self, grad: torch.Tensor) -> torch.Tensor:  # a hook on one weight's gradient
        if not self.active("flip"):
            return grad
        self.backwards += 1
        if self.backwards % 2:
            grad = grad.clone()
            flip_bit(grad, 0, 12)  # a low mantissa bit: no invariant notices it
        return grad


def note(event: str, rank: int, attempt: int, step: int) -> None:
    """One line of TRAIN_EVENTS_FILE (module docstring), appended in one write."""
    path = os.environ.get("TRAIN_EVENTS_FILE")
    if path:
        line = {"event": event, "rank": rank, "attempt": attempt, "step": step}
        line |= {"pid": os.getpid(), "ts": time.time()}
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def await_leave() -> None:
    """TRAIN_HOLD_AT: wait (at most 2 min) until the launcher asks for a planned leave."""
    restartable = inprocess.current()
    deadline = time.monotonic() + 120
    while restartable is not None and not restartable.resizing.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    init_process_group("gloo")  # trainguard: torch's, timed for the restart phases
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TRAINGUARD_ATTEMPT", "0"))
    fault = Fault(os.environ.get("TRAINGUARD_EXAMPLE_FAULT", ""), rank, attempt)
    torch.manual_seed(0)  # the same initial weights on every rank
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    dropout = [nn.Dropout(0.1)] if MODEL == "dropout-adamw" else []
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), *dropout, nn.Linear(32, 1))
    net[0].weight.register_hook(fault.gradient)
    model = DistributedDataParallel(net)
    optimizer: torch.optim.Optimizer
    if MODEL == "dropout-adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ResumableSampler(len(inputs), rank=rank, world_size=world, seed=3)

    def loss_of(batch: torch.Tensor, module: nn.Module = model) -> torch.Tensor:
        return nn.functional.mse_loss(module(inputs[batch]), targets[batch])

    every = int(EVERY) if EVERY else None
    sup = Supervisor.from_env(model=model, optimizer=optimizer, checkpoint_every_steps=every)  # trainguard
    sup.replay_fn = lambda batch: loss_of(batch, net).backward()  # trainguard: the self-check replay
    # trainguard: any rank's batch at a step, for the ring cross-rank check (rank r trains
    # step s on the BATCH indices of its stream from s * BATCH: see `order` below)
    sup.batch_fn = lambda r, step: torch.tensor(sampler.indices(r, step * BATCH, BATCH))
    ckpt = CheckpointManager(  # trainguard
        os.environ["TRAINGUARD_CHECKPOINT_DIR"],  # a directory or a URL (s3://...)
        TrainState(model, optimizer, sampler),
        rank=rank,
        world_size=world,
        run_id=sup.run_id,
        reporter=sup.agent,
        storage_hook=fault.storage,
    )
    fault.watch(ckpt)
    sup.checkpoint = ckpt  # trainguard: it saves when one is due (the interval in force, a CheckpointNow)
    resume = int(os.environ.get("TRAINGUARD_RESUME_STEP", "-1"))
    start = ckpt.load(resume) + 1 if resume >= 0 else 0  # trainguard: validated checkpoints only

    order = (index for _ in iter(int, 1) for index in sampler)  # epoch after epoch, resumable
    for step in range(start, STEPS):
        fault.now = step
        if step == HOLD_AT and attempt == 0:
            await_leave()
        batch = torch.tensor([next(order) for _ in range(BATCH)])
        if fault.active("kill") and step == fault.step:
            note("kill", rank, attempt, step)
            os.kill(os.getpid(), signal.SIGKILL)
        with sup.step(step, batch) as s:  # trainguard
            loss = loss_of(batch)
            if fault.active("slow"):
                time.sleep(0.05)  # before the collective: this rank computes slower
            if fault.active("hang") and step == fault.step:
                time.sleep(3600)  # stuck: the others wait in the all-reduce
            loss.backward()
            s.compute_done()  # trainguard (DDP: already marked by its comm hook)
            if s.check(loss):  # trainguard: invariants and commanded skips
                optimizer.step()
            optimizer.zero_grad()
        if step == start:
            note("first_step", rank, attempt, step)
    ckpt.close()
    if rank == 0:
        run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
        run_dir.mkdir(parents=True, exist_ok=True)
        weights = {name: value.detach().clone() for name, value in model.module.state_dict().items()}
        torch.save(weights, run_dir / "final.pt")
        torch.save(optimizer.state_dict(), run_dir / "final_optimizer.pt")
    sup.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    inprocess.run(main)  # trainguard: under --restart in-process, a fault ends main(), not the process
