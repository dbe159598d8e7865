"""CheckpointManager: async save, atomic commit, bitwise resume, storage outages, 2 ranks."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard.producers.checkpoint.manager import CheckpointError, CheckpointManager
from trainguard.producers.checkpoint.train_state import ResumableSampler
from trainguard.producers.checkpoint.validate import MANIFEST, read_manifest, validate

from .checkpoint_fixtures import Loop, Recorder, make_state, next_randoms, params

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manager(root: Path, state, **kw) -> CheckpointManager:  # type: ignore[no-untyped-def]
    return CheckpointManager(root, state, rank=0, world_size=1, run_id="run-1", **kw)


def test_sampler_resumes_without_repeating_or_skipping() -> None:
    a = ResumableSampler(10, seed=3)
    it = iter(a)
    seen = [next(it) for _ in range(7)]
    b = ResumableSampler(10, seed=3)
    b.load_state_dict(a.state_dict())
    rest_a = list(it) + list(iter(a))[:5]  # finishes epoch 0, then (the start of) epoch 1
    rest_b = list(iter(b)) + list(iter(b))[:5]
    assert rest_a == rest_b
    assert sorted(seen + rest_a[:3]) == list(range(10))  # epoch 0: each index once
    assert a.epoch == b.epoch == 2 and a.position == b.position == 0


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    rec = Recorder()
    a = make_state(0)
    loop_a = Loop(a)
    loop_a.steps(5)
    with manager(tmp_path, a, reporter=rec) as mgr:
        handle = mgr.save(5, last_verified_step=4)
        loop_a.steps(3)  # drift, then a second checkpoint: both must pass the norm band
        mgr.save(8)
        mgr.wait_validated()
        assert mgr.validated_steps() == [5, 8]
    assert handle.committed.result(timeout=10)
    assert rec.steps("written") == [5, 8] and rec.steps("validated") == [5, 8]
    assert [a for k, a in rec.calls if k == "validated"][0][2] == 4  # last_verified_step
    assert read_manifest(tmp_path / "step-000000005")["last_verified_step"] == 4

    randoms_a = next_randoms()
    loop_a.steps(5)
    final_a = params(a)

    b = make_state(123)  # different init, different RNG position
    with manager(tmp_path, b) as mgr:
        assert mgr.load() == 8
    randoms_b = next_randoms()
    assert torch.equal(randoms_a[0], randoms_b[0]) and randoms_a[1:] == randoms_b[1:]
    loop_b = Loop(b)
    loop_b.steps(5)
    final_b = params(b)
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name
    assert b.sampler.state_dict() == a.sampler.state_dict()
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_load_named_step_and_extra(tmp_path: Path) -> None:
    a = make_state(0)
    Loop(a).steps(2)
    with manager(tmp_path, a) as mgr:
        mgr.save(2)
        a.extra["note"] = "changed"
        Loop(a).steps(1)
        mgr.save(3)
        mgr.wait_validated()
        assert mgr.load(2) == 2
    assert a.extra["note"] == "x"
    with pytest.raises(CheckpointError, match="does not exist"):
        manager(tmp_path, a).load(7)


def test_async_save_returns_before_the_write_and_snapshots_the_state(tmp_path: Path) -> None:
    release = threading.Event()
    writing = threading.Event()

    def slow_storage() -> None:
        writing.set()
        assert release.wait(30)

    a = make_state(0)
    loop = Loop(a)
    loop.steps(2)
    at_save = params(a)
    with manager(tmp_path, a, storage_hook=slow_storage) as mgr:
        handle = mgr.save(2)
        # save() returned with the state staged; the write has not finished (it cannot).
        assert writing.wait(10)
        assert not handle.attempted.done()
        assert not (tmp_path / "step-000000002" / MANIFEST).exists()
        loop.steps(3)  # training continues and changes the parameters during the write
        release.set()
        assert handle.wait(10) == "committed"
        mgr.wait_validated()
        b = make_state(1)
        mgr2 = manager(tmp_path, b)
        assert mgr2.load() == 2
        mgr2.close()
    for name, tensor in params(b).items():
        assert torch.equal(tensor, at_save[name]), name  # the snapshot, not the later values
    assert handle.blocking_s >= 0


def test_checkpoint_without_manifest_is_invisible(tmp_path: Path) -> None:
    a = make_state(0)
    loop = Loop(a)
    with manager(tmp_path, a) as mgr:
        loop.steps(1)
        mgr.save(1)
        loop.steps(1)
        mgr.save(2)
        mgr.wait_validated()
    (tmp_path / "step-000000002" / MANIFEST).unlink()  # as if the writer died before committing
    mgr = manager(tmp_path, make_state(1))
    assert mgr.committed_steps() == [1]
    assert mgr.validated_steps() == [1]
    assert mgr.load() == 1
    with pytest.raises(CheckpointError, match="no manifest"):
        mgr.load(2)
    mgr.close()
    assert not validate(tmp_path / "step-000000002").ok


def three_checkpoints(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Validated checkpoints at steps 2, 4 and 6 of one loop; the parameters at each."""
    a = make_state(0)
    loop, at = Loop(a), {}
    with manager(root, a) as mgr:
        for step in (2, 4, 6):
            loop.steps(2)
            mgr.save(step)
            at[step] = params(a)
        mgr.wait_validated()
        assert mgr.validated_steps() == [2, 4, 6]
    return at


def flip_mid_shard(directory: Path) -> str:
    shard = sorted(directory.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name


@pytest.mark.parametrize("fault", ["flipped byte", "missing shard"])
def test_a_corrupted_checkpoint_named_for_resume_falls_back_and_is_never_chosen_again(
    tmp_path: Path, fault: str
) -> None:
    at = three_checkpoints(tmp_path)
    newest = tmp_path / "step-000000006"
    if fault == "flipped byte":
        name, why = flip_mid_shard(newest), "digest mismatch in shard"
    else:
        name = sorted(newest.glob("*.distcp"))[0].name
        (newest / name).unlink()
        why = "missing shard"
    rec, b = Recorder(), make_state(1)
    with manager(tmp_path, b, reporter=rec) as mgr:
        assert mgr.load(6) == 4  # the launcher named 6: the newest validated one older than it
        assert (newest / "REJECTED").exists() and mgr.validated_steps() == [2, 4]
        assert list(mgr.rejected) == [6] and why in mgr.rejected[6] and name in mgr.rejected[6]
        assert rec.calls[-1][0] == "rejected" and rec.calls[-1][1][0] == 6 and rec.calls[-1][1][3] == 4
        assert any(why in reason for reason in rec.reasons(6))  # and reported as a failure
        assert mgr.load(6) == 4 and mgr.rejected == {}  # marked once: not re-verified, not re-reported
        assert mgr.load() == 4
    for name_, tensor in params(b).items():
        assert torch.equal(tensor, at[4][name_]), name_


def test_with_every_checkpoint_rejected_load_says_none_is_left(tmp_path: Path) -> None:
    three_checkpoints(tmp_path)
    for step in (2, 4, 6):
        flip_mid_shard(tmp_path / f"step-{step:09d}")
    rec = Recorder()
    with manager(tmp_path, make_state(1), reporter=rec) as mgr:
        with pytest.raises(CheckpointError, match="no valid checkpoint left") as err:
            mgr.load(6)
        assert all(f"checkpoint step {s}" in str(err.value) for s in (2, 4, 6))
        assert [args[0] for k, args in rec.calls if k == "rejected"] == [6, 4, 2]
        assert {args[3] for k, args in rec.calls if k == "rejected"} == {-1}
        assert mgr.validated_steps() == []


def test_a_load_that_fails_after_verification_falls_back_too(tmp_path: Path) -> None:
    three_checkpoints(tmp_path)
    metadata = tmp_path / "step-000000006" / ".metadata"
    manifest = read_manifest(tmp_path / "step-000000006")
    assert manifest is not None
    metadata.write_bytes(b"not a pickle")  # the digest check is skipped (verify=False) below
    rec = Recorder()
    with manager(tmp_path, make_state(1), reporter=rec) as mgr:
        assert mgr.load(6, verify=False) == 4
        assert "loading checkpoint step 6 failed" in mgr.rejected[6]
        assert (tmp_path / "step-000000006" / "REJECTED").exists()


def storage_outage() -> tuple[threading.Event, Callable[[], None]]:
    """A storage probe that fails while the event is set (set at first): clear it to end the outage."""
    down = threading.Event()
    down.set()

    def storage() -> None:
        if down.is_set():
            raise OSError(5, "Input/output error (storage unavailable)")

    return down, storage


def test_storage_outage_keeps_training_and_flushes_later(tmp_path: Path) -> None:
    down, storage = storage_outage()
    rec = Recorder()
    a = make_state(0)
    loop = Loop(a)
    mgr = manager(tmp_path, a, reporter=rec, storage_hook=storage, max_pending=2)
    handles = {}
    for step in (2, 4, 6):
        loop.steps(2)  # training continues through the outage
        handles[step] = mgr.save(step)
        assert handles[step].wait(10) == "pending"
    at_6 = params(a)
    assert mgr.pending_steps() == [4, 6]  # bounded: the oldest was dropped
    assert handles[2].committed.result(10) is False
    assert mgr.validated_steps() == []
    assert any("storage write failed" in r and "unavailable" in r for r in rec.reasons(4))
    assert any("dropped from host memory" in r for r in rec.reasons(2))
    assert len(rec.reasons(6)) == 1  # retries are not re-reported

    assert mgr.flush() == 2  # still down: still kept
    down.clear()
    assert mgr.flush() == 0
    mgr.wait_validated()
    assert handles[4].committed.result(10) and handles[6].committed.result(10)
    assert mgr.validated_steps() == [4, 6]
    assert rec.steps("written") == [4, 6] and rec.steps("validated") == [4, 6]
    mgr.close()

    b = make_state(9)
    with manager(tmp_path, b) as mgr2:
        assert mgr2.load() == 6
    for name, tensor in params(b).items():
        assert torch.equal(tensor, at_6[name])


def test_a_save_after_storage_is_back_writes_the_kept_ones_before_making_room(tmp_path: Path) -> None:
    down, storage = storage_outage()
    rec = Recorder()
    a = make_state(0)
    mgr = manager(tmp_path, a, reporter=rec, storage_hook=storage, max_pending=2)
    kept = [mgr.save(step) for step in (2, 4)]
    assert [h.wait(10) for h in kept] == ["pending", "pending"]
    down.clear()  # storage is back before the next save, which needs a third slot
    assert mgr.save(6).wait(10) == "committed"
    mgr.wait_validated()
    assert all(h.committed.result(10) for h in kept)  # none was dropped for room
    assert mgr.validated_steps() == [2, 4, 6]
    assert not any("dropped" in r for step in (2, 4) for r in rec.reasons(step))
    mgr.close()


def test_retention_keeps_the_newest_validated(tmp_path: Path) -> None:
    a = make_state(0)
    loop = Loop(a)
    with manager(tmp_path, a, keep=2) as mgr:
        for step in range(1, 5):
            loop.steps(1)
            mgr.save(step)
        mgr.wait_validated()
        assert mgr.validated_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]


# ---------------------------------------------------------------- two ranks (gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_rank_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        a = make_state(0, rank=rank, world_size=world, ddp=True)
        torch.manual_seed(100 + rank)  # rank-specific RNG streams
        np.random.seed(100 + rank)
        loop = Loop(a)
        loop.steps(3)
        rec = Recorder()
        mgr = CheckpointManager(Path(root), a, rank=rank, world_size=world, run_id="r2", reporter=rec)
        mgr.save(3)
        loop.steps(2)  # DDP all-reduces on the default group while the save runs on its own
        mgr.wait_validated()
        dist.barrier()
        assert mgr.validated_steps() == [3]
        assert rec.steps("written") == [3]
        assert rec.steps("validated") == ([3] if rank == 0 else [])  # one reporter per checkpoint
        loop.steps(2)
        final_a = params(a)
        mgr.close()

        b = make_state(5, rank=rank, world_size=world, ddp=True)
        mgr = CheckpointManager(Path(root), b, rank=rank, world_size=world, run_id="r2")
        assert mgr.load() == 3
        Loop(b).steps(4)
        for name, tensor in params(b).items():
            assert torch.equal(tensor, final_a[name]), (rank, name)
        assert b.sampler.state_dict() == a.sampler.state_dict()
        mgr.close()
    finally:
        dist.destroy_process_group()


def spawn(fn, *args: object) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn(rank, *args)`` on 2 spawned ranks (they import this module: put the repo on the path)."""
    repo = str(Path(__file__).resolve().parents[3])
    sys.path.insert(0, repo)  # the children get the parent's sys.path (pytest's importlib mode lacks it)
    try:
        mp.spawn(fn, args=args, nprocs=2, join=True)
    finally:
        sys.path.remove(repo)


def test_two_ranks_save_and_resume_bitwise(tmp_path: Path) -> None:
    spawn(_two_rank_worker, 2, _free_port(), str(tmp_path))
    manifest = read_manifest(tmp_path / "step-000000003")
    assert manifest is not None and manifest["world_size"] == 2
    assert set(manifest["ranks"]) == {"0", "1"}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
    assert validate(tmp_path / "step-000000003").ok
