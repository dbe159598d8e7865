"""The checkpoint manager on every kind of location (storage.py): a local directory,
fsspec's memory:// (no rename, no directories) and an S3 endpoint (s3_server.py). Saved,
committed, validated, retained, resumed bitwise; bit rot found at resume and marked so that
the launcher, reading the same location, never chooses it again. Assertions go through the
store only, so they hold for each kind alike."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.checkpoint.validate import MANIFEST, REJECTED, VALIDATED
from trainguard.producers.launcher.checkpoints import rejected_steps, validated_steps

from .checkpoint_fixtures import Loop, Recorder, make_state, params

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["local", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    return f"{request.getfixturevalue('s3').bucket()}/runs/r"


def manager(root: str, seed: int, **kw) -> CheckpointManager:  # type: ignore[no-untyped-def]
    return CheckpointManager(root, make_state(seed), rank=0, world_size=1, run_id="r", **kw)


def test_saved_validated_retained_and_resumed_bitwise(root: str) -> None:
    rec = Recorder()
    with manager(root, 0, reporter=rec, keep=2) as mgr:
        loop = Loop(mgr.state)
        for step in (3, 6, 9):
            loop.steps(3)
            mgr.save(step)
        mgr.wait_validated()
        assert mgr.validated_steps() == [6, 9]
        saved = params(mgr.state)
    store = CheckpointStore(root)
    assert store.names() == ["step-000000006", "step-000000009"]  # retention removed step 3
    assert {MANIFEST, VALIDATED, ".metadata", "__0_0.distcp"} == set(store.child("step-000000009").names())
    assert rec.steps("validated") == [3, 6, 9]
    assert [args[1] for kind, args in rec.calls if kind == "validated"][-1] == str(
        store.child("step-000000009")
    )
    assert sorted(validated_steps(root)) == [6, 9]  # the launcher's view of the same location

    with manager(root, 1) as fresh:
        assert fresh.load() == 9
        assert all(torch.equal(tensor, saved[name]) for name, tensor in params(fresh.state).items())


def test_bit_rot_is_caught_at_resume_and_never_chosen_again(root: str) -> None:
    rec = Recorder()
    with manager(root, 0, reporter=rec) as mgr:
        loop = Loop(mgr.state)
        loop.steps(2)
        mgr.save(1)
        mgr.wait_validated()
        good = params(mgr.state)
        loop.steps(2)
        mgr.save(2)
        mgr.wait_validated()
    shard = CheckpointStore(root).child("step-000000002")
    data = bytearray(shard.fs.cat_file(shard.path("__0_0.distcp")))
    data[len(data) // 2] ^= 0x01  # one flipped bit in the stored object
    shard.fs.pipe_file(shard.path("__0_0.distcp"), bytes(data))

    with manager(root, 1, reporter=rec) as fresh:
        assert fresh.load() == 1
        assert all(torch.equal(tensor, good[name]) for name, tensor in params(fresh.state).items())
    assert shard.exists(REJECTED) and "digest mismatch" in (shard.read_json(REJECTED) or {})["reason"]
    assert sorted(validated_steps(root)) == [1]
    assert "digest mismatch" in rejected_steps(root)[2]
    assert any("re-verification" in reason for reason in rec.reasons(2))
