"""Elastic training on one host (issue 45): what a lost rank costs with no spare left.

The same 4-rank gloo job loses rank 2 (SIGKILL at ``--kill-step``), with no warm spare,
run alternately under

- plain ``torchrun --max-restarts 1`` with torch DCP (bench/restart_torchrun.py: every
  worker restarted, the script resumes from its newest complete checkpoint);
- ``trainguard launch --restart in-process``, no spare: the survivors stay in their
  processes and wait for a new process to take rank 2 ("wait");
- ``trainguard launch --min-nproc 2`` (elastic, docs/examples/train_elastic.py): the
  survivors go on at world 3 at once ("shrink"), and the world grows back to 4 at the next
  checkpoint boundary once the new process is ready;

trainguard's supervised through a real local broker and processor, with its defaults.
Measured by the scripts' own clocks (TRAIN_EVENTS_FILE): R, from the "kill" line to the
slowest rank's first step after it (for "shrink": at world 3); for "shrink" also the grow's
R (the launcher's record: the boundary to the first step at world 4) and how long the
world ran at 3: until the first checkpoint boundary after the new process is ready (a
checkpoint every 100 steps).

    .venv/bin/python bench/bench_elastic.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from restart_compare import restart_seconds, run_torchrun

from harness.devtools.stack import local_stack

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "train_elastic.py"
POLICY = ROOT / "tests" / "producers" / "supervised_policy.yaml"


def launch(
    args: argparse.Namespace, bootstrap: str, workdir: Path, secret: str, flags: list[str]
) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    ckpt, events = workdir / "ckpt", workdir / "events.jsonl"
    env = {**os.environ, "TRAINGUARD_SECRET": secret, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(args.steps), "TRAIN_CHECKPOINT_EVERY": "100", "TRAIN_EVENTS_FILE": str(events)}
    env |= {"TRAIN_KILL": f"2:{args.kill_step}:0"}
    env.pop("TRAINGUARD_SECRET_FILE", None)
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "1",
        "--run-id", f"bench-{uuid.uuid4().hex[:8]}", "--checkpoint-dir", str(ckpt), "--bootstrap", bootstrap,
        "--max-restarts", "3", *flags, "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"trainguard {flags}: launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    records = [
        json.loads(line) for line in (ckpt / ".trainguard" / "restarts.jsonl").read_text().splitlines()
    ]
    out: dict[str, Any] = {"R": restart_seconds(lines), "world": records[0].get("world_size")}
    grows = [r for r in records if r["cause"] == "resize"]
    if grows:
        (kill,) = [e for e in lines if e["event"] == "kill"]
        small = [e["ts"] for e in lines if e["event"] == "first_step" and e["attempt"] == kill["attempt"] + 1]
        out["grow_R"] = grows[0]["restart_s"]
        out["small_s"] = grows[0]["detected_ts"] - max(small)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-step", type=int, default=137)
    parser.add_argument("--metrics-port", type=int, default=9468)
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-elastic"))
    args = parser.parse_args()
    secret = uuid.uuid4().hex * 2
    variants: dict[str, list[str] | None] = {
        "torchrun + DCP (every worker restarted)": None,
        "trainguard in-process, no spare (wait for a new process)": ["--restart", "in-process"],
        "trainguard elastic, --min-nproc 2 (shrink to 3, grow back)": ["--min-nproc", "2"],
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with local_stack(args.workdir, POLICY, args.metrics_port, {"TRAINGUARD_SECRET": secret}) as stack:
        for i in range(args.runs):
            for v, (name, flags) in enumerate(variants.items()):  # alternated: load drifts hit all alike
                workdir = (args.workdir / f"run-{i}-variant-{v}").resolve()
                if flags is None:
                    result = run_torchrun(workdir, args.steps, f"2:{args.kill_step}")
                    if not result.get("ok"):
                        raise SystemExit(f"torchrun run {i} failed: {result}")
                else:
                    result = launch(args, stack.bootstrap, workdir, secret, flags)
                runs[name].append(result)
                print(
                    f"run {i} {name}: {json.dumps({k: result.get(k) for k in ('R', 'grow_R')})}",
                    file=sys.stderr,
                )
    base = statistics.median(float(r["R"]) for r in runs["torchrun + DCP (every worker restarted)"])
    print("| variant | R per run (s) | median R (s) | / torchrun | grow R (s) | at world 3 (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, results in runs.items():
        values = [float(r["R"]) for r in results]
        median = statistics.median(values)
        grow = [float(r["grow_R"]) for r in results if "grow_R" in r]
        small = [float(r["small_s"]) for r in results if "small_s" in r]
        cells = [f"{statistics.median(x):.2f}" if x else "-" for x in (grow, small)]
        row = f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {median:.2f} | {median / base:.2f} |"
        print(f"{row} {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
