"""The simulator against the real policy core, in-process: the events it emits are the
ones the processors' detectors were written for, and its reactions to their commands
close the loop (crash -> abort -> restart; hang -> stack-dump abort -> odd stack)."""

from __future__ import annotations

from trainguard.processors.core import engine
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.core.state import CoreState
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.schemas import Command, Interruption, InterruptionCause, InterruptionRecovered, ReasonCode


def test_demo_scenario_closes_the_loop_with_the_policy_core() -> None:
    demo = Scenario.builtin("demo")
    cluster = SimulatedCluster(demo, 1_000.0, run_id="demo-run", id_prefix="d")
    state, policy = CoreState(), CorePolicy()
    outputs = []

    def feed(events: list) -> None:
        nonlocal state
        for event in events:
            state, out = engine.step(state, event, policy)
            for item in out:
                outputs.append(item)
                if isinstance(item, Command):
                    feed(cluster.apply(item).events)

    t = 1_000.0
    while not cluster.done and t < 1_300:
        t += 0.05
        feed(cluster.advance(t))

    # a crash, a hang, then the straggler's eviction at a checkpoint boundary: 3 restarts
    assert cluster.done and cluster.attempt == 3
    by_cause = {o.cause: o for o in outputs if isinstance(o, Interruption)}
    crash, hang = by_cause[InterruptionCause.CRASH], by_cause[InterruptionCause.HANG]
    evicted = by_cause[InterruptionCause.EVICTION]
    assert (crash.cause, crash.rank, crash.node) == (InterruptionCause.CRASH, 13, "node-0001")
    assert (crash.last_checkpoint_step, crash.lost_steps) == (75, 4)
    assert (hang.cause, hang.rank, hang.node) == (InterruptionCause.HANG, 42, "node-0005")
    assert hang.reason.code is ReasonCode.ODD_STACK
    straggler = next(f for f in demo.truth() if f.kind == "slow")
    assert (evicted.cause, evicted.rank, evicted.node) == (
        InterruptionCause.EVICTION,
        straggler.rank,
        straggler.node,
    )
    assert evicted.reason.code is ReasonCode.EVICTION and evicted.lost_steps == 0
    recovered = [o for o in outputs if isinstance(o, InterruptionRecovered)]
    assert len(recovered) == 3 and all(r.restart_s < 5 for r in recovered)
    truth = {(f.kind, f.rank, f.node) for f in demo.truth()}
    assert {("crash", 13, "node-0001"), ("hang", 42, "node-0005")} <= truth
