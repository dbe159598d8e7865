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

Then (``--no-peer`` skips it) restore from the peer replica against from storage, in one
run: 2 gloo ranks on localhost, each with the same state and a replica; after one
validated save, both ranks load from storage (``dcp.load``, ``peer=False``); then rank 1
drops its host memory (a replaced process) and both load again: rank 1 receives its copy
from rank 0 (its holder for W=2), rank 0 restores its own. Timed on rank 1, with and
without the digest checks (storage: the files' sha256; peer: the copy's sha256).

Prints markdown tables; the ratios are steady-state async blocking / sync save and
peer restore / storage restore.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

from trainguard.producers.checkpoint.host_stager import state_nbytes
from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.train_state import ResumableSampler, TrainState

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


def _peer_worker(rank: int, port: int, hidden: int, layers: int, repeat: int, base: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = make_state(hidden, layers)
    state.rank = rank
    mgr = CheckpointManager(Path(base), state, rank=rank, world_size=2, run_id="bench-peer", replica=True)
    assert mgr.replica is not None
    mgr.save(1)
    mgr.wait_validated()
    mgr.replica.wait()
    exchange_s = mgr.replica.exchange_s[0]
    dist.barrier()
    times: dict[str, list[float]] = {}

    def timed(name: str, **kw: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        mgr.load(**kw)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        assert mgr.last_restore is not None
        times.setdefault(name + " source", []).append(0 if mgr.last_restore[1] == "storage" else 1)

    if rank == 1:
        mgr.replica.drop()  # rank 1 is replaced: rank 0 still holds its copy (and its own)
    for _ in range(repeat):
        timed("storage", peer=False, verify=False)
        timed("storage verified", peer=False, verify=True)
        timed("peer", verify=False)
        timed("peer verified", verify=True)
    gathered: list[object] = [None, None]
    dist.all_gather_object(gathered, (times, exchange_s, state_nbytes(state.state_dict())))
    mgr.close()
    dist.destroy_process_group()
    if rank != 1:
        return
    (own, exchange0, _), (peer, exchange1, nbytes) = gathered  # type: ignore[misc]
    assert not any(peer["storage source"]) and all(peer["peer source"]) and all(own["peer source"])
    med = {name: statistics.median(v) for name, v in peer.items()}
    print()
    print(
        f"peer replica, 2 gloo ranks on localhost, {nbytes / 1e6:.0f} MB per rank, "
        "timed on the replaced rank 1"
    )
    print()
    print(
        "| state | restore (storage) | restore (peer) | ratio peer/storage | storage + sha256 "
        "| peer + sha256 | ratio | survivor (own copy) | exchange after save (background) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {nbytes / 1e6:.0f} MB | {med['storage']:.3f} s | {med['peer']:.3f} s "
        f"| {med['peer'] / med['storage']:.2f} "
        f"| {med['storage verified']:.3f} s | {med['peer verified']:.3f} s "
        f"| {med['peer verified'] / med['storage verified']:.2f} | {statistics.median(own['peer']):.3f} s "
        f"| {max(exchange0, exchange1):.3f} s |"
    )


def peer_vs_storage(hidden: int, layers: int, repeat: int, base: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_peer_worker, args=(port, hidden, layers, repeat, str(base / "peer")), nprocs=2, join=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--no-peer", action="store_true", help="skip peer replica vs storage restore")
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
    if not args.no_peer:
        peer_vs_storage(args.hidden, args.layers, args.repeat, base)


if __name__ == "__main__":
    main()
