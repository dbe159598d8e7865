"""Issue 44: a model with BatchNorm resumes bitwise from storage, with trainguard's defaults.

A small CNN with two BatchNorm2d layers, Adam and StepLR (tests/producers/batchnorm_job.py),
2 gloo ranks under ``trainguard launch --offline``, the framework's callback or the
Supervisor with no cadence argument: offline no processor ever sends an interval, so the
run's own cadence (the prior MTBF and the measured checkpoint cost) must checkpoint. Rank 1
is SIGKILLed mid-run, once a checkpoint is validated; the run resumes from it (not from
step 0), and every rank's final model (the BatchNorm running statistics included),
optimizer and scheduler state are bitwise those of an uninterrupted run, through
Lightning, the Hugging Face Trainer and a hand-written DDP loop.

DDP broadcasts rank 0's buffers at every forward, so rank 0's are the job's: the checkpoint
must hold rank 0's copy (DCP's deduplication alone stores an arbitrary rank's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from .supervised_runs import progress

JOB = Path(__file__).with_name("batchnorm_job.py")
KILL_AT = 30  # rank 1's step, once a checkpoint is validated
NEEDS = {"lightning": "pytorch_lightning", "hf": "transformers", "hand": "torch"}


def launch(framework: str, workdir: Path, kill: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_id = f"bn-{framework}-{uuid.uuid4().hex[:6]}"
    ckpt = workdir / "ckpt"
    workdir.mkdir(parents=True)
    command = [
        sys.executable, "-m", "trainguard", "launch", "--offline", "--nproc", "2",
        "--run-id", run_id, "--checkpoint-dir", str(ckpt), "--max-restarts", "1",
        "--self-test", "off",  # no spare joins here: the suite's two cores train, not test spares
        "--", sys.executable, str(JOB), framework,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")} | {"OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        if kill:
            deadline = time.monotonic() + 240
            while p.poll() is None and time.monotonic() < deadline:
                if progress(ckpt, 1) >= KILL_AT and any(ckpt.glob("step-*/VALIDATED")):
                    os.kill(_pid(run_id, rank=1), signal.SIGKILL)
                    break
                time.sleep(0.02)
        out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(command, p.returncode, out, err), ckpt


def _pid(run_id: str, rank: int) -> int:
    want = {f"TRAINGUARD_RUN_ID={run_id}", f"RANK={rank}", "TRAINGUARD_ATTEMPT=0"}
    for entry in Path("/proc").iterdir():
        try:
            environ = set((entry / "environ").read_bytes().decode(errors="replace").split("\0"))
            if entry.name.isdigit() and want <= environ and JOB.name in (entry / "cmdline").read_text():
                return int(entry.name)
        except OSError:
            continue
    raise LookupError(f"no rank {rank} of {run_id}")


def final(ckpt: Path, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(ckpt / ".trainguard" / f"final-{rank}.pt", weights_only=False)
    return state


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested states differ (tensors bitwise, everything else by ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [path]


@pytest.mark.parametrize("framework", sorted(NEEDS))
def test_a_batchnorm_model_killed_mid_run_resumes_bitwise_with_the_defaults(
    framework: str, tmp_path: Path
) -> None:
    pytest.importorskip(NEEDS[framework])
    clean, clean_ckpt = launch(framework, tmp_path / "clean", kill=False)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    run, ckpt = launch(framework, tmp_path / "killed", kill=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    restarts = [json.loads(line) for line in (ckpt / ".trainguard" / "restarts.jsonl").open()]
    assert [(r["cause"], r["rank"]) for r in restarts] == [("crash", 1)]
    assert restarts[0]["resumed_from_step"] > 0, "offline with the defaults, a checkpoint must exist"
    assert f"resumed from step {restarts[0]['resumed_from_step']}, restart" in run.stdout + run.stderr
    assert "checkpoint every" in clean.stderr  # the derived interval, said once by rank 0
    for rank in (0, 1):
        expected, got = final(clean_ckpt, rank), final(ckpt, rank)
        assert any("running_mean" in key for key in got["model"])
        assert differences(expected, got) == [], f"rank {rank} diverged"
    manifests = [json.loads(m.read_text()) for m in ckpt.glob("step-*/MANIFEST.json")]
    assert manifests and {(m["buffers"], m["buffer_rank"]) for m in manifests} == {("rank0", 0)}
