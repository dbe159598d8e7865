"""Launches of docs/examples/train_tiny.py under `trainguard launch --restart in-process`
for the drain tests (issue 46): four gloo ranks on two modelled nodes of two ranks, warm
spares, the checkpoints only the drain asks for, and what the tests read back (the
restart record, the journal, the ranks' pids and progress, the final weights)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from confluent_kafka import Producer

from trainguard.producers.launcher.journal import JOURNAL_NAME, ActionJournal, replay
from trainguard.producers.launcher.records import progress_path, read_progress
from trainguard.schemas import Command, auth, encode

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
ELASTIC = ROOT / "docs" / "examples" / "train_elastic.py"
#: Every rank 50 ms slower per step in attempt 0 (the example's `slow` fault: a sleep
#: before the collective, the same on every rank, so no straggler and the same weights):
#: the first attempt lasts long enough for a command to reach it; the next runs at full speed.
SLOW_FIRST_ATTEMPT = ",".join(f"slow:{rank}:0:0" for rank in range(4))


@dataclass
class Run:
    run_id: str
    workdir: Path
    proc: subprocess.Popen[str]
    #: The launcher's console (files: a pipe nobody reads while it runs would fill and block it).
    out: str = ""
    err: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.workdir / "ckpt" / ".trainguard"

    def wait(self, timeout_s: float = 400) -> int:
        """The launcher's exit status, once it ended; its console in `out` and `err`."""
        try:
            self.proc.wait(timeout_s)
        finally:
            self.out = (self.workdir / "launcher.stdout").read_text()
            self.err = (self.workdir / "launcher.stderr").read_text()
        return self.proc.returncode

    def explain(self) -> str:
        return self.out[-4000:] + self.err[-6000:]

    def restarts(self) -> list[dict[str, Any]]:
        path = self.run_dir / "restarts.jsonl"
        return [json.loads(line) for line in path.open()] if path.exists() else []

    def journal(self) -> list[dict[str, Any]]:
        return ActionJournal(self.run_dir / JOURNAL_NAME).records

    def quarantined(self) -> list[str]:
        return replay(self.journal()).quarantined

    def nodes(self) -> dict[int, list[str]]:
        """attempt -> its nodes, as the launcher journaled them."""
        return {int(r["attempt"]): list(r["nodes"]) for r in self.journal() if r.get("op") == "attempt"}

    def progress(self, attempt: int, rank: int) -> int | None:
        return read_progress(progress_path(self.run_dir, attempt, rank))

    def pids(self) -> dict[int, dict[int, int]]:
        """attempt -> rank -> the pid that trained its first step (TRAIN_EVENTS_FILE)."""
        out: dict[int, dict[int, int]] = {}
        for line in (self.workdir / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "first_step":
                out.setdefault(event["attempt"], {})[event["rank"]] = event["pid"]
        return out

    def final(self) -> tuple[Any, Any]:
        return torch.load(self.run_dir / "final.pt"), torch.load(self.run_dir / "final_optimizer.pt")

    def until_step(self, step: int, timeout_s: float = 120) -> None:
        """Until rank 0 of attempt 0 completed `step` (the run must still be going)."""
        deadline = time.monotonic() + timeout_s
        while (self.progress(0, 0) or -1) < step:
            assert self.proc.poll() is None, self.explain_now()
            assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s} s"
            time.sleep(0.05)

    def explain_now(self) -> str:
        self.wait(30)
        return self.explain()


def launch(
    workdir: Path,
    bootstrap: str,
    prefix: str,
    secret: str,
    steps: int,
    extra_env: dict[str, str] | None = None,
    options: tuple[str, ...] = ("--warm-spares", "2"),
    example: Path = EXAMPLE,
) -> Run:
    """`trainguard launch --nproc 4 --ranks-per-node 2 --restart in-process` of `example`
    with `options` (two warm spares), online (its actuator reads the commands topic under
    `prefix`), started, not awaited."""
    run_id = f"drain-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    env = {**os.environ, "TRAINGUARD_SECRET": secret, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": "100000", "TRAIN_MODEL": "dropout-adamw"}
    env |= {"TRAIN_EVENTS_FILE": str(workdir / "events.jsonl")}
    env |= {"TRAINGUARD_EXAMPLE_FAULT": SLOW_FIRST_ATTEMPT}
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    for name in ("TRAINGUARD_SECRET_FILE", "TRAINGUARD_INJECT_WRONG_DEVICE", "TRAINGUARD_INJECT_HEALTH"):
        env.pop(name, None)
    env |= extra_env or {}
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", run_id, "--checkpoint-dir", str(workdir / "ckpt"), "--bootstrap", bootstrap,
        "--topic-prefix", prefix, "--max-restarts", "2", "--decision-wait-s", "3", "--self-test", "off",
        "--restart", "in-process", *options, "--", sys.executable, str(example),
    ]  # fmt: skip
    with (workdir / "launcher.stdout").open("w") as out, (workdir / "launcher.stderr").open("w") as err:
        proc = subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=err, text=True)
    return Run(run_id, workdir, proc)


def send(bootstrap: str, topic: str, secret: str, command: Command) -> None:
    """`command`, signed with the run's key, on the commands topic (as the processor sends)."""
    signed = auth.sign(command, auth.run_key(secret.encode(), command.run_id))
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, key=command.run_id.encode(), value=encode(signed))
    assert producer.flush(30) == 0


def assert_same_tensors(a: Any, b: Any) -> None:
    """Bitwise equal, through dicts and lists (an optimizer's state dict)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


def assert_drained_at_the_boundary(run: Run, node: str, ranks: list[int]) -> dict[str, Any]:
    """The run's one restart is `node`'s drain, in process: every rank of attempt 0 left at
    the checkpoint it names (none trained past it), that checkpoint is validated, attempt 1
    resumed from exactly it with `ranks` on warm spares on the next spare node and the
    other ranks in their processes; the node is quarantined. Returns the record."""
    [drain] = run.restarts()
    assert (drain["cause"], drain["node"], drain["path"]) == ("drain", node, "in-process"), drain
    boundary = int(re.search(r"drained at the checkpoint of step (\d+)", drain["detail"])[1])  # type: ignore[index]
    assert drain["resumed_from_step"] == boundary, drain  # no step lost: exactly the boundary
    assert all(run.progress(0, r) == boundary for r in range(4)), "a rank trained past the boundary"
    assert (run.workdir / "ckpt" / f"step-{boundary:09d}" / "VALIDATED").exists()
    assert drain["warm_ranks"] == ranks and drain["new_ranks"] == [] and drain["complete"], drain
    assert run.quarantined() == [node]
    nodes = run.nodes()
    assert nodes[1] == [n if n != node else "spare-0000" for n in nodes[0]], nodes
    pids = run.pids()
    kept = [r for r in range(4) if r not in ranks]
    assert [pids[1][r] for r in kept] == [pids[0][r] for r in kept]  # the others in their processes
    assert not {pids[1][r] for r in ranks} & set(pids[0].values())  # the spares took the node's ranks
    return drain
