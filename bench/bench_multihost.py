"""Restart phases of a whole-host loss across hosts (issue 17): three host agents of two
gloo ranks each and a spare agent, as separate process trees on this machine, torch's c10d
rendezvous on localhost, the README example offline; one host's agent and ranks SIGKILLed
once step 49 is validated; the spare takes its ranks from the newest checkpoint.

    .venv/bin/python bench/bench_multihost.py [--runs 3] [--workdir .trainguard/bench-multihost]

Per run and per host: detect (the host's rank failing to the agent noticing), reschedule
(teardown, decision wait and the rendezvous round, up to the spawn), of it the rendezvous
round, process start, process-group init, checkpoint load (restore), first step, and R
(the kill to the host's last rank's first step after it). The survivors' figures come
from their restarts.jsonl; the spare's from its ranks' phase files, against the kill's
time. Prints a markdown table, then the slowest host's R and the median host's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.hosts import agent as host_agent  # noqa: E402
from harness.hosts import attempted, environment, kill_tree  # noqa: E402
from trainguard.producers.launcher.config import free_port  # noqa: E402
from trainguard.producers.launcher.records import phases_path, read_json  # noqa: E402

PHASES = ("detect_s", "reschedule_s", "rendezvous_s", "process_start_s", "pg_init_s", "checkpoint_load_s")


def agent(node: str, endpoint: str, ckpt: Path, workdir: Path) -> subprocess.Popen[str]:
    """One host's agent, offline, the example with dropout and AdamW for 160 steps."""
    return host_agent(node, endpoint, ckpt, workdir, environment(160))


def one_run(workdir: Path) -> list[dict[str, object]]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    ckpt, endpoint = workdir / "ckpt", f"127.0.0.1:{free_port()}"
    agents = {"host-a": agent("host-a", endpoint, ckpt, workdir)}
    time.sleep(2)
    agents |= {name: agent(name, endpoint, ckpt, workdir) for name in ("host-b", "host-c")}
    try:
        while not all(attempted(ckpt, name) for name in agents):
            time.sleep(0.1)
        agents["spare-1"] = agent("spare-1", endpoint, ckpt, workdir)
        while not (ckpt / "step-000000049" / "VALIDATED").exists():
            time.sleep(0.05)
        killed = time.time()
        kill_tree(agents["host-b"])
        for name in ("host-a", "host-c", "spare-1"):
            if agents[name].wait(300) != 0:
                raise RuntimeError((workdir / f"{name}.log").read_text()[-3000:])
    finally:
        for proc in agents.values():
            kill_tree(proc)
    rows: list[dict[str, object]] = []
    hosts = ckpt / ".trainguard" / "hosts"
    for name in ("host-a", "host-c"):
        (rec,) = [json.loads(line) for line in (hosts / name / "restarts.jsonl").open()]
        last_first_step = rec["restart_s"] + rec["fault_ts"] if rec["restart_s"] is not None else None
        r_s = last_first_step - killed if last_first_step is not None else None
        rows.append(
            {"host": name, **{k: rec.get(k) for k in PHASES}, "first_step_s": rec["first_step_s"], "R_s": r_s}
        )
    journal = [json.loads(line) for line in (hosts / "spare-1" / "launcher.actions.jsonl").open()]
    (att,) = [r for r in journal if r["op"] == "attempt"]
    files = [read_json(phases_path(hosts / "spare-1", att["attempt"], r)) for r in att["ranks"]]
    spawn = next(r["spawn_ts"] for r in journal if r["op"] == "spawned")
    rows.append({
        "host": "spare-1 (new)", "detect_s": None, "reschedule_s": spawn - killed, "rendezvous_s": None,
        "process_start_s": max(f["start_ts"] for f in files) - spawn,
        "pg_init_s": max(f.get("pg_init_s", 0.0) for f in files),
        "checkpoint_load_s": max(f.get("checkpoint_load_s", 0.0) for f in files),
        "first_step_s": max(f["first_step_ts"] - f["start_ts"] - f.get("pg_init_s", 0.0)
                            - f.get("checkpoint_load_s", 0.0) for f in files),
        "R_s": max(f["first_step_ts"] for f in files) - killed,
    })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-multihost"))
    args = parser.parse_args()
    columns = [*PHASES, "first_step_s", "R_s"]
    print("| run | host | " + " | ".join(c.removesuffix("_s") for c in columns) + " |")
    print("| ---: | --- | " + " | ".join("---:" for _ in columns) + " |")
    slowest, per_host = [], []
    for run in range(args.runs):
        rows = one_run(args.workdir / f"run-{run}")
        for row in rows:
            cells = ["" if row[c] is None else f"{row[c]:.2f}" for c in columns]  # type: ignore[str-format]
            print(f"| {run} | {row['host']} | " + " | ".join(cells) + " |")
        times = [float(row["R_s"]) for row in rows if row["R_s"] is not None]  # type: ignore[arg-type]
        slowest.append(max(times))
        per_host.extend(times)
    spread = f"min {min(slowest):.2f}, max {max(slowest):.2f}"
    median = statistics.median(slowest)
    print(f"\nR of the slowest host: median {median:.2f} s over {args.runs} runs ({spread});")
    print(f"median host: {statistics.median(per_host):.2f} s")


if __name__ == "__main__":
    main()
