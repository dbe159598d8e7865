"""R of plain torchrun + torch DCP on bench/restart_torchrun.py (issue 18), and the one
measure of R every variant of bench/bench_restart.py shares.

torch 2.15 with gloo: plain torchrun cannot restart at all unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set (pytorch#135712: the second attempt dies in
``init_process_group``, "Gloo connectFullMesh failed ... Connection refused", the
rendezvous store being shared across restarts). It is set here, and the side-by-side says so.

    .venv/bin/python bench/restart_compare.py [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("restart_torchrun.py")


def restart_seconds(events: list[dict[str, Any]]) -> float:
    """R by the training script's own clock: from the "kill" line to the last "first_step"
    of the attempt after it (the slowest rank's first completed step)."""
    (kill,) = [e for e in events if e["event"] == "kill"]
    after = [e["ts"] for e in events if e["event"] == "first_step" and e["attempt"] == kill["attempt"] + 1]
    if not after:
        raise ValueError("no rank completed a step after the kill")
    return float(max(after) - kill["ts"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(workdir: Path, steps: int, kill: str, nproc: int = 4) -> dict[str, Any]:
    """One plain torchrun run, rank ``kill`` = "rank:step" SIGKILLed: whether it ended 0,
    R, and the slowest rank's moments after the kill (seconds from it)."""
    workdir = workdir.resolve()  # torchrun runs in it: its files' paths must not be relative
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    events = workdir / "events.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env |= {"TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "20", "TRAIN_KILL": kill}
    env |= {"TRAIN_EVENTS_FILE": str(events), "CKPT_DIR": str(workdir / "ckpt")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--rdzv-id", uuid.uuid4().hex[:8], str(SCRIPT),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    result: dict[str, Any] = {"ok": done.returncode == 0, "returncode": done.returncode}
    if not result["ok"]:
        result["stderr"] = done.stderr[-3000:]
        return result
    result["R"] = restart_seconds(lines)
    (kill_event,) = [e for e in lines if e["event"] == "kill"]
    attempt = kill_event["attempt"] + 1
    for moment in ("start", "imported", "pg_init", "model_built", "restored", "first_step"):
        ts = [e["ts"] for e in lines if e["event"] == moment and e["attempt"] == attempt]
        result[moment] = max(ts) - kill_event["ts"] if ts else None
    resumed = [e["step"] for e in lines if e["event"] == "restored" and e["attempt"] == attempt]
    result["resumed_from_step"] = resumed[0] if resumed else None
    return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-torchrun"))
    args = parser.parse_args()
    values = []
    for i in range(args.runs):
        result = run_torchrun(args.workdir / f"run-{i}", args.steps, "1:137")
        print(json.dumps(result))
        if result["ok"]:
            values.append(result["R"])
    if values:
        print(f"R median {statistics.median(values):.2f} s over {len(values)} runs")


if __name__ == "__main__":
    main()
