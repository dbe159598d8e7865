"""Issue 21's end-to-end test for FSDP: the example docs/examples/train_fsdp.py (a
``fully_shard`` loop with the same trainguard lines as the DDP one), 4 real gloo ranks on
CPU under `trainguard launch`, supervised through the real broker by a real processor
(its own process):

- the uninterrupted run: never interrupted; the policy's commanded self-checks are
  replayed by every rank at the agreed step (the forward all-gathers), reported by the
  commanded rank, and all pass; so are the ring cross-rank checks, and they all agree;
- one faulted run, the faults one after the other (one launch, to keep the suite short):
  rank 2's device slowed (the chaos knob TRAINGUARD_INJECT_SLOW_DEVICE: every matrix
  product waits first, the result right), so its compute (the forward less the
  all-gathers' waits) grows: it is flagged and evicted at the next checkpoint boundary;
  then, in the next attempt, rank 3 is SIGKILLed from outside (as the OOM killer would):
  detected, the run restarts from the newest validated sharded checkpoint, and the final
  weights are bitwise those of the uninterrupted run.
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

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "train_fsdp.py"
POLICY = Path(__file__).with_name("fsdp_policy.yaml")  # a straggler after 30 slow steps
SECRET = "fsdp-launch-test-secret-0123456789"
STEPS = 80
CHECKPOINT_EVERY = 10


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


def test_the_uninterrupted_run_self_checks_on_every_rank_and_is_never_interrupted(
    pipeline: Processor, clean: Run
) -> None:
    assert clean.restarts() == []
    assert clean.validated(STEPS - 1)
    derived, _ = decisions(pipeline, clean.run_id)
    assert not [d for d in derived if isinstance(d, Interruption | StragglerFlagged | SdcMismatch)], derived
    events = telemetry(pipeline, clean.run_id)
    self_checks = [e for e in events if isinstance(e, SdcSelfCheck)]
    assert len({e.rank for e in self_checks}) >= 2 and all(e.passed for e in self_checks), self_checks
    assert {e.rank for e in events if isinstance(e, RingCheck)} == {0, 1, 2, 3}  # all ranks replay


def test_a_slow_rank_is_flagged_and_evicted_and_after_a_sigkill_the_run_ends_bitwise(
    pipeline: Processor, clean: Run, tmp_path: Path
) -> None:
    slow = "node=node-0001,local_rank=0,from_step=5,delay_s=0.02"  # rank 2
    env = {"TRAINGUARD_INJECT_SLOW_DEVICE": slow}
    run = launch(pipeline, tmp_path, env_extra=env, kill=(3, 1, STEPS - 10))
    assert run.done.returncode == 0, run.explain()
    derived, commands = decisions(pipeline, run.run_id)
    (flagged,) = [d for d in derived if isinstance(d, StragglerFlagged)]
    # 30 slow steps from the onset (a few noisy steps before it may chain into the streak)
    assert flagged.rank == 2 and flagged.consecutive_steps == 30 and flagged.onset_step <= 5 + 10
    (evict,) = [c for c in commands if isinstance(c, EvictRank)]
    evicted, killed = run.restarts()
    assert (evicted["cause"], evicted["command_id"]) == ("eviction", evict.command_id)
    assert (killed["cause"], killed["rank"], killed["signal"]) == ("crash", 3, 9)
    resumed = killed["resumed_from_step"]
    assert isinstance(resumed, int) and resumed >= evicted["resumed_from_step"] and run.validated(resumed)
    interruptions = [(d.cause, d.attempt, d.rank) for d in derived if isinstance(d, Interruption)]
    assert interruptions == [(InterruptionCause.EVICTION, 0, 2), (InterruptionCause.CRASH, 1, 3)], derived
    (crash,) = [d for d in derived if isinstance(d, Interruption) and d.cause == InterruptionCause.CRASH]
    assert crash.rank == 3 and crash.attempt == 1
    (recovered,) = [
        d
        for d in derived
        if isinstance(d, InterruptionRecovered) and d.interruption_id == crash.interruption_id
    ]
    assert (recovered.resumed_from_step, recovered.lost_steps) == (resumed, crash.step - resumed)
    assert_bitwise(run, clean)
