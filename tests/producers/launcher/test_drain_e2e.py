"""Issue 46's acceptance, end to end on real ranks: a node drained before it fails.

docs/examples/train_tiny.py on four gloo ranks, two a modelled node (node-0000,
node-0001), under `trainguard launch --restart in-process --warm-spares 2`, supervised
through a real broker and a real processor (`trainguard process`, drain_policy.yaml).
Rank 2's GPU health reader (node-0001) reports correctable ECC errors from 15 s after its
start (once the processor knows the node's own past: a window of 10 s), 40 a second and
20% more every second (the reader's injection hook, TRAINGUARD_INJECT_HEALTH; a report
every 0.5 s, TRAINGUARD_GPU_HEALTH_INTERVAL_S). The processor predicts node-0001's failure
(FailurePredicted), decides that draining it pays (DrainDecision) and sends DrainNode; the
launcher asks the ranks for a planned leave with the drain's deadline; they agree on a
step, checkpoint and validate it, and leave there; two warm spares take ranks 2 and 3 on
spare-0000; the next attempt resumes from exactly that step (no step lost); node-0001 is
quarantined; the final weights and optimizer state are bitwise an uninterrupted run's.

The first attempt waits before step 30 until the drain comes (the example's TRAIN_HOLD_AT):
the prediction takes what it takes (its evaluations are event time), the run is still there
when it lands. The spare that takes rank 2 injects too (the hook names global ranks), from
15 s after its own start: the run's last steps end long before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.schemas import DrainDecision, DrainNode, FailurePredicted, Interruption, InterruptionCause

from ...pipeline import Processor, running_processor
from ..supervised_runs import decisions
from .drain_runs import assert_drained_at_the_boundary, assert_same_tensors, launch

pytestmark = pytest.mark.broker

POLICY = Path(__file__).with_name("drain_policy.yaml")
SECRET = "drain-e2e-test-secret-0123456789abcdef"
STEPS, HOLD_AT = 100, 30
INJECT = {"ranks": [2], "after_s": 15, "ecc_corrected_per_s": 40, "growth": 1.2}
#: No slow first attempt here: the hold keeps it going until the drain.
QUICK = {"TRAINGUARD_EXAMPLE_FAULT": ""}


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def test_a_node_predicted_to_fail_is_drained_at_a_checkpoint_and_the_run_ends_bitwise(
    pipeline: Processor, tmp_path: Path
) -> None:
    clean = launch(tmp_path / "clean", pipeline.bootstrap, pipeline.prefix, SECRET, STEPS, QUICK)
    assert clean.wait() == 0, clean.explain()
    assert clean.restarts() == []

    failing = {
        **QUICK,
        "TRAIN_HOLD_AT": str(HOLD_AT),
        "TRAINGUARD_INJECT_HEALTH": json.dumps(INJECT),
        "TRAINGUARD_GPU_HEALTH_INTERVAL_S": "0.5",
    }
    run = launch(tmp_path / "failing", pipeline.bootstrap, pipeline.prefix, SECRET, STEPS, failing)
    assert run.wait() == 0, run.explain()

    drain = assert_drained_at_the_boundary(run, "node-0001", [2, 3])
    assert drain["resumed_from_step"] >= HOLD_AT, drain  # at the hold or after it: the drain came there
    weights, optimizer = run.final()
    clean_weights, clean_optimizer = clean.final()
    assert_same_tensors(clean_weights, weights)
    assert_same_tensors(clean_optimizer, optimizer)

    derived, commands = decisions(pipeline, run.run_id)
    predicted = [d for d in derived if isinstance(d, FailurePredicted)]
    assert predicted and {p.node for p in predicted} == {"node-0001"}, predicted
    assert "ecc_corrected" in predicted[0].signals[0], predicted[0]
    decided = [d for d in derived if isinstance(d, DrainDecision)]
    assert [(d.node, d.decision) for d in decided] == [("node-0001", "drain")], decided
    [command] = [c for c in commands if isinstance(c, DrainNode)]
    # the wait the decision derived (at most the policy's 1 s; less when waiting risks more
    # than the checkpoint it saves) is the launcher's deadline
    assert (command.node, command.within_s) == ("node-0001", decided[0].within_s)
    assert 0.0 <= command.within_s <= 1.0
    assert drain["command_id"] == command.command_id  # the launcher's record names the processor's
    planned = [i for i in derived if isinstance(i, Interruption)]
    assert [(i.cause, i.attempt, i.lost_steps) for i in planned] == [(InterruptionCause.DRAIN, 0, 0)], planned
