"""The README's example with one rank slowed before the collective (its own fault knob, a
sleep inside the compute): flagged as a straggler, diagnosed, evicted at the next
checkpoint boundary, and the run finishes (test_frameworks_launch.py does the same for
Lightning, the HF Trainer and FSDP, through the chaos knob)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.schemas import EvictRank, StragglerDiagnosed, StragglerFlagged

from ..pipeline import Processor, running_processor
from .test_supervised_faults import POLICY, SECRET, STEPS, decisions, launch

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def test_a_rank_slowed_before_the_collective_is_flagged_and_evicted(
    pipeline: Processor, tmp_path: Path
) -> None:
    run = launch(pipeline, tmp_path, fault="slow:2:20:0")
    assert run.done.returncode == 0, run.explain()
    derived, commands = decisions(pipeline, run.run_id)
    (flagged,) = [d for d in derived if isinstance(d, StragglerFlagged)]
    # 100 slow steps from the streak's onset: the fault's first step, or a few noisy steps before
    # it on these contended cores. The streak tolerates max_gap_steps = 2 in-band steps, so up to
    # three noisy steps, each within 3 of the next, can chain the onset back by 9 (seen in CI: 14).
    assert flagged.rank == 2 and flagged.consecutive_steps == 100 and 20 - 9 <= flagged.onset_step <= 22
    assert flagged.step >= flagged.onset_step + 100 - 1
    assert [d.rank for d in derived if isinstance(d, StragglerDiagnosed)] == [2]
    (evict,) = [c for c in commands if isinstance(c, EvictRank)]
    assert evict.rank == 2
    (restart,) = run.restarts()
    assert (restart["cause"], restart["command_id"]) == ("eviction", evict.command_id)
    resumed = restart["resumed_from_step"]
    # The next checkpoint boundary: the first checkpoint validated after the EvictRank arrived.
    assert isinstance(resumed, int) and resumed >= flagged.step and run.validated(resumed)
    assert run.validated(STEPS - 1)
