"""In-process restart (issue 18) end to end: the README's example with dropout and AdamW on
four gloo ranks under `trainguard launch --warm-spares 2`, supervised through the real
broker and processor.

Rank 1 SIGKILLs itself at step 137: its warm spare takes rank 1 and restores rank 1's
state from its peer replica (rank 3's memory); ranks 0, 2, 3 stay in their processes and
restore from their own memory. Rank 2 then hangs at step 311: the processor's watchdog
aborts with stack dumps, the launcher ends only the odd stack out (rank 2), the second
spare takes it. Ranks 0 and 3 keep their pids through both faults, rank 1's spare keeps
its pid through the second, and the run ends with the weights and the optimizer state of
an uninterrupted run, bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainguard.producers.launcher.journal import JOURNAL_NAME, ActionJournal
from trainguard.schemas import Interruption, InterruptionCause, InterruptionDecided

from ..pipeline import Processor, running_processor
from .test_supervised_faults import decisions

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
POLICY = Path(__file__).with_name("supervised_policy.yaml")
SECRET = "inprocess-restart-test-secret-0123456789"
STEPS = 330


@dataclass
class Run:
    run_id: str
    workdir: Path
    done: subprocess.CompletedProcess[str]

    @property
    def run_dir(self) -> Path:
        return self.workdir / "ckpt" / ".trainguard"

    def explain(self) -> str:
        return self.done.stdout[-3000:] + self.done.stderr[-3000:]

    def restarts(self) -> list[dict[str, Any]]:
        path = self.run_dir / "restarts.jsonl"
        return [json.loads(line) for line in path.open()] if path.exists() else []

    def pids(self) -> dict[int, dict[int, int]]:
        """attempt -> rank -> the pid that completed the attempt's first step, by the
        script's own account (TRAIN_EVENTS_FILE), checked against the launcher's journal."""
        mine: dict[int, dict[int, int]] = {}
        for line in (self.workdir / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "first_step":
                mine.setdefault(event["attempt"], {})[event["rank"]] = event["pid"]
        journal = ActionJournal(self.run_dir / JOURNAL_NAME)
        spawned = {
            int(r["attempt"]): {int(k): v for k, v in r["pids"].items()}
            for r in journal.records
            if r.get("op") == "spawned"
        }
        assert spawned == mine
        return mine

    def final(self) -> tuple[Any, Any]:
        return torch.load(self.run_dir / "final.pt"), torch.load(self.run_dir / "final_optimizer.pt")


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def launch(pipeline: Processor, workdir: Path, fault: str | None) -> Run:
    run_id = f"hot-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    env = {**os.environ, "TRAINGUARD_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(STEPS), "TRAIN_CHECKPOINT_EVERY": "20", "TRAIN_MODEL": "dropout-adamw"}
    env |= {"TRAIN_EVENTS_FILE": str(workdir / "events.jsonl")}
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    for name in ("TRAINGUARD_SECRET_FILE", "TRAINGUARD_EXAMPLE_FAULT", "TRAINGUARD_INJECT_WRONG_DEVICE"):
        env.pop(name, None)
    if fault:
        env["TRAINGUARD_EXAMPLE_FAULT"] = fault
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "1",
        "--run-id", run_id, "--checkpoint-dir", str(workdir / "ckpt"),
        "--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix,
        "--max-restarts", "2", "--decision-wait-s", "3", "--grace-s", "5", "--self-test", "off",
        "--warm-spares", "2", "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=400)
    return Run(run_id, workdir, done)


def assert_same_tensors(a: Any, b: Any) -> None:
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


def test_a_kill_and_a_hang_are_restarted_in_process_and_the_run_ends_bitwise(
    pipeline: Processor, tmp_path: Path
) -> None:
    clean = launch(pipeline, tmp_path / "clean", None)
    assert clean.done.returncode == 0, clean.explain()
    assert clean.restarts() == []

    run = launch(pipeline, tmp_path / "faults", "kill:1:137:0,hang:2:311:1")
    assert run.done.returncode == 0, run.explain()
    crash, hang = run.restarts()
    assert (crash["cause"], crash["rank"], crash["signal"]) == ("crash", 1, 9)
    assert (hang["cause"], hang["rank"]) == ("abort", 2)
    for restart, rank in ((crash, 1), (hang, 2)):
        assert restart["path"] == "in-process" and restart["warm_ranks"] == [rank], restart
        assert restart["new_ranks"] == [] and restart["complete"], restart
        # the survivors from their own memory, the spare from its holder's (the replica)
        assert restart["restore_from"] == {"own": 3, "peer": 1}, restart
    # the newest validated checkpoint (saves after every 20th step; validation may lag a save)
    assert crash["resumed_from_step"] in (99, 119) and hang["resumed_from_step"] in (279, 299)

    pids = run.pids()
    assert pids[0][0] == pids[1][0] == pids[2][0] and pids[0][3] == pids[1][3] == pids[2][3]
    assert pids[1][1] == pids[2][1] != pids[0][1]  # rank 1's spare survived the hang
    assert len({pids[0][2], pids[2][2], pids[0][1], pids[1][1]}) == 4

    weights, optimizer = run.final()
    clean_weights, clean_optimizer = clean.final()
    assert_same_tensors(clean_weights, weights)
    assert_same_tensors(clean_optimizer, optimizer)

    derived, commands = decisions(pipeline, run.run_id)
    interruptions = [d for d in derived if isinstance(d, Interruption)]
    assert [(i.cause, i.rank) for i in interruptions] == [
        (InterruptionCause.CRASH, 1),
        (InterruptionCause.HANG, 2),  # the processor names the same rank from the stacks
    ]
    decided = [c for c in commands if isinstance(c, InterruptionDecided)]
    assert sorted(c.interruption_id for c in decided) == sorted(i.interruption_id for i in interruptions)
