"""Issue 15, item 2, end to end: the checkpoint interval `auto` derives survives restarts.

The README's example (docs/examples/train_tiny.py) on 4 real gloo ranks under `trainguard
launch`, supervised by a real processor through the real broker, with its own policy
(interval_policy.yaml: the optimum is clamped to 1.5 s; the launcher's interval, in force
until the core derives one, is 0.25 s). Attempt 0 checkpoints at 0.25 s until the core
measures C and publishes 1.5 s; then a rank is SIGKILLed in attempt 0 and another in
attempt 1. Attempts 1 and 2 must checkpoint every 1.5 s (in steps of their measured step
time), not fall back to 0.25 s: a SetCheckpointInterval carries its attempt and a
restarted rank refuses an earlier one's, so the launcher hands the last interval to each
new attempt and the core sends it again at each attempt's first step (every rank acks it).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.replay.log import read_topic
from trainguard.schemas import (
    Ack,
    AckStatus,
    CheckpointWritten,
    Interruption,
    IntervalUpdate,
    SetCheckpointInterval,
    StepTiming,
    decode,
)
from trainguard.schemas.codec import ACKS

from ..pipeline import Processor, running_processor
from .test_supervised_faults import EXAMPLE, SECRET, Run, decisions, telemetry

pytest.importorskip("torch")

pytestmark = pytest.mark.broker

POLICY = Path(__file__).with_name("interval_policy.yaml")
DERIVED_S = 1.5  # the policy's clamp: the only interval the core can derive
LAUNCHER_S = 0.25  # the launcher's interval, in force until the core derives one
STEPS = 700  # long enough that attempts 1 and 2 each span several 1.5 s intervals on a fast machine
KILLS = "kill:3:140:0,kill:1:420:1"  # rank 3 at step 140 of attempt 0, rank 1 at step 420 of attempt 1


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def launch(pipeline: Processor, workdir: Path) -> Run:
    run_id = f"interval-{uuid.uuid4().hex[:8]}"
    ckpt = workdir / "ckpt"
    env = {**os.environ, "TRAINGUARD_SECRET": SECRET, "OMP_NUM_THREADS": "1", "TRAIN_STEPS": str(STEPS)}
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    env |= {"TRAINGUARD_CHECKPOINT_INTERVAL_S": str(LAUNCHER_S), "TRAINGUARD_EXAMPLE_FAULT": KILLS}
    for name in ("TRAINGUARD_SECRET_FILE", "TRAIN_CHECKPOINT_EVERY"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", run_id, "--checkpoint-dir", str(ckpt),
        "--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix,
        "--max-restarts", "2", "--decision-wait-s", "2", "--grace-s", "5",
        "--self-test", "off",  # spares join untested: the interval is what is tested here
        "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=400)
    return Run(run_id, done, ckpt)


def checkpoint_gaps_s(steps: dict[int, float], saved: list[int]) -> list[float]:
    """Seconds between consecutive checkpoints of one attempt (the first from its first step),
    by the ts of the step each was taken after."""
    marks = [steps[min(steps)], *(steps[s] for s in sorted(saved))]
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def test_later_attempts_checkpoint_at_the_interval_auto_derived(pipeline: Processor, tmp_path: Path) -> None:
    run = launch(pipeline, tmp_path)
    assert run.done.returncode == 0, run.explain()
    assert [r["cause"] for r in run.restarts()] == ["crash", "crash"]
    derived, commands = decisions(pipeline, run.run_id)
    assert len([d for d in derived if isinstance(d, Interruption)]) == 2
    (update,) = [d for d in derived if isinstance(d, IntervalUpdate)]  # derived once, in attempt 0
    assert (update.attempt, update.interval_s) == (0, DERIVED_S)
    sent = [c for c in commands if isinstance(c, SetCheckpointInterval)]
    assert [(c.attempt, c.interval_s) for c in sent] == [(a, DERIVED_S) for a in (0, 1, 2)]
    assert all(c.reason.text.startswith(f"attempt {c.attempt} started") for c in sent[1:])
    # Every rank of attempts 1 and 2 accepted the interval sent to its attempt.
    acks = [decode(value, ACKS) for _, _, value in read_topic(pipeline.bootstrap, pipeline.names.acks)]
    for again in sent[1:]:
        executed = {a.rank for a in acks if isinstance(a, Ack) and a.command_id == again.command_id
                    and a.status is AckStatus.EXECUTED}  # fmt: skip
        assert {0, 1, 2, 3} <= executed, (again.attempt, executed)

    events = telemetry(pipeline, run.run_id)
    for attempt in (0, 1, 2):
        steps = {
            e.step: e.ts for e in events if isinstance(e, StepTiming) and e.rank == 0 and e.attempt == attempt
        }
        saved = [e.checkpoint_step for e in events
                 if isinstance(e, CheckpointWritten) and e.rank == 0 and e.attempt == attempt]  # fmt: skip
        gaps = checkpoint_gaps_s(steps, [s for s in saved if s in steps])
        if attempt == 0:  # the launcher's 0.25 s first: the core needs a checkpoint to measure C
            assert min(gaps) < DERIVED_S / 2, gaps
            continue
        # The derived 1.5 s from the attempt's start (counted in steps of the measured step
        # time, so not to the millisecond), never the launcher's 0.25 s.
        assert len(gaps) >= 2 and DERIVED_S / 2 <= statistics.median(gaps) <= 3 * DERIVED_S, (attempt, gaps)
