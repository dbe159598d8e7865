"""Issue 21's end-to-end test for the Hugging Face Trainer: the example
docs/examples/train_hf.py (a tiny Llama built from a config; one trainguard line: the
callback), 4 real gloo ranks on CPU under `trainguard launch`, supervised through the real
broker by a real processor (its own process):

- the uninterrupted run: never interrupted, its commanded self-checks (the step's
  micro-batches replayed through the Trainer's compute_loss) and ring cross-rank checks (a
  neighbour's micro-batches named from the Trainer's seeded, sharded loader) run and agree;
- one faulted run, the faults one after the other (one launch, to keep the suite short):
  rank 2's device slowed (TRAINGUARD_INJECT_SLOW_DEVICE: every linear layer waits 8 ms
  first, 15 of them a forward), so its compute before the all-reduce grows: it is
  flagged and evicted at the next checkpoint boundary; then, in the next attempt, rank 3
  is SIGKILLed from outside: detected, the run restarts from the newest validated
  checkpoint, the callback resumes it through the Trainer's own resume path without the
  script naming a step, and the final weights are bitwise those of the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.schemas import (
    EvictRank,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    RingCheck,
    SdcMismatch,
    SdcSelfCheck,
    StragglerFlagged,
)

from ..pipeline import Processor, running_processor
from .supervised_runs import Run, assert_bitwise, decisions, launch_env, launch_example, telemetry

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_hf.py"
POLICY = Path(__file__).with_name("supervised_policy.yaml")
SECRET = "hf-trainer-launch-test-secret-0123456789"
STEPS = 160  # the policy flags a straggler after 100 slow steps
CHECKPOINT_EVERY = 20


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def launch(
    pipeline: Processor,
    workdir: Path,
    env_extra: dict[str, str] | None = None,
    kill: tuple[int, int, int] | None = None,
) -> Run:
    env = launch_env(SECRET, STEPS, CHECKPOINT_EVERY) | (env_extra or {})
    return launch_example(pipeline, workdir, EXAMPLE, env, kill)


@pytest.fixture(scope="module")
def clean(pipeline: Processor, tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = launch(pipeline, tmp_path_factory.mktemp("clean"))
    assert run.done.returncode == 0, run.explain()
    return run


def test_the_uninterrupted_run_runs_its_checks_and_is_never_interrupted(
    pipeline: Processor, clean: Run
) -> None:
    assert clean.restarts() == []
    assert clean.validated(STEPS - 1)
    derived, _ = decisions(pipeline, clean.run_id)
    assert not [d for d in derived if isinstance(d, Interruption | StragglerFlagged | SdcMismatch)], derived
    events = telemetry(pipeline, clean.run_id)
    self_checks = [e for e in events if isinstance(e, SdcSelfCheck)]
    assert self_checks and all(e.passed for e in self_checks)
    assert {e.rank for e in events if isinstance(e, RingCheck)} == {0, 1, 2, 3}


def test_a_slow_rank_is_flagged_and_evicted_and_after_a_sigkill_the_run_ends_bitwise(
    pipeline: Processor, clean: Run, tmp_path: Path
) -> None:
    slow = "node=node-0001,local_rank=0,from_step=5,delay_s=0.008"  # rank 2
    run = launch(pipeline, tmp_path, {"TRAINGUARD_INJECT_SLOW_DEVICE": slow}, kill=(3, 1, STEPS - 10))
    assert run.done.returncode == 0, run.explain()
    derived, commands = decisions(pipeline, run.run_id)
    (flagged,) = [d for d in derived if isinstance(d, StragglerFlagged)]
    assert flagged.rank == 2 and flagged.consecutive_steps == 100 and flagged.onset_step <= 5 + 10
    (evict,) = [c for c in commands if isinstance(c, EvictRank)]
    evicted, killed = run.restarts()
    assert (evicted["cause"], evicted["command_id"]) == ("eviction", evict.command_id)
    assert (killed["cause"], killed["rank"], killed["signal"]) == ("crash", 3, 9)
    resumed = killed["resumed_from_step"]
    assert isinstance(resumed, int) and resumed >= evicted["resumed_from_step"] and run.validated(resumed)
    interruptions = [(d.cause, d.attempt, d.rank) for d in derived if isinstance(d, Interruption)]
    assert interruptions == [(InterruptionCause.EVICTION, 0, 2), (InterruptionCause.CRASH, 1, 3)], derived
    (crash,) = [d for d in derived if isinstance(d, Interruption) and d.cause == InterruptionCause.CRASH]
    (recovered,) = [
        d
        for d in derived
        if isinstance(d, InterruptionRecovered) and d.interruption_id == crash.interruption_id
    ]
    assert (recovered.resumed_from_step, recovered.lost_steps) == (resumed, crash.step - resumed)
    assert_bitwise(run, clean)
