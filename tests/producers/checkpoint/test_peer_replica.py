"""Peer replica (R1): pairing, packing, the restore agreement, and restarts over gloo."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.peer_replica import (
    PeerReplica,
    agree_restore,
    holder_of,
    pack,
    source_of,
    unpack,
)

from .checkpoint_fixtures import Loop, make_state, next_randoms, params
from .test_checkpoint import _free_port

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_pairing_is_half_the_world_away() -> None:
    for world in (2, 4, 8, 1024):
        half = world // 2
        for r in range(world):
            assert holder_of(r, world) == (r + half) % world
            assert holder_of(holder_of(r, world), world) == r  # even W: pairs
            assert source_of(r, world) == holder_of(r, world)
    # a failure domain of consecutive ranks (first half) never holds its own ranks' copies
    assert {holder_of(r, 8) for r in range(4)} == {4, 5, 6, 7}
    for world in (3, 5, 7):  # odd W: a ring shifted by ceil(W/2), each rank holds one copy
        holders = [holder_of(r, world) for r in range(world)]
        assert sorted(holders) == list(range(world))
        assert all(h != r for r, h in enumerate(holders))
        assert all(source_of(h, world) == r for r, h in enumerate(holders))
    with pytest.raises(ValueError):
        holder_of(0, 4, shift=4)


def test_pack_round_trip_is_bitwise() -> None:
    state = make_state(0)
    Loop(state).steps(2)
    sd = state.state_dict()
    sd["odd"] = {
        "scalar": torch.tensor(3.5),
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "half": torch.randn(5).half(),
        "tuple": (1, "a", torch.arange(3)),
    }
    blob = pack(sd)
    out = unpack(blob)

    def same(a: Any, b: Any) -> None:
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, list | tuple):
            assert type(a) is type(b) and len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b)
        else:
            assert a == b

    same(sd, out)
    blob.zero_()  # copies (the default) do not alias the blob
    same(sd, out)
    spare = blob
    assert pack(sd, spare).data_ptr() == spare.data_ptr()  # the spare is refilled, not reallocated
    sd["model"]["big"] = torch.randn(1 << 19)  # 2 MiB: above the view threshold
    spare = pack(sd)
    views = unpack(spare, copy=False)
    spare.zero_()
    assert not torch.equal(views["model"]["big"], sd["model"]["big"])  # large: a view on the blob
    assert torch.equal(views["model"]["0.weight"], sd["model"]["0.weight"])  # small: copied out
    assert torch.equal(views["rank0"]["rng"]["torch"], sd["rank0"]["rng"]["torch"])


def test_restore_agreement() -> None:
    def agree(
        own: list[int | None], held: list[int | None], storage: int | None, **kw: Any
    ) -> tuple[Any, str]:
        return agree_restore(own, held, storage, holder=lambda j: holder_of(j, len(own)), **kw)

    assert agree([9, 9], [9, 9], 6) == (9, "memory")  # newer than storage
    assert agree([9, 9], [9, 9], 9) == (9, "memory")  # as new: the same bytes, faster
    assert agree([9, 9], [9, 9], 12) == (12, "storage")  # replica older: storage
    assert agree([9, None], [9, None], 6) == (9, "memory")  # rank 1 replaced, rank 0 holds its copy
    assert agree([9, None], [None, None], 6) == (6, "storage")  # rank 1 replaced and its copy lost
    assert agree([None, None], [None, None], None) == (None, "none")  # full restart, empty storage
    assert agree([None, None], [None, None], 4) == (4, "storage")
    # 4 ranks, one node (ranks 0, 1) replaced; ranks 2, 3 (holders of 0, 1) kept their copies
    assert agree([None, None, 9, 9], [None, None, 9, 9], 6) == (9, "memory")
    assert agree([None, None, 9, 9], [None, None, 9, 5], 6) == (6, "storage")  # rank 1's copy too old
    # the exchange of step 9 did not complete: step 8, which every rank can restore
    assert agree([None, None, 9, 9], [8, 8, 8, 8], 6) == (8, "memory")
    assert agree([None, 9, 9, 9], [9, 9, 8, 9], 6) == (6, "storage")  # no common step in memory
    assert agree([9, 9], [9, 9], 6, rejected=lambda s: s == 9) == (6, "storage")


# ----------------------------------------------------------- ranks over gloo


def _replicated_state(seed: int, rank: int, world: int) -> Any:
    """The fixtures' state with gradients averaged over the ranks (DDP without DDP's
    constructor broadcast, so one rank alone can rebuild its model) and a per-rank tensor
    in ``extra`` (a rank restored with another rank's copy is caught)."""
    state = make_state(seed, rank=rank, world_size=world)

    def average(p: torch.Tensor) -> None:
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world

    for p in state.model.parameters():
        p.register_post_accumulate_grad_hook(average)
    state.extra["shard"] = torch.randn(64, generator=torch.Generator().manual_seed(seed * 10 + rank))
    return state


def _expect(state: Any) -> dict[str, Any]:
    return {
        "shard": state.extra["shard"].clone(),
        "params": params(state),
        "optim": {k: {n: t.clone() for n, t in v.items()} for k, v in state.optimizer.state.items()},
        "sampler": state.sampler.state_dict(),
        "randoms": next_randoms(),  # what the restored RNG must draw next
    }


def _check(state: Any, exp: dict[str, Any], what: str) -> None:
    randoms = next_randoms()
    assert torch.equal(randoms[0], exp["randoms"][0]) and randoms[1:] == exp["randoms"][1:], what
    for name, tensor in params(state).items():
        assert torch.equal(tensor, exp["params"][name]), (what, name)
    assert state.sampler.state_dict() == exp["sampler"], what
    assert torch.equal(state.extra["shard"], exp["shard"]), what
    optim = state.optimizer.state
    assert len(optim) == len(exp["optim"])
    for (_, got), want in zip(optim.items(), exp["optim"].values(), strict=True):
        for key in want:
            assert torch.equal(got[key], want[key]), (what, key)


def _worker(rank: int, world: int, port: int, root: str, restarted: list[int]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    ckpt_group = dist.new_group(backend="gloo")
    peer_group = dist.new_group(backend="gloo")
    try:
        state = _replicated_state(0, rank, world)
        torch.manual_seed(100 + rank)
        np.random.seed(100 + rank)
        loop = Loop(state)

        def manager(st: Any, replica: PeerReplica) -> CheckpointManager:
            return CheckpointManager(
                Path(root),
                st,
                rank=rank,
                world_size=world,
                run_id="peer",
                process_group=ckpt_group,
                replica=replica,
            )

        replica = PeerReplica(rank, world, run_id="peer", process_group=peer_group)
        mgr = manager(state, replica)
        expect = {}
        loop.steps(3)
        mgr.save(3)
        expect[3] = _expect(state)
        loop.steps(2)
        mgr.save(5)
        expect[5] = _expect(state)
        mgr.wait_validated()
        assert replica.steps() == (5, 5)
        dist.barrier()
        if rank == 0:  # the failure came before step 5 reached storage
            shutil.rmtree(Path(root) / "step-000000005")
        loop.steps(3)  # the survivors went on past the last snapshot
        dist.barrier()

        if rank in restarted:  # this process is replaced: its state and its host memory are gone
            mgr.close()
            replica.close()
            state = _replicated_state(1000 + rank, rank, world)
            torch.manual_seed(7)
            replica = PeerReplica(rank, world, run_id="peer", process_group=peer_group)
            mgr = manager(state, replica)
            assert replica.steps() == (None, None)

        # A corrupted copy on one holder: every rank falls back to storage, together.
        victim = restarted[0]
        if rank == holder_of(victim, world):
            assert replica.held is not None and replica.held.rank == victim
            replica.held.blob[-1] ^= 0xFF
        assert mgr.load() == 3
        assert mgr.last_restore == (3, "storage")
        _check(state, expect[3], "storage fallback")
        if rank == holder_of(victim, world):
            assert replica.held is not None
            replica.held.blob[-1] ^= 0xFF
        dist.barrier()

        # The replica is newer than storage: survivors use their own copy, the replaced ranks their holder's.
        assert mgr.load() == 5
        assert mgr.last_restore == (5, "peer" if rank in restarted else "own")
        _check(state, expect[5], "peer restore")
        Loop(state).steps(2)

        # Storage newer than the replica: storage wins.
        mgr.replica = None  # this save goes to storage only
        mgr.save(7)
        expect[7] = _expect(state)
        mgr.wait_validated()
        mgr.replica = replica
        dist.barrier()
        assert mgr.load() == 7
        assert mgr.last_restore == (7, "storage")
        _check(state, expect[7], "storage newer")
        mgr.close()
        replica.close()
    finally:
        dist.destroy_process_group()


def spawn(fn, *args: object, nprocs: int) -> None:  # type: ignore[no-untyped-def]
    repo = str(Path(__file__).resolve().parents[3])
    sys.path.insert(0, repo)  # the children import this module (see test_checkpoint.spawn)
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    finally:
        sys.path.remove(repo)


@pytest.mark.parametrize(("world", "restarted"), [(2, [1]), (4, [0, 1])])  # a rank; a whole node of 4
def test_replaced_ranks_restore_from_their_peers_bitwise(
    tmp_path: Path, world: int, restarted: list[int]
) -> None:
    """W=2: rank 1 replaced, rank 0 holds its copy. W=4: a whole node (ranks 0, 1) replaced;
    ranks 2, 3 (the other failure domain) hold their copies."""
    spawn(_worker, world, _free_port(), str(tmp_path), restarted, nprocs=world)
