"""Restart time R against plain torchrun (issue 18), and restart phases per fault.

Default, the side-by-side: the same 4-rank gloo job (a 2-layer MLP with dropout, AdamW, a
checkpoint every 20 steps; rank 1 SIGKILLs itself at step ``--kill-step``) run alternately
under

- plain ``torchrun --max-restarts 1`` with torch DCP (bench/restart_torchrun.py: a script a
  user would write, resuming from its newest complete checkpoint itself);
- ``trainguard launch`` with the full restart (every rank process new: forked from the
  fork server that imported torch, the default, issue 48; and with ``--preload none``, a
  new interpreter each, as torchrun starts them);
- ``trainguard launch --warm-spares 2``: in-process restart, warm spares take the failed
  node's ranks (a node's worth: two);

trainguard's supervised through a real local broker and processor, as a user runs it,
with trainguard's defaults: two ranks per modelled node (``--ranks-per-node 2``), spares
self-tested (``--self-test ahead``, the default: proven while the run trains, so the
restart waits for none; the quarantined node's own test runs after the restart). The kill
comes once the start-up is over (step 437 of 500 by default, ~8 s of training): a failure
in a real run comes hours in, not while the spares' first self-tests still run. R is the
training script's own clock: from rank 1's "kill" line to the last rank's first completed
step after it (TRAIN_EVENTS_FILE). Prints R per run, the medians and each ratio to
torchrun's median, and trainguard's restart records' phases.

    .venv/bin/python bench/bench_restart.py [--runs 5] [--workdir .trainguard/bench-restart]

``--per-fault``: the README example on 4 gloo ranks under `trainguard launch`, supervised,
with one fault per run (SIGKILL, a hang in the step, a straggler evicted at the next
checkpoint, an SDC self-check mismatch rolled back to the clean ancestor):

    .venv/bin/python bench/bench_restart.py --per-fault [--steps 220]

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
import shutil
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from restart_compare import restart_seconds, run_torchrun

from harness.devtools.stack import local_stack

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


COMPARE_PHASES = (
    "detect_s", "reschedule_s", "process_start_s", "import_s", "pg_init_s", "build_s",
    "checkpoint_load_s", "first_step_s",
)  # fmt: skip


def launch_compare(
    bootstrap: str, workdir: Path, secret: str, steps: int, kill_step: int, flags: list[str]
) -> dict[str, object]:
    """One trainguard run of the side-by-side job; R from the script's clock, and the
    launcher's record of the restart. A last flag "storage": restore from storage only."""
    storage = flags[-1:] == ["storage"]
    flags = flags[:-1] if storage else flags
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    ckpt, events = workdir / "ckpt", workdir / "events.jsonl"
    env = {**os.environ, "TRAINGUARD_SECRET": secret, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "20", "TRAIN_MODEL": "dropout-adamw"}
    env |= {"TRAIN_EVENTS_FILE": str(events), "TRAINGUARD_EXAMPLE_FAULT": f"kill:1:{kill_step}:0"}
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    env.pop("TRAINGUARD_SECRET_FILE", None)
    env["TRAINGUARD_RESTORE_FROM"] = "storage" if storage else "memory"
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", f"bench-{uuid.uuid4().hex[:8]}", "--checkpoint-dir", str(ckpt), "--bootstrap", bootstrap,
        "--max-restarts", "1", *flags, "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"trainguard {flags}: launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    (record,) = [
        json.loads(line) for line in (ckpt / ".trainguard" / "restarts.jsonl").read_text().splitlines()
    ]
    return {"R": restart_seconds(lines), "record": record}


def compare(args: argparse.Namespace) -> None:
    secret = uuid.uuid4().hex * 2
    variants = {
        "torchrun + DCP": None,
        "trainguard, full restart": ["--restart", "full"],  # ranks forked from the fork server
        # the full restart with a new interpreter per rank, as torchrun starts them (issue 48)
        "trainguard, full restart, new interpreters": ["--restart", "full", "--preload", "none"],
        "trainguard, in-process + warm spares": ["--warm-spares", "2"],
        # the same, every rank restoring from storage: the restore phase, memory vs storage
        "trainguard, in-process + warm spares, restore from storage": ["--warm-spares", "2", "storage"],
    }
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    with local_stack(args.workdir, POLICY, args.metrics_port, {"TRAINGUARD_SECRET": secret}) as stack:
        for i in range(args.runs):
            for v, (name, flags) in enumerate(variants.items()):  # alternated: load drifts hit all alike
                workdir = args.workdir / f"run-{i}-variant-{v}"  # each variant's files kept apart
                if flags is None:
                    result = run_torchrun(workdir, args.compare_steps, f"1:{args.kill_step}")
                    if not result.get("ok"):
                        raise SystemExit(f"torchrun run {i} failed: {result}")
                    runs[name].append({"R": result["R"], "record": result})
                else:
                    runs[name].append(
                        launch_compare(
                            stack.bootstrap, workdir, secret, args.compare_steps, args.kill_step, flags
                        )
                    )
                print(f"run {i} {name}: R = {float(runs[name][-1]['R']):.2f} s", file=sys.stderr, flush=True)
    base = statistics.median(float(r["R"]) for r in runs["torchrun + DCP"])
    print("| variant | R per run (s) | median (s) | / torchrun |")
    print("| --- | --- | ---: | ---: |")
    for name, results in runs.items():
        values = [float(r["R"]) for r in results]
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {median:.2f} | {median / base:.2f} |")
    print()
    print(
        "| variant | run | path | restore | "
        + " | ".join(p.removesuffix("_s") for p in COMPARE_PHASES)
        + " |"
    )
    print("| --- | ---: | --- | --- | " + " | ".join("---:" for _ in COMPARE_PHASES) + " |")
    for name, results in list(runs.items())[1:]:
        for i, result in enumerate(results):
            rec = result["record"]
            assert isinstance(rec, dict)
            restore = ", ".join(f"{k} {v}" for k, v in dict(rec.get("restore_from") or {}).items()) or "-"
            phases = " | ".join(cell(rec.get(p)) for p in COMPARE_PHASES)
            print(f"| {name} | {i} | {rec.get('path')} | {restore} | {phases} |")


def cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-restart"))
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--metrics-port", type=int, default=9467)
    parser.add_argument("--per-fault", action="store_true", help="the restart phases per fault kind")
    parser.add_argument("--runs", type=int, default=5, help="side-by-side: runs of each variant")
    parser.add_argument("--compare-steps", type=int, default=500, help="side-by-side: steps per run")
    parser.add_argument("--kill-step", type=int, default=437, help="side-by-side: rank 1 dies before it")
    args = parser.parse_args()
    if not args.per_fault:
        compare(args)
        return
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
