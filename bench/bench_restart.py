"""Restart phases per interruption: the README example (docs/examples/train_tiny.py) on 4
gloo ranks under `trainguard launch`, supervised through a real local broker and
processor, with one fault per run (SIGKILL, a hang in the step, a straggler evicted at
the next checkpoint, an SDC self-check mismatch rolled back to the clean ancestor).

    .venv/bin/python bench/bench_restart.py [--workdir .trainguard/bench-restart] [--steps 220]

For each interruption, the launcher's record (`<checkpoint-dir>/.trainguard/restarts.jsonl`):
detect (fault to the launcher noticing), reschedule (teardown, decision wait, placement,
up to the spawn), process start (spawn to the slowest rank's process start), process-group
init and checkpoint load (slowest rank), first step (the slowest rank's first step after
its setup: imports, model, DDP, the first step's own collectives) and restart_s (fault to
the last rank's first step: the seed's R). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from trainguard.devtools.stack import local_stack

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
POLICY = ROOT / "tests" / "producers" / "supervised_policy.yaml"
FAULTS = {
    "SIGKILL of rank 3": "kill:3:57:0",
    "rank 1 hung in its step": "hang:1:64:0",
    "rank 2 slowed (evicted)": "slow:2:20:0",
    "rank 1's gradient bit flips (rollback)": "flip:1:100:0",
}
PHASES = ("detect_s", "reschedule_s", "process_start_s", "pg_init_s", "checkpoint_load_s", "first_step_s")


def launch(bootstrap: str, workdir: Path, fault: str, steps: int, secret: str) -> list[dict[str, object]]:
    ckpt = workdir / "ckpt"
    env = {
        **os.environ,
        "TRAINGUARD_SECRET": secret,
        "OMP_NUM_THREADS": "1",
        "TRAINGUARD_EXAMPLE_FAULT": fault,
    }
    env |= {"TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "10"}
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", f"bench-{uuid.uuid4().hex[:8]}", "--checkpoint-dir", str(ckpt), "--bootstrap", bootstrap,
        "--max-restarts", "2", "--decision-wait-s", "2", "--grace-s", "5", "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{fault}: launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = (ckpt / ".trainguard" / "restarts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-restart"))
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--metrics-port", type=int, default=9467)
    args = parser.parse_args()
    secret = uuid.uuid4().hex * 2
    rows = []
    with local_stack(args.workdir, POLICY, args.metrics_port, {"TRAINGUARD_SECRET": secret}) as stack:
        for name, fault in FAULTS.items():
            for rec in launch(
                stack.bootstrap, args.workdir / uuid.uuid4().hex[:8], fault, args.steps, secret
            ):
                rows.append((name, rec))
    print(
        "| fault | cause | resumed from | "
        + " | ".join(p.removesuffix("_s") for p in PHASES)
        + " | restart_s |"
    )
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: |")
    for name, rec in rows:
        phases = " | ".join(cell(rec.get(p)) for p in (*PHASES, "restart_s"))
        print(f"| {name} | {rec['cause']} | {rec['resumed_from_step']} | {phases} |")


if __name__ == "__main__":
    main()
