"""A rejected checkpoint's reason (issue 44): on the console at the resume that rejects it,
and kept in its REJECTED marker when the run saves that step again, until the new save is
validated; the VALIDATED marker then supersedes it, and the ranks (catalog.py) and the
launcher (producers/launcher/checkpoints.py) both resume from the step again. And DCP's
"overwriting" warning, which every such re-save printed, is silenced for trainguard's own
step directories only."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainguard.producers.checkpoint.catalog import MANIFEST, REJECTED, VALIDATED, CheckpointCatalog
from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.launcher.checkpoints import rejected_steps, validated_steps

from .checkpoint_fixtures import Loop, make_state, params

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

OVERWRITING = "Detected an existing checkpoint in"


def manager(root: Path, **kw) -> CheckpointManager:  # type: ignore[no-untyped-def]
    return CheckpointManager(root, make_state(0), rank=0, world_size=1, run_id="r", keep=10, **kw)


def flip_mid_shard(directory: Path) -> None:
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def two_checkpoints_the_newest_rejected_at_resume(
    root: Path, caplog: pytest.LogCaptureFixture
) -> CheckpointManager:
    """Steps 1 and 2 saved; step 2's shard flipped; a fresh manager resumes from 1 (returned)."""
    with manager(root) as first:
        loop = Loop(first.state)
        for step in (1, 2):
            loop.steps(1)
            first.save(step)
            first.wait_validated()
    flip_mid_shard(root / "step-000000002")
    fresh = manager(root)
    with caplog.at_level(logging.WARNING):
        assert fresh.load() == 1
    return fresh


def test_the_resume_names_each_rejected_steps_reason_on_the_console(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with two_checkpoints_the_newest_rejected_at_resume(tmp_path, caplog):
        pass
    (line,) = [r.getMessage() for r in caplog.records if "rejected before resume" in r.getMessage()]
    assert line.startswith("checkpoint steps [2] rejected before resume (asked for None): step 2: ")
    assert "re-verification before resume failed: digest mismatch in shard __0_0.distcp" in line
    assert line.endswith("; resuming from step 1")


def test_a_re_saved_rejected_step_keeps_its_reason_until_the_new_save_is_validated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    step_dir = tmp_path / "step-000000002"
    seen: dict[str, Any] = {}

    def committed(step: int, directory: CheckpointStore) -> None:
        """Rank 0, after the new manifest and before the validation: what a reader sees."""
        names = set(directory.names())
        seen["names"] = names
        seen["ranks"] = CheckpointCatalog(tmp_path).validated_steps()
        seen["launcher"] = sorted(validated_steps(tmp_path))
        seen["rejected"] = rejected_steps(tmp_path).get(step, "")

    with two_checkpoints_the_newest_rejected_at_resume(tmp_path, caplog) as mgr:
        reason = rejected_steps(tmp_path)[2]
        assert "digest mismatch" in reason
        mgr.on_committed = committed
        Loop(mgr.state).steps(1)
        mgr.save(2)
        mgr.wait_validated()
        saved = params(mgr.state)
    # Between the commit and the validation: the new manifest, the old REJECTED, no VALIDATED.
    assert {MANIFEST, REJECTED} <= seen["names"] and VALIDATED not in seen["names"]
    assert seen["ranks"] == [1] and seen["launcher"] == [1] and seen["rejected"] == reason
    # Validated: the marker supersedes the rejection, whose reason it keeps.
    names = {p.name for p in step_dir.iterdir()}
    assert VALIDATED in names and REJECTED not in names
    marker = CheckpointStore(str(step_dir)).read_json(VALIDATED)
    assert marker is not None and marker["replaces_rejection"] == reason
    assert CheckpointCatalog(tmp_path).validated_steps() == [1, 2]
    assert sorted(validated_steps(tmp_path)) == [1, 2] and rejected_steps(tmp_path) == {}
    with manager(tmp_path) as again:  # resumable again, with the new save's weights
        assert again.load() == 2
        assert all(torch.equal(t, saved[name]) for name, t in params(again.state).items())


def test_a_re_save_that_fails_validation_is_rejected_with_its_own_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def corrupt(step: int, directory: CheckpointStore) -> None:  # after the commit: bit rot
        (Path(directory.root) / "__0_0.distcp").unlink()

    with two_checkpoints_the_newest_rejected_at_resume(tmp_path, caplog) as mgr:
        mgr.on_committed = corrupt
        mgr.save(2)
        mgr.wait_validated()
    assert "missing shard __0_0.distcp" in rejected_steps(tmp_path)[2]
    assert CheckpointCatalog(tmp_path).validated_steps() == [1] and sorted(validated_steps(tmp_path)) == [1]


def test_dcp_overwrite_warning_is_silenced_for_trainguard_step_directories_only(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with manager(root) as mgr:  # its filter goes in front of "always"
            loop = Loop(mgr.state)
            for _ in range(2):  # the second save of step 3 overwrites the first, on purpose
                loop.steps(1)
                mgr.save(3)
                mgr.wait_validated()
            assert mgr.validated_steps() == [3]
        for elsewhere in (tmp_path / "mine", tmp_path / "ckpt-other" / "step-000000003"):
            for _ in range(2):  # someone else's DCP saves in the same process still warn
                writer = dcp.FileSystemWriter(str(elsewhere), overwrite=True)
                dcp.save({"w": torch.zeros(2)}, storage_writer=writer, no_dist=True)
    warned = [str(w.message) for w in seen if OVERWRITING in str(w.message)]
    assert [m.split(",")[0] for m in warned] == [
        f"{OVERWRITING} {tmp_path / 'mine'}",
        f"{OVERWRITING} {tmp_path / 'ckpt-other' / 'step-000000003'}",
    ]
