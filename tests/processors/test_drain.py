"""Failure prediction's decision through the core (processors/core/decisions/drain.py, engine.py): a
node whose GPUs' correctable ECC climbs is predicted and drained at a checkpoint boundary
when that pays, the next attempt's start is a planned stop (no page, no failure counted),
a prediction that does not pay is declined with its numbers, a shard's prediction is
decided by shard 0, and a lemon node kept out of a launch pages once."""

from __future__ import annotations

import random

import pytest

from harness.streams import Job
from trainguard.processors.core import engine
from trainguard.processors.core.detectors.hazard_state import PredictionPolicy
from trainguard.processors.core.outputs import Forward
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.core.state import CoreState
from trainguard.schemas import (
    DrainDecision,
    DrainNode,
    FailurePredicted,
    Interruption,
    InterruptionCause,
    NodeExcluded,
    Page,
    QuarantineNode,
    Reason,
    ReasonCode,
)

#: Minutes, not hours, of a 16-node job: one-minute evaluations over a 20-minute window.
POLICY = CorePolicy(prediction=PredictionPolicy(check_every_s=60.0, window_s=1200.0, horizon_s=3600.0))
FAILING = "node-005"


def job_with_a_failing_node(steps: int = 240, onset_step: int = 120, seed: int = 2) -> Job:
    """64 ranks on 16 nodes, a 10 s step, a checkpoint every 30 steps; every rank reports
    its GPU's counters each step (background noise); FAILING's ECC climbs from onset_step."""
    job = Job(
        world_size=64,
        ranks_per_node=4,
        step_s=10.0,
        checkpoint_every=30,
        checkpoint_blocking_s=2.0,
        seed=seed,
    )
    rng = random.Random(seed)
    ecc = [0] * job.world_size
    job.start()
    for step in range(steps):
        job.steps(1)
        for rank in range(job.world_size):
            ecc[rank] += rng.random() < 20 / 8640  # 20 a day, per 10 s
            if job.node(rank) == FAILING and step >= onset_step:
                ecc[rank] += int(2 * 1.3 ** min(20, (step - onset_step) / 6))
            job.health(rank, ecc_corrected=ecc[rank], pcie_replays=0, temperature_c=60.0 + rng.gauss(0, 1))
    return job


def fold(job: Job, policy: CorePolicy = POLICY) -> tuple[CoreState, list[object]]:
    state, outputs = engine.run_all(job.events, policy)
    return state, list(outputs)


@pytest.mark.parametrize("validated", ["before the restart", "after the restart began"])
def test_a_climbing_node_is_drained_at_a_boundary_and_its_stop_is_planned(validated: str) -> None:
    job = job_with_a_failing_node()
    state, outputs = fold(job)
    predicted = [o for o in outputs if isinstance(o, FailurePredicted)]
    assert predicted and {p.node for p in predicted} == {FAILING}
    decisions = [o for o in outputs if isinstance(o, DrainDecision)]
    assert decisions[0].decision == "drain"
    decision = decisions[0]
    assert (
        decision.expected_saving_s
        == decision.probability * (decision.restart_s + decision.lost_work_s) - decision.drain_cost_s
    )
    assert decision.drain_cost_s >= 2.0  # the run's measured checkpoint cost is part of it
    assert "expected >" in decision.reason.text
    drains = [o for o in outputs if isinstance(o, DrainNode)]
    # it waits for the cadence's checkpoint only while the failure it risks by waiting costs
    # less than the checkpoint it saves: P x (wait / horizon) x (R + L) < C
    # the checkpoint cost measured when it decided (its cost less the swap's prior: no drain measured yet)
    checkpoint = decision.drain_cost_s - POLICY.prediction.drain_swap_prior_s
    assert checkpoint >= 2.0 and state.runs[job.run_id].interval.cost_s() is not None
    at_stake = decision.probability * (decision.restart_s + decision.lost_work_s) / decision.horizon_s
    wait = min(POLICY.prediction.drain_within_s, checkpoint / at_stake)
    assert [d.node for d in drains] == [FAILING]
    assert drains[0].within_s == pytest.approx(wait) and 0 < wait < POLICY.prediction.drain_within_s
    onset_ts = job.events[0].ts + 120 * 10.0
    assert onset_ts < predicted[0].ts < onset_ts + 15 * 60  # minutes after the climb began

    # the launcher checkpoints at the boundary and goes on without the node: a planned stop
    mark, boundary = len(job.events), job.step
    job.checkpoint_written(2.0)
    if validated == "before the restart":
        job.validated(boundary)
    job.replace(FAILING)
    job.restart(resumed_from_step=boundary, delay_s=20.0)
    if validated != "before the restart":  # the background validation lags the launcher's record
        job.validated(boundary)
    job.steps(3)
    _, after = engine.run_all(job.events[mark:], POLICY, state)
    stops = [o for o in after if isinstance(o, Interruption)]
    assert [(s.cause, s.node) for s in stops] == [(InterruptionCause.DRAIN, FAILING)]
    assert stops[0].lost_steps == 0
    assert not [o for o in after if isinstance(o, Page | QuarantineNode)]
    assert state.runs[job.run_id].baseline.interruptions == 0  # not a failure of the run


def test_a_drain_that_does_not_pay_is_declined_with_its_numbers() -> None:
    costly = CorePolicy(prediction=POLICY.prediction.model_copy(update={"drain_swap_prior_s": 1e6}))
    _, outputs = fold(job_with_a_failing_node(), costly)
    decisions = [o for o in outputs if isinstance(o, DrainDecision)]
    assert decisions and {d.decision for d in decisions} == {"decline"}
    assert all(d.reason.code == ReasonCode.DRAIN_DECLINED for d in decisions)
    assert not [o for o in outputs if isinstance(o, DrainNode)]


def test_prediction_off_is_the_baseline() -> None:
    off = CorePolicy(prediction=POLICY.prediction.model_copy(update={"enabled": False}))
    _, outputs = fold(job_with_a_failing_node(steps=200), off)
    assert not [o for o in outputs if isinstance(o, FailurePredicted | DrainDecision | DrainNode)]


def test_a_shards_prediction_is_decided_by_shard_zero() -> None:
    job = job_with_a_failing_node(steps=200)
    state, shard_out = CoreState(), []
    for event in job.events:  # ranks 16..31 (nodes 4..7) are shard 1's of 16-rank shards
        if event.rank < 0 or 16 <= event.rank < 32:
            state, out = engine.step(state, event, POLICY, shard=1, shard_ranks=16)
            shard_out += out
    predicted = [o for o in shard_out if isinstance(o, FailurePredicted)]
    forwarded = [
        o.event for o in shard_out if isinstance(o, Forward) and isinstance(o.event, FailurePredicted)
    ]
    assert predicted and forwarded == predicted
    assert not [o for o in shard_out if isinstance(o, DrainNode | DrainDecision)]
    coordinator = CoreState()
    for event in job.events:
        if event.rank < 16:
            coordinator, _ = engine.step(coordinator, event, POLICY)
    _, decided = engine.step(coordinator, predicted[0], POLICY)
    assert [type(o) for o in decided] == [DrainDecision, DrainNode]


def test_a_lemon_node_kept_out_pages_once() -> None:
    job = Job(world_size=8, ranks_per_node=4)
    job.start()
    excluded = NodeExcluded(
        event_id="excluded-node-017",
        run_id=job.run_id,
        attempt=0,
        rank=-1,
        node="node-017",
        step=-1,
        ts=job.t,
        failures=3,
        window_days=30.0,
        runs=["run-a", "run-b", "run-c"],
        reason=Reason(code=ReasonCode.LEMON_NODE, text="3 crashes in 30 days"),
    )
    again = excluded.model_copy(update={"event_id": "excluded-node-017-relaunch", "attempt": 1})
    _, outputs = engine.run_all([*job.events, excluded, again], POLICY)
    pages = [o for o in outputs if isinstance(o, Page)]
    assert [(p.rule, p.node) for p in pages] == [("lemon_node", "node-017")]
    assert "run-a, run-b, run-c" in pages[0].reason.text and "3 crashes" in pages[0].reason.text
