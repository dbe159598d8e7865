"""Host agents on this one machine, for the multi-host tests: each a `trainguard launch`
with torchrun's flags and its own --node-name, a process tree of its own; the README's
example (docs/examples/train_tiny.py, with dropout and AdamW) as the training script."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"


def environment(steps: int, **extra: str) -> dict[str, str]:
    """The example's settings; trainguard's own (broker, secret, faults) only as `extra`
    gives them: the suite's broker must not reach an offline run's ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "10"}
    env["TRAIN_MODEL"] = "dropout-adamw"  # the masks come from each rank's RNG: restored too
    env["TRAINGUARD_CHECKPOINT_KEEP"] = "1000"  # the tests read back the checkpoints resumed from
    unset = ("TRAINGUARD_EXAMPLE_FAULT", "TRAINGUARD_INJECT_WRONG_DEVICE", "TRAINGUARD_LAUNCHER_FAULT")
    for name in (*unset, "TRAINGUARD_BOOTSTRAP", "TRAINGUARD_TOPIC_PREFIX", "TRAINGUARD_SECRET_FILE"):
        env.pop(name, None)
    return env | extra


def agent(
    node: str,
    endpoint: str,
    ckpt: Path | str,
    workdir: Path,
    env: dict[str, str],
    nnodes: str = "3:3",
    rdzv_id: str = "multihost-test",
    log: str = "",
    extra: Sequence[str] = ("--offline",),
) -> subprocess.Popen[str]:
    """One host's agent, with torchrun's flags and the example in torchrun's form."""
    command = [
        sys.executable, "-m", "trainguard", "launch",
        "--nnodes", nnodes, "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
        "--local-addr", "127.0.0.1", "--node-name", node,
        "--checkpoint-dir", str(ckpt), "--max-restarts", "2", "--decision-wait-s", "1", *extra,
        str(EXAMPLE),
    ]  # fmt: skip
    out = (workdir / f"{log or node}.log").open("w")
    return subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True)


def clean_run(workdir: Path, nproc: int, steps: int, run_id: str) -> Path:
    """An uninterrupted offline run of the example on one host (2 ranks per modelled
    node): the weights a faulted run of the same world must end with. Its checkpoint
    directory (the final weights are under its .trainguard/)."""
    done = subprocess.run(
        [sys.executable, "-m", "trainguard", "launch", "--offline", "--nproc", str(nproc),
         "--ranks-per-node", "2", "--run-id", run_id, "--checkpoint-dir", str(workdir / "ckpt"),
         str(EXAMPLE)],
        env=environment(steps), cwd=workdir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return workdir / "ckpt"


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """The whole host gone: its agent and every rank it started (they run in sessions of
    their own), at once."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(30)


def journal(ckpt: Path, node: str) -> list[dict[str, Any]]:
    path = ckpt / ".trainguard" / "hosts" / node / "launcher.actions.jsonl"
    return [json.loads(line) for line in path.open()] if path.exists() else []


def attempted(ckpt: Path, node: str) -> bool:
    """`node`'s agent journaled an attempt: it is in a world."""
    path = ckpt / ".trainguard" / "hosts" / node / "launcher.actions.jsonl"
    return path.exists() and '"op":"attempt"' in path.read_text()


def log_tail(workdir: Path, node: str) -> str:
    return (workdir / f"{node}.log").read_text()[-3000:]
