"""What the fork server saves (issue 48): the same job under ``trainguard launch`` with its
default (ranks forked from a server that imported torch and trainguard's rank side) and
with ``--preload none`` (a new interpreter per rank, as torchrun starts them), alternately,
in one run.

The README example on 4 gloo ranks, offline, rank 1 SIGKILLed before step ``--kill-step``
of the first attempt, so each run starts its ranks twice. Per run: R (the script's own
clock, from rank 1's "kill" line to the last rank's first step after it, as
bench/bench_restart.py measures it), the restart's import phase from the launcher's
record, the wall time of the whole launch, and the CPU seconds of the launcher's whole
process tree (every process polled with psutil; a process's last reading counts).

    .venv/bin/python bench/bench_fork_server.py [--runs 3] [--workdir .trainguard/bench-fork]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
from restart_compare import restart_seconds

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
NEW = "new interpreters (--preload none)"  # the baseline: as torchrun starts ranks
VARIANTS = {"fork server (the default)": [], NEW: ["--preload", "none"]}


def launch(workdir: Path, steps: int, kill_step: int, flags: list[str]) -> dict[str, float]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    ckpt, events = workdir / "ckpt", workdir / "events.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "20"}
    env |= {"TRAIN_MODEL": "dropout-adamw", "TRAIN_EVENTS_FILE": str(events)}
    env |= {"TRAINGUARD_EXAMPLE_FAULT": f"kill:1:{kill_step}:0"}
    env.pop("TRAINGUARD_PRELOAD", None)
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", f"bench-{uuid.uuid4().hex[:8]}", "--checkpoint-dir", str(ckpt), "--offline",
        "--max-restarts", "1", *flags, "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cpu: dict[int, float] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                times = p.cpu_times()
                cpu[p.pid] = times.user + times.system
            except psutil.Error:
                pass
        time.sleep(0.05)
    wall = time.monotonic() - started
    if proc.wait() != 0:
        raise SystemExit(
            f"launch {flags} failed: {proc.stderr.read().decode()[-3000:] if proc.stderr else ''}"
        )
    (record,) = [json.loads(x) for x in (ckpt / ".trainguard" / "restarts.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    return {"R": restart_seconds(lines), "import": float(record.get("import_s") or 0.0),
            "wall": wall, "cpu": sum(cpu.values())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-step", type=int, default=97)
    parser.add_argument("--workdir", type=Path, default=ROOT / ".trainguard" / "bench-fork")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for i in range(args.runs):
        for v, (name, flags) in enumerate(VARIANTS.items()):  # alternated: load drifts hit both
            runs[name].append(launch(args.workdir / f"run-{i}-{v}", args.steps, args.kill_step, flags))
            print(f"run {i} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    base = {k: statistics.median(r[k] for r in runs[NEW]) for k in ("R", "cpu")}
    head = ["variant", "R per run (s)", "R median (s)", "restart import (s)", "launch wall (s)"]
    print("| " + " | ".join([*head, "CPU-s per run", "CPU-s median", "CPU / new interpreters"]) + " |")
    print("| --- | --- | ---: | --- | --- | --- | ---: | ---: |")
    for name, results in runs.items():
        r = statistics.median(x["R"] for x in results)
        c = statistics.median(x["cpu"] for x in results)
        cells = [", ".join(f"{x[k]:.2f}" for x in results) for k in ("R", "import", "wall", "cpu")]
        row = [name, cells[0], f"{r:.2f}", *cells[1:], f"{c:.1f}", f"{c / base['cpu']:.2f}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
