"""What the end-to-end tests of supervised jobs read back from a run: the launcher's files
(restarts, final weights, validated checkpoints) and the pipeline's records (telemetry,
derived events and commands), and a launch of an example with a SIGKILL from outside. Used
by test_supervised_faults.py (the hand-written DDP loop) and test_frameworks_launch.py
(Lightning, the HF Trainer, FSDP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.devtools.stack import PROCESSOR_GROUP
from trainguard.kafka.lag import wait_caught_up
from trainguard.replay.log import read_topic
from trainguard.schemas import Command, Derived, Envelope, decode
from trainguard.schemas.codec import COMMANDS, DERIVED, decode_batch

from ..pipeline import Processor


@dataclass
class Run:
    run_id: str
    done: subprocess.CompletedProcess[str]
    ckpt: Path

    def restarts(self) -> list[dict[str, object]]:
        path = self.ckpt / ".trainguard" / "restarts.jsonl"
        return [json.loads(line) for line in path.open()] if path.exists() else []

    def weights(self) -> dict[str, torch.Tensor]:
        final: dict[str, torch.Tensor] = torch.load(self.ckpt / ".trainguard" / "final.pt")
        return final

    def validated(self, step: int) -> bool:
        return (self.ckpt / f"step-{step:09d}" / "VALIDATED").exists()

    def explain(self) -> str:
        return self.done.stdout[-3000:] + self.done.stderr[-3000:]


def decisions(pipeline: Processor, run_id: str) -> tuple[list[Derived], list[Command]]:
    """The processor's derived events and commands for one run: all of them, the run is
    over and the processor has committed (so published the outputs of) every record."""
    group = pipeline.prefix + PROCESSOR_GROUP
    assert wait_caught_up(pipeline.bootstrap, group, [pipeline.names.telemetry], 60)
    found: list[list[Envelope]] = []
    for topic, kinds in ((pipeline.names.events, DERIVED), (pipeline.names.commands, COMMANDS)):
        values = [value for _, _, value in read_topic(pipeline.bootstrap, topic)]
        found.append([r for r in (decode(v, kinds) for v in values) if r.run_id == run_id])
    derived = [d for d in found[0] if isinstance(d, Derived)]
    commands = [c for c in found[1] if isinstance(c, Command)]
    return derived, commands


def telemetry(pipeline: Processor, run_id: str) -> list[Envelope]:
    records = read_topic(pipeline.bootstrap, pipeline.names.telemetry)
    return [e for _, _, value in records for e in decode_batch(value).events if e.run_id == run_id]


def assert_bitwise(run: Run, clean: Run) -> None:
    expected, got = clean.weights(), run.weights()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights diverged"


def launch_env(secret: str, steps: int, checkpoint_every: int) -> dict[str, str]:
    """The environment of a supervised example's launch: this test's secret, one thread a
    rank, the example's length and checkpoint cadence, and no fault or chaos knob inherited."""
    env = {**os.environ, "TRAINGUARD_SECRET": secret, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(steps), "TRAIN_CHECKPOINT_EVERY": str(checkpoint_every)}
    # A tiny step takes ~15 ms: ship and beat often enough for decisions to land in time.
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    # Retention keeps every checkpoint: the tests read back the ones the run resumed from.
    env["TRAINGUARD_CHECKPOINT_KEEP"] = "1000"
    for name in (
        "TRAINGUARD_SECRET_FILE",
        "TRAINGUARD_EXAMPLE_FAULT",
        "TRAINGUARD_INJECT_WRONG_DEVICE",
        "TRAINGUARD_INJECT_SLOW_DEVICE",
    ):
        env.pop(name, None)
    return env


def launch_example(
    pipeline: Processor,
    workdir: Path,
    example: Path,
    env: dict[str, str],
    kill: tuple[int, int, int] | None = None,
) -> Run:
    """One `trainguard launch` of an example script on 4 ranks (2 a node, a spare node's
    worth of restarts); `kill` = (rank, attempt, step): SIGKILL that rank of that attempt
    once it has completed that step."""
    run_id = f"{example.stem}-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "ckpt"
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", run_id, "--checkpoint-dir", str(ckpt),
        "--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix,
        "--max-restarts", "2", "--decision-wait-s", "2", "--grace-s", "5", "--self-test", "off",
        "--", sys.executable, str(example),
    ]  # fmt: skip
    with subprocess.Popen(
        command, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        if kill is not None:
            rank, attempt, step = kill
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if progress(ckpt, rank, attempt) >= step:
                    os.kill(rank_pid(run_id, example, rank, attempt), signal.SIGKILL)
                    break
                time.sleep(0.02)
        out, err = proc.communicate(timeout=400)
    return Run(run_id, subprocess.CompletedProcess(command, proc.returncode, out, err), ckpt)


def progress(ckpt: Path, rank: int, attempt: int = 0) -> int:
    """The newest step the rank completed (the launcher's progress file), -1 before any."""
    try:
        return int((ckpt / ".trainguard" / f"attempt-{attempt}" / f"rank-{rank}.progress").read_text())
    except (OSError, ValueError):
        return -1


def rank_pid(run_id: str, example: Path, rank: int, attempt: int = 0) -> int:
    """The pid of the run's rank process, found by its environment (as an operator would)."""
    want = {f"TRAINGUARD_RUN_ID={run_id}", f"RANK={rank}", f"TRAINGUARD_ATTEMPT={attempt}"}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().decode(errors="replace").split("\0"))
            cmdline = (entry / "cmdline").read_text(errors="replace")
        except OSError:
            continue
        if want <= environ and example.name in cmdline:
            return int(entry.name)
    raise LookupError(f"no process for rank {rank} of {run_id}")
