"""Async checkpoint blocking time (C) against a synchronous save of the same state.

    .venv/bin/python bench/bench_checkpoint.py [--hidden 2048] [--layers 6] [--dir /tmp/x]

One process, CPU. The state is an MLP plus AdamW state (weights + 2 moments), RNG and
sampler, i.e. a :class:`TrainState`. Measured, all durable (fsync on):

* sync: ``dcp.save`` of the state, the call's duration (what a blocking checkpoint costs);
* async (ours): ``CheckpointManager.save`` until it returns (the staging copy), first
  save (buffers allocated) and steady state (buffers reused), plus the background
  write + commit time;
* dcp.async_save with its default stager, for reference;
* restore: ``CheckpointManager.load`` with and without re-verifying digests.

Prints a markdown table; the ratio is steady-state async blocking / sync save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainguard.producers.checkpoint import CheckpointManager
from trainguard.producers.host_stager import state_nbytes
from trainguard.producers.train_state import ResumableSampler, TrainState

warnings.filterwarnings("ignore")


def make_state(hidden: int, layers: int) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden)).sum().backward()
    opt.step()
    opt.zero_grad()
    return TrainState(model, opt, ResumableSampler(1000))


def touch(state: TrainState) -> None:
    """Stand-in for a training step between checkpoints (changes every weight)."""
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1e-6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    state = make_state(args.hidden, args.layers)
    nbytes = state_nbytes(state.state_dict())

    sync_s = []
    for i in range(args.repeat):
        touch(state)
        t0 = time.perf_counter()
        dcp.save({"app": state}, storage_writer=dcp.FileSystemWriter(str(base / f"sync-{i}")), no_dist=True)
        sync_s.append(time.perf_counter() - t0)

    dcp_async_s = []
    for i in range(args.repeat):
        touch(state)
        t0 = time.perf_counter()
        fut = dcp.async_save(
            {"app": state}, storage_writer=dcp.FileSystemWriter(str(base / f"dcp-async-{i}")), no_dist=True
        )
        dcp_async_s.append(time.perf_counter() - t0)
        fut.result()

    mgr = CheckpointManager(base / "ours", state, rank=0, world_size=1, run_id="bench")
    blocking, commit = [], []
    for step in range(args.repeat + 1):
        touch(state)
        t0 = time.perf_counter()
        handle = mgr.save(step)
        blocking.append(handle.blocking_s)
        handle.committed.result()
        commit.append(time.perf_counter() - t0)
    mgr.wait_validated()
    validate_s = statistics.median(r.seconds for r in mgr.results.values())
    t0 = time.perf_counter()
    mgr.load(verify=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.load(verify=True)
    load_verified_s = time.perf_counter() - t0
    mgr.close()

    sync = statistics.median(sync_s)
    steady = statistics.median(blocking[1:])
    print(f"state: {nbytes / 1e6:.0f} MB ({args.layers} x Linear({args.hidden}) + AdamW), dir {base}")
    print()
    print(
        "| state | sync dcp.save | async C, first | async C, steady | ratio (steady/sync) "
        "| dcp.async_save C | write+commit | validate | restore (storage) | restore + re-verify |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {nbytes / 1e6:.0f} MB | {sync:.3f} s | {blocking[0]:.3f} s | {steady:.3f} s "
        f"| {steady / sync:.3f} "
        f"| {statistics.median(dcp_async_s):.3f} s | {statistics.median(commit[1:]):.3f} s "
        f"| {validate_s:.3f} s | {load_s:.3f} s | {load_verified_s:.3f} s |"
    )


if __name__ == "__main__":
    main()
