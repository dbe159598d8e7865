"""The simulator against the real policy core, in-process: the events it emits are the
ones the processors' detectors were written for, and its reactions to their commands
close the loop (crash -> abort -> restart; hang -> stack-dump abort -> odd stack)."""

from __future__ import annotations

from harness.devtools.stack import builtin_policy
from trainguard.processors.core import engine
from trainguard.processors.core.decisions.paging_state import PagingPolicy
from trainguard.processors.core.policy import CorePolicy, load_policy
from trainguard.processors.core.state import CoreState
from trainguard.producers.simulator import Phase, Scenario, SimulatedCluster
from trainguard.schemas import (
    Command,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    Page,
    PauseRun,
    Quarantine,
    QuarantineReleased,
    ReasonCode,
    ReleaseNode,
    Rollback,
    SdcMismatch,
    SkipUpdate,
)


def close_loop(
    scenario: Scenario, policy: CorePolicy, run_id: str, id_prefix: str, until_s: float
) -> tuple[SimulatedCluster, list]:
    """The simulator and the core in a closed loop from t=1,000 s: every command the core
    sends is applied to the cluster and its events fed back, until the run is done or
    `until_s` (the simulated clock). Returns the cluster and every output, in order."""
    cluster = SimulatedCluster(scenario, 1_000.0, run_id=run_id, id_prefix=id_prefix)
    state = CoreState()
    outputs: list = []

    def feed(events: list) -> None:
        nonlocal state
        for event in events:
            state, out = engine.step(state, event, policy, scenario.world_size)
            for item in out:
                outputs.append(item)
                if isinstance(item, Command):
                    feed(cluster.apply(item).events)

    t = 1_000.0
    while not cluster.done and t < until_s:
        t += 0.05
        feed(cluster.advance(t))
    return cluster, outputs


def test_demo_scenario_closes_the_loop_with_the_policy_core() -> None:
    demo = Scenario.builtin("demo")
    cluster, outputs = close_loop(demo, CorePolicy(), "demo-run", "d", 1_300)

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


def run_data_fault(policy: CorePolicy) -> tuple[SimulatedCluster, list]:
    return close_loop(Scenario.library()["data-fault-repeat"], policy, "data-run", "f", 1_400)


def test_a_data_fault_pauses_the_run_and_frees_the_node_it_first_blamed() -> None:
    """The library's data fault (rank 77 dies in step 237 on every attempt): the first
    failure quarantines node-0009 (nobody can tell yet), the second, on the spare, is the
    pattern: one same_step page, the run paused (not restarted into step 237 until
    max_restarts), node-0009 released; no same_node page blames the spare."""
    cluster, outputs = run_data_fault(CorePolicy())
    assert cluster.done and cluster.paused is not None and cluster.attempt == 1
    crashes = [o for o in outputs if isinstance(o, Interruption)]
    assert [(c.rank, c.node, c.step) for c in crashes] == [(77, "node-0009", 236), (77, "spare-0000", 236)]
    assert [p.rule for p in outputs if isinstance(p, Page)] == ["same_step"]
    (pause,) = [o for o in outputs if isinstance(o, PauseRun)]
    assert (
        pause.step == 237
        and "step 237 failed 2 times on 2 different nodes: data or code" in pause.reason.text
    )
    assert [q.node for q in outputs if isinstance(q, Quarantine)] == ["node-0009"]
    assert [r.node for r in outputs if isinstance(r, QuarantineReleased | ReleaseNode)] == ["node-0009"] * 2


def test_under_the_skip_policy_the_data_fault_is_skipped_and_the_run_finishes() -> None:
    policy = CorePolicy(paging=PagingPolicy(on_repeat_step="skip"))
    cluster, outputs = run_data_fault(policy)
    assert cluster.phase is Phase.FINISHED and cluster.paused is None and cluster.skipped_updates == [237]
    assert len([o for o in outputs if isinstance(o, Interruption)]) == 2
    assert [o.step for o in outputs if isinstance(o, SkipUpdate)] == [237]
    assert [r.node for r in outputs if isinstance(r, ReleaseNode)] == ["node-0009"]


def test_a_wrong_gpu_is_found_by_the_ring_and_rolled_back_behind_its_onset() -> None:
    """The library's deterministically wrong GPU under the evaluate policy (a ring every
    200 steps): named at the first ring after its onset, and the run goes back to a
    checkpoint before the onset, not to one a later passing self-check seemed to vouch for."""
    scenario = Scenario.library()["sdc-wrong-gpu"]
    (fault,) = scenario.faults
    until = 1_000 + 3 * scenario.steps * scenario.step_time_s
    cluster, outputs = close_loop(
        scenario, load_policy(str(builtin_policy("evaluate"))), "ring-run", "w", until
    )

    (found,) = [o for o in outputs if isinstance(o, SdcMismatch)]
    assert (found.rank, found.method) == (fault.rank, "ring")
    assert fault.at_step < found.step <= fault.at_step + 200 + 1  # within one ring interval
    (rollback,) = [o for o in outputs if isinstance(o, Rollback)]
    assert rollback.checkpoint_step <= fault.at_step
    assert f"cross-rank check that covered rank {fault.rank}" in rollback.reason.text
    assert cluster.done and cluster.ring_checks_run >= 3 and cluster.attempt == 1
