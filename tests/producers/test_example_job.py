"""The README's worked example (docs/examples/train_tiny.py) under `trainguard launch`, on
real gloo ranks: it trains, checkpoints and validates; killed with SIGKILL it resumes from
the newest validated checkpoint and ends with the weights of an uninterrupted run.

Offline (no broker): the launcher restarts on its own. Four ranks, two per modelled node:
with more than two, bitwise resume needs the Supervisor's per-parameter gradient
all-reduce (DDP buckets the first iteration differently; grad_checks.per_parameter_allreduce)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"


def launch(workdir: Path, fault: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    workdir.mkdir(parents=True)
    ckpt = workdir / "ckpt"
    env = {**os.environ, "TRAIN_STEPS": "30", "TRAIN_CHECKPOINT_EVERY": "5", "OMP_NUM_THREADS": "1"}
    env.pop("TRAINGUARD_EXAMPLE_FAULT", None)
    if fault:
        env["TRAINGUARD_EXAMPLE_FAULT"] = fault
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", "tiny",
        "--checkpoint-dir", str(ckpt), "--offline", "--max-restarts", "2", "--decision-wait-s", "0.5",
        "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=240)
    return done, ckpt


def test_the_example_trains_checkpoints_and_resumes_bitwise_after_a_kill(tmp_path: Path) -> None:
    clean, clean_ckpt = launch(tmp_path / "clean")
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    assert (clean_ckpt / "step-000000029" / "VALIDATED").exists()

    killed, killed_ckpt = launch(tmp_path / "killed", fault="kill:3:17:0")  # rank 3, step 17, attempt 0
    assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-2000:]
    (restart,) = [json.loads(line) for line in (killed_ckpt / ".trainguard" / "restarts.jsonl").open()]
    assert restart["signal"] == 9 and restart["rank"] == 3
    # From the newest checkpoint validated by then (how far validation got depends on the load).
    resumed = restart["resumed_from_step"]
    assert resumed in (-1, 4, 9, 14)
    assert resumed == -1 or (killed_ckpt / f"step-{resumed:09d}" / "VALIDATED").exists()

    expected = torch.load(clean_ckpt / ".trainguard" / "final.pt")
    resumed = torch.load(killed_ckpt / ".trainguard" / "final.pt")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)  # no step lost or repeated
