"""The README's worked example (docs/examples/train_tiny.py) under `trainguard launch`, on
real gloo ranks: it trains, checkpoints and validates; killed with SIGKILL it resumes from
the newest validated checkpoint and ends with the weights of an uninterrupted run.

The killed run keeps its checkpoints on an object store (a local S3 endpoint,
tests/producers/s3_server.py) through torch DCP's fsspec writer and reader, the clean one
in a directory: the same weights either way, bitwise.

Offline (no broker): the launcher restarts on its own. Four ranks, two per modelled node:
with more than two, bitwise resume needs the Supervisor's per-parameter gradient
all-reduce (DDP buckets the first iteration differently; grad_checks.per_parameter_allreduce)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from .s3_server import S3

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"


def launch(workdir: Path, fault: str | None = None, ckpt: str = "ckpt") -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True)
    env = {**os.environ, "TRAIN_STEPS": "30", "TRAIN_CHECKPOINT_EVERY": "5", "OMP_NUM_THREADS": "1"}
    env["TRAINGUARD_CHECKPOINT_KEEP"] = "1000"  # the test reads back the checkpoint resumed from
    for inherited in ("TRAINGUARD_EXAMPLE_FAULT", "TRAINGUARD_HOME", "TRAINGUARD_STATE_DIR"):
        env.pop(inherited, None)
    if fault:
        env["TRAINGUARD_EXAMPLE_FAULT"] = fault
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", "tiny",
        "--checkpoint-dir", str(ckpt), "--offline", "--max-restarts", "2", "--decision-wait-s", "0.5",
        "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    return subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=240)


def test_the_example_trains_checkpoints_and_resumes_bitwise_after_a_kill(tmp_path: Path, s3: S3) -> None:
    clean = launch(tmp_path / "clean")
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    clean_files = tmp_path / "clean" / "ckpt" / ".trainguard"  # the launcher's files beside them
    assert (tmp_path / "clean" / "ckpt" / "step-000000029" / "VALIDATED").exists()

    bucket = s3.bucket()
    killed = launch(tmp_path / "killed", fault="kill:3:17:0", ckpt=f"{bucket}/tiny")  # rank 3, step 17
    assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-2000:]
    # An object store holds no launcher files: they default to $TRAINGUARD_HOME/launch/RUN_ID.
    killed_files = tmp_path / "killed" / ".trainguard" / "launch" / "tiny"
    (restart,) = [json.loads(line) for line in (killed_files / "restarts.jsonl").open()]
    assert restart["signal"] == 9 and restart["rank"] == 3
    # From the newest checkpoint validated by then (how far validation got depends on the load).
    resumed = restart["resumed_from_step"]
    assert resumed in (-1, 4, 9, 14)
    bucket_fs = fsspec.filesystem("s3")
    assert resumed == -1 or bucket_fs.exists(f"{bucket}/tiny/step-{resumed:09d}/VALIDATED")
    listed = bucket_fs.ls(f"{bucket}/tiny/step-000000029", detail=False)
    assert {"MANIFEST.json", "VALIDATED", ".metadata"} <= {name.rsplit("/", 1)[-1] for name in listed}

    expected = torch.load(clean_files / "final.pt")
    resumed = torch.load(killed_files / "final.pt")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)  # no step lost or repeated
