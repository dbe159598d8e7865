"""The validator: corrupt checkpoints are rejected with a reason and never resumed from."""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.producers.checkpoint import manager as manager_module
from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.checkpoint.validate import (
    MANIFEST,
    REJECTED,
    VALIDATED,
    NormBand,
    model_norms,
    validate,
)

from .checkpoint_fixtures import Loop, Recorder, make_state, params

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _norms(scale: float = 1.0) -> dict[str, tuple[float, int]]:
    return {"w": (10.0 * scale, 100), "b": (0.0 * scale, 10)}


def test_norm_band_passes_drift_and_rejects_a_100x_jump() -> None:
    band = NormBand()
    assert band.check(_norms()) is None  # no history: only finiteness
    band.add(_norms())
    band.add({"w": (12.0, 100), "b": (0.05, 10)})
    assert band.check({"w": (15.0, 100), "b": (0.2, 10)}) is None  # drift, a zero bias starts moving
    reason = band.check({"w": (1200.0, 100), "b": (0.05, 10)})
    assert reason is not None and "parameter w" in reason and "jumped" in reason
    assert "not finite" in (band.check({"w": (float("nan"), 100)}) or "")
    assert "collapsed" in (band.check({"w": (0.0, 100)}) or "")


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


Corruption = Callable[[Path], None]


def _missing_shard(d: Path) -> None:
    (d / "__0_0.distcp").unlink()


def _flipped_byte(d: Path) -> None:
    _flip_byte(d / "__0_0.distcp")


CASES: dict[str, tuple[Corruption | None, float, str]] = {
    # name: (what happens to the files after the commit, scale of the weights, reason)
    "missing shard": (_missing_shard, 1.0, "missing shard __0_0.distcp"),
    "flipped byte": (_flipped_byte, 1.0, "digest mismatch in shard __0_0.distcp"),
    "norm jumped 100x": (None, 100.0, "jumped out of band"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_checkpoint_is_rejected_and_never_resumed(tmp_path: Path, case: str) -> None:
    corrupt, scale, expected = CASES[case]

    def after_commit(step: int, directory: CheckpointStore) -> None:
        if step == 20 and corrupt is not None:
            corrupt(directory.local_dir)  # between the commit and the validation: what a dying rank leaves

    rec = Recorder()
    a = make_state(0)
    loop = Loop(a)
    loop.steps(3)
    mgr = CheckpointManager(
        tmp_path, a, rank=0, world_size=1, run_id="r", reporter=rec, on_committed=after_commit
    )
    mgr.save(10)
    mgr.wait_validated()
    good = params(a)
    loop.steps(2)
    with torch.no_grad():
        for p in a.model.parameters():
            p.mul_(scale)
    mgr.save(20)
    mgr.wait_validated()

    assert mgr.validated_steps() == [10]
    result = mgr.results[20]
    assert not result.ok and expected in result.reason
    d = tmp_path / "step-000000020"
    assert (d / MANIFEST).exists() and not (d / VALIDATED).exists()
    assert expected in json.loads((d / REJECTED).read_text())["reason"]
    assert rec.steps("validated") == [10]
    assert any(expected in r for r in rec.reasons(20))  # reported with its reason

    b = make_state(1)
    mgr_b = CheckpointManager(tmp_path, b, rank=0, world_size=1, run_id="r")
    assert mgr_b.load() == 10  # falls back to the previous validated one
    for name, tensor in params(b).items():
        assert torch.equal(tensor, good[name])
    assert mgr_b.load(20) == 10  # named explicitly, a rejected one is still never resumed
    for name, tensor in params(b).items():
        assert torch.equal(tensor, good[name])
    mgr_b.close()
    mgr.close()


def test_corruption_after_validation_is_caught_at_resume(tmp_path: Path) -> None:
    rec = Recorder()
    a = make_state(0)
    loop = Loop(a)
    with CheckpointManager(tmp_path, a, rank=0, world_size=1, run_id="r", reporter=rec) as mgr:
        for step in (1, 2):
            loop.steps(1)
            mgr.save(step)
        mgr.wait_validated()
        assert mgr.validated_steps() == [1, 2]
    _flip_byte(tmp_path / "step-000000002" / "__0_0.distcp")  # bit rot on storage
    with CheckpointManager(tmp_path, make_state(1), rank=0, world_size=1, run_id="r", reporter=rec) as mgr:
        assert mgr.load() == 1
        assert mgr.validated_steps() == [1]  # now marked REJECTED
    assert any("re-verification" in r and "digest mismatch" in r for r in rec.reasons(2))


def test_validate_without_manifest_and_with_garbage_metadata(tmp_path: Path) -> None:
    a = make_state(0)
    Loop(a).steps(1)
    with CheckpointManager(tmp_path, a, rank=0, world_size=1, run_id="r") as mgr:
        mgr.save(1)
        mgr.wait_validated()
    d = tmp_path / "step-000000001"
    assert validate(d).ok
    # a consistent manifest over an undecodable shard: only the test load can tell
    shard = d / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    manifest = json.loads((d / MANIFEST).read_text())
    from trainguard.producers.checkpoint.validate import atomic_write_json, file_digest

    manifest["files"]["__0_0.distcp"]["sha256"] = file_digest(shard)[0]
    atomic_write_json(d / MANIFEST, manifest)
    result = validate(d)
    assert not result.ok and result.reason.startswith("test load failed")
    (d / MANIFEST).unlink()
    assert "no readable manifest" in validate(d).reason


def test_manifest_norms_match_the_stored_weights(tmp_path: Path) -> None:
    a = make_state(0)
    Loop(a).steps(2)
    with CheckpointManager(tmp_path, a, rank=0, world_size=1, run_id="r") as mgr:
        mgr.save(2)
        mgr.wait_validated()
        stored = mgr.results[2].norms
    manifest = json.loads((tmp_path / "step-000000002" / MANIFEST).read_text())
    expected = model_norms({"model": a.model.state_dict()})
    assert set(manifest["param_norms"]) == set(stored) == set(expected)
    for name, (norm, numel) in expected.items():
        assert manifest["param_norms"][name] == pytest.approx([norm, numel])
        assert stored[name] == pytest.approx((norm, numel))


@pytest.mark.parametrize("failures", [2, 100], ids=["transient", "lasting"])
def test_a_storage_error_while_validating_is_retried_and_never_rejects(
    monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """The store fails to serve the manifest (EIO: an object store's 503, a timeout) while
    a good checkpoint is validated: the manager validates again and the checkpoint is
    VALIDATED; while the store keeps failing, it stays unvalidated, and is never REJECTED."""
    root = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    fs_class = type(CheckpointStore(root).fs)
    real_cat = fs_class.cat_file
    left = [failures]

    def flaky(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(MANIFEST) and left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EIO, "503 Slow Down")
        return real_cat(self, path, *args, **kwargs)

    monkeypatch.setattr(fs_class, "cat_file", flaky)
    monkeypatch.setattr(manager_module, "VALIDATE_RETRY_S", (0.01, 0.01, 0.01))
    rec = Recorder()
    with CheckpointManager(root, make_state(0), rank=0, world_size=1, run_id="r", reporter=rec) as mgr:
        Loop(mgr.state).steps(3)
        mgr.save(3)
        mgr.wait_validated()
        assert mgr.validated_steps() == ([3] if failures == 2 else [])
        assert not mgr.step_dir(3).exists(REJECTED)
        assert mgr.results[3].storage_error == (failures != 2), mgr.results[3]
