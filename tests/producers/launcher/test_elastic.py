"""Elastic training on one host (issue 45) end to end: docs/examples/train_elastic.py
(dropout, AdamW, a learning-rate schedule) on four gloo ranks under `trainguard launch
--nproc 4 --min-nproc 2`, no warm spare, supervised through the real broker and processor.

Rank 2 SIGKILLs itself at step 137: the three survivors go on at world 3 in their own
processes from the newest checkpoint (step 99); the process started for the lost rank
becomes ready and the world grows back to 4 at the next checkpoint boundary (step 199: the
smaller world waits there for the launcher's resize, so that the boundary is known), the
survivors again in their processes.
The survivors restore the smaller world from their own host memory (their copies hold no
per-rank state), the grown world from storage (the new process has no copy).
Every sample of every epoch is trained exactly once, the final weights are within
floating-point tolerance of an uninterrupted run's, and bitwise those of a second run that
shrank and grew at the same steps."""

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

from ...pipeline import Processor, running_processor
from .elastic_checks import assert_each_sample_once, assert_like_clean, assert_weights, trained

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_elastic.py"
POLICY = Path(__file__).with_name("elastic_policy.yaml")
SECRET = "elastic-test-secret-0123456789abcdef"
STEPS, SAMPLES, GLOBAL_BATCH = 300, 2048, 64
#: Float32 sums of the shards' gradients in another order, through 300 AdamW steps.
TOLERANCE = 1e-6


@dataclass
class Run:
    workdir: Path
    done: subprocess.CompletedProcess[str]

    @property
    def run_dir(self) -> Path:
        return self.workdir / "ckpt" / ".trainguard"

    def explain(self) -> str:
        return self.done.stdout[-3000:] + self.done.stderr[-4000:]

    def restarts(self) -> list[dict[str, Any]]:
        path = self.run_dir / "restarts.jsonl"
        return [json.loads(line) for line in path.open()] if path.exists() else []

    def first_steps(self) -> dict[int, dict[int, tuple[int, int]]]:
        """attempt -> rank -> (pid, world) of the process that trained its first step."""
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for line in (self.workdir / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "first_step":
                out.setdefault(event["attempt"], {})[event["rank"]] = (event["pid"], event["world"])
        return out

    def trained(self) -> dict[int, list[int]]:
        """step -> the sample ids of its update (elastic_checks.trained)."""
        return trained(self.workdir / "samples.jsonl")

    def final(self) -> dict[str, Any]:
        return dict(torch.load(self.run_dir / "final.pt"))


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def launch(pipeline: Processor, workdir: Path, kill: str | None) -> Run:
    workdir.mkdir(parents=True)
    env = {**os.environ, "TRAINGUARD_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    env |= {"TRAIN_STEPS": str(STEPS), "TRAIN_CHECKPOINT_EVERY": "100", "TRAIN_GROW_AT": "199"}
    env |= {
        "TRAIN_EVENTS_FILE": str(workdir / "events.jsonl"),
        "TRAIN_SAMPLES_FILE": str(workdir / "samples.jsonl"),
    }
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25"}
    env.pop("TRAINGUARD_SECRET_FILE", None)
    if kill:
        env["TRAIN_KILL"] = kill
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--min-nproc", "2",
        "--ranks-per-node", "1", "--run-id", f"elastic-{uuid.uuid4().hex[:8]}",
        "--checkpoint-dir", str(workdir / "ckpt"), "--bootstrap", pipeline.bootstrap,
        "--topic-prefix", pipeline.prefix, "--max-restarts", "3", "--decision-wait-s", "3",
        "--self-test", "off", "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=400)
    return Run(workdir, done)


def test_a_lost_rank_shrinks_the_world_in_process_and_it_grows_back_at_a_checkpoint(
    pipeline: Processor, tmp_path: Path
) -> None:
    clean = launch(pipeline, tmp_path / "clean", None)
    assert clean.done.returncode == 0, clean.explain()
    assert clean.restarts() == []

    runs = [launch(pipeline, tmp_path / f"elastic-{i}", "2:137:0") for i in range(2)]
    for run in runs:
        assert run.done.returncode == 0, run.explain()
        shrink, grow = run.restarts()
        assert (shrink["cause"], shrink["rank"], shrink["path"]) == ("crash", 2, "in-process"), shrink
        assert (shrink["decision"], shrink["world_size"], shrink["resumed_from_step"]) == ("shrink", 3, 99)
        assert shrink["new_ranks"] == [] and shrink["warm_ranks"] == [] and shrink["complete"], shrink
        assert shrink["restore_from"] == {"own": 3}, shrink  # each survivor its own memory copy
        assert shrink["restart_s"] < 2.0, shrink  # the survivors go on at once
        assert (grow["cause"], grow["path"], grow["decision"]) == ("resize", "in-process", "grow"), grow
        assert (grow["world_size"], grow["resumed_from_step"]) == (4, 199), grow  # the boundary: no work lost
        assert grow["new_ranks"] == [] and grow["warm_ranks"] == [3] and grow["complete"], grow
        assert grow["restore_from"] == {"storage": 4}, grow  # the new process has no copy: storage

        firsts = run.first_steps()
        assert {r: w for r, (_, w) in firsts[1].items()} == {0: 3, 1: 3, 2: 3}
        # the survivors (ranks 0, 1, 3 -> 0, 1, 2) keep their processes through both changes
        pids = {a: {r: pid for r, (pid, _) in ranks.items()} for a, ranks in firsts.items()}
        assert [pids[1][r] for r in range(3)] == [pids[0][0], pids[0][1], pids[0][3]]
        assert [pids[2][r] for r in range(3)] == [pids[1][r] for r in range(3)]
        assert pids[2][3] not in pids[0].values()

        trained = run.trained()
        assert_each_sample_once(trained, STEPS, SAMPLES, GLOBAL_BATCH)
        assert_like_clean(trained, clean.trained())  # the uninterrupted run's data order

    assert_weights(clean.final(), runs[0].final(), runs[1].final(), TOLERANCE)
