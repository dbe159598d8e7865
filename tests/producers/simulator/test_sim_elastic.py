"""The simulated launcher's elastic side (producers/simulator/capacity.py, issue 45): a node
quarantined with its replacement `replacement_s` away; under "wait" the job is down until
it arrives plus a restart, under "shrink" the survivors go on at once in a smaller world
(each step W/W' as long) and grow back at the first checkpoint after it arrives; with no
decision the launcher applies the shared rule itself."""

from __future__ import annotations

import statistics

import pytest

from trainguard.producers.simulator import Phase, Scenario, SimulatedCluster
from trainguard.schemas import (
    Abort,
    Command,
    Envelope,
    InterruptionDecided,
    QuarantineNode,
    RankExit,
    RunStarted,
    StepTiming,
)

from .simkit import T0, command, make_cluster, of, run

#: 64 ranks on 8 nodes, 1 s steps, a checkpoint every 20; rank 13 (node-0001) dies at step
#: 30 and its replacement takes 300 s.
SCENARIO = Scenario.parse(
    dict(
        name="elastic-small",
        world_size=64,
        ranks_per_node=8,
        nodes_per_rack=4,
        step_time_s=1.0,
        jitter=0.0,
        steps=600,
        checkpoint_every=20,
        checkpoint_validate_s=1.0,
        restart_delay_s=5.0,
        replacement_s=300.0,
        faults=[{"kind": "crash", "rank": 13, "at_step": 30}],
    )
)


class Launcher:
    """Stands for the processor: on the crash, abort, quarantine the node and decide
    `capacity` (None: never answer)."""

    def __init__(self, capacity: str | None, world: int | None = None) -> None:
        self.capacity, self.world = capacity, world

    def __call__(self, c: SimulatedCluster, events: list[Envelope]) -> list[Command]:
        crashed = [e for e in of(RankExit, events) if not e.requested]
        if not crashed:
            return []
        out: list[Command] = [
            command(Abort, c, stack_dump=False),
            command(QuarantineNode, c, node=crashed[0].node),
        ]
        if self.capacity is not None:
            decision = dict(capacity=self.capacity, world_size=self.world, expected_replacement_s=300.0)
            out.append(command(InterruptionDecided, c, interruption_id="i-1", **decision))
        return out


def started(events: list[Envelope]) -> list[RunStarted]:
    return of(RunStarted, events)


def test_shrink_goes_on_at_once_in_a_smaller_world_and_grows_back_at_a_checkpoint() -> None:
    c = make_cluster(SCENARIO, validate=False)
    events = run(c, controller=Launcher("shrink", 56))
    first, shrunk, grown = started(events)
    assert (first.world_size, shrunk.world_size, grown.world_size) == (64, 56, 64)
    assert first.spares == shrunk.spares == 0  # no spare: replacements take time
    # at once: the next attempt launches a restart delay after the crash, without node-0001
    crash_ts = next(e.ts for e in of(RankExit, events) if not e.requested)
    assert shrunk.ts == pytest.approx(crash_ts + 5.0, abs=0.2)
    assert "node-0001" not in shrunk.nodes and len(shrunk.nodes) == 7

    # the same global batch over 56 ranks: every step 64/56 as long
    def step_s(attempt: int) -> float:
        return statistics.median(t.total_s for t in of(StepTiming, events) if t.attempt == attempt)

    assert step_s(1) == pytest.approx(step_s(0) * 64 / 56, rel=0.02)
    assert {t.rank for t in of(StepTiming, events) if t.attempt == 1} == set(range(56))
    # grown back at the first checkpoint after the replacement arrived (300 s after the loss)
    arrived = next(n.ts for n in c.notes if "arrived" in n.text)
    assert arrived == pytest.approx(crash_ts + 300.0, abs=0.2) and grown.ts > arrived
    assert grown.resumed_from_step % 20 == 0 and grown.ts - arrived < 20 * 64 / 56 + 10
    assert "spare-0000" in grown.nodes and grown.nodes.index("spare-0000") == 1  # the node's place
    assert step_s(2) == pytest.approx(step_s(0), rel=0.02)
    assert c.phase is Phase.FINISHED


def test_wait_stays_down_until_the_replacement_then_restarts() -> None:
    c = make_cluster(SCENARIO, validate=False)
    events = run(c, controller=Launcher("wait"))
    first, again = started(events)
    crash_ts = next(e.ts for e in of(RankExit, events) if not e.requested)
    assert again.world_size == 64 and again.ts == pytest.approx(crash_ts + 300.0 + 5.0, abs=0.2)
    assert not [t for t in of(StepTiming, events) if crash_ts < t.ts < again.ts]
    assert "spare-0000" in again.nodes
    assert any("waiting for the replacement" in n.text for n in c.notes)


def test_a_processor_that_does_not_answer_leaves_the_rule_to_the_launcher() -> None:
    c = make_cluster(SCENARIO, validate=False)
    events = run(c, controller=Launcher(None))
    first, shrunk, grown = started(events)
    crash_ts = next(e.ts for e in of(RankExit, events) if not e.requested)
    # it waited decision_wait_s (30 s) for the decision, then shrank by the rule
    assert shrunk.world_size == 56 and shrunk.ts == pytest.approx(crash_ts + 5.0 + 30.0, abs=0.2)
    ((attempt, action, reason),) = c.capacity.own
    assert (attempt, action) == (0, "shrink") and "56 of 64 ranks" in reason
    assert grown.world_size == 64


def test_a_spare_at_hand_restarts_at_full_size_whatever_the_decision() -> None:
    """replacement_s 0 (every scenario before issue 45): a spare takes the node's place."""
    c = make_cluster(SCENARIO.model_copy(update={"replacement_s": 0.0}), validate=False)
    events = run(c, controller=Launcher("shrink", 56))
    assert [s.world_size for s in started(events)] == [64, 64]
    assert started(events)[0].spares == SCENARIO.node_count
    assert c.now < T0 + 700
