"""Checkpoint housekeeping end to end (issue 44's acceptance point): `trainguard launch
--offline` (no processor) of the README's example (docs/examples/train_tiny.py) on two
gloo ranks, checkpointing every step to a bucket on a local S3 endpoint
(tests/producers/s3_server.py). After 30 saves the bucket holds retention's default
number of validated checkpoints and nothing else. The newest one then gets a byte flipped
in a shard; relaunched, the ranks refuse it with its reason on the console and resume
from the one before it; the run saves that step again, and its REJECTED marker gives way
to the new save's VALIDATED one, with no DCP "overwriting" warning on the console."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from trainguard.producers.checkpoint.catalog import MANIFEST, REJECTED, VALIDATED
from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.launcher.checkpoints import validated_steps
from trainguard.producers.training.config import DEFAULT_CHECKPOINT_KEEP, ENV_CHECKPOINT_KEEP

from .s3_server import S3

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"


def launch(workdir: Path, ckpt: str, steps: int) -> subprocess.CompletedProcess[str]:
    """One offline launch on 2 ranks saving after every step; its console is stdout + stderr
    (the ranks' stderr is teed there)."""
    workdir.mkdir(parents=True)
    env = {**os.environ, "TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "1", "OMP_NUM_THREADS": "1"}
    for inherited in ("TRAINGUARD_EXAMPLE_FAULT", "TRAINGUARD_HOME", "TRAINGUARD_STATE_DIR"):
        env.pop(inherited, None)
    env.pop(ENV_CHECKPOINT_KEEP, None)  # the default retention, as a user gets it
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "2", "--run-id", "housekeeping",
        "--checkpoint-dir", ckpt, "--offline", "--max-restarts", "0", "--decision-wait-s", "0.5",
        "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    return subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=300)


def steps_in(ckpt: str) -> list[str]:
    return CheckpointStore(ckpt).names()


def test_offline_retention_in_a_bucket_and_a_corrupted_newest_refused_with_its_reason(
    tmp_path: Path, s3: S3
) -> None:
    ckpt = f"{s3.bucket()}/housekeeping"
    first = launch(tmp_path / "first", ckpt, steps=30)  # steps 0..29, a save after each
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    kept = list(range(30 - DEFAULT_CHECKPOINT_KEEP, 30))
    assert steps_in(ckpt) == [f"step-{s:09d}" for s in kept]  # 25 older ones deleted
    assert sorted(validated_steps(ckpt)) == kept
    store = CheckpointStore(ckpt)
    assert all({MANIFEST, VALIDATED} <= set(store.names(f"step-{s:09d}")) for s in kept)

    bucket = fsspec.filesystem("s3")
    shard = store.child("step-000000029").path("__1_0.distcp")
    data = bytearray(bucket.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # bit rot in the newest checkpoint
    bucket.pipe_file(shard, bytes(data))

    again = launch(tmp_path / "again", ckpt, steps=30)  # the launcher names 29, the newest
    console = again.stdout + again.stderr
    assert again.returncode == 0, console[-6000:]
    assert (
        "checkpoint steps [29] rejected before resume (asked for 29): step 29: re-verification "
        "before resume failed: digest mismatch in shard __1_0.distcp"
    ) in console, console[-6000:]
    assert "; resuming from step 28" in console
    assert "Detected an existing checkpoint" not in console  # step 29 was saved again, on purpose
    # Step 29 was trained again and saved: the new save's validation superseded the rejection.
    marker = store.read_json("step-000000029", VALIDATED)
    assert marker is not None and "digest mismatch in shard __1_0.distcp" in marker["replaces_rejection"]
    assert REJECTED not in store.names("step-000000029")
    assert steps_in(ckpt) == [f"step-{s:09d}" for s in kept]
    assert sorted(validated_steps(ckpt)) == kept
