"""Elastic training's decision in the pure core (processors/core/decisions/capacity.py, issue 45): a
node lost with no spare ready is decided on the interruption's InterruptionDecided (wait
for a replacement, or shrink), from the run's history where it has some, else the
policy's priors; a smaller world's grow-back is planned; goodput counts reduced width."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.goodput import total
from trainguard.processors.core.decisions.capacity_state import ElasticPolicy
from trainguard.schemas import (
    Interruption,
    InterruptionCause,
    InterruptionDecided,
    Page,
    Quarantine,
    QuarantineNode,
    ReasonCode,
    RunStarted,
)

POLICY = CorePolicy()


@dataclass
class ElasticJob(Job):
    """A Job whose attempts may run on fewer nodes (`layout`: the attempt's nodes in rank
    order) and whose launcher says how many spares it holds."""

    layout: list[str] | None = None
    spares: int | None = 0

    def node(self, rank: int) -> str:
        if self.layout is not None:
            return self.layout[rank // self.ranks_per_node]
        return super().node(rank)

    def start(self, resumed_from_step: int = -1) -> ElasticJob:
        super().start(resumed_from_step)
        started = self.events[-1]
        assert isinstance(started, RunStarted)
        nodes = [self.node(r) for r in range(0, self.world_size, self.ranks_per_node)]
        self.events[-1] = started.model_copy(update={"spares": self.spares, "nodes": nodes})
        return self

    def shrink_to(self, lost: str, resumed_from_step: int, delay_s: float = 60.0) -> ElasticJob:
        """The survivors go on without `lost`, renumbered over the nodes left."""
        full = [f"node-{i:03d}" for i in range(self.world_size // self.ranks_per_node)]
        self.layout = [n for n in full if n != lost]
        self.world_size = len(self.layout) * self.ranks_per_node
        self.restart(resumed_from_step, delay_s)
        return self

    def grow_to(self, world_size: int, replacement: str, resumed_from_step: int) -> ElasticJob:
        """A planned stop at a checkpoint: the ranks leave, the full world starts."""
        self.t += 1.0
        for r in range(self.world_size):
            self.exit(r, signal=15, requested=True)
        assert self.layout is not None
        self.layout = sorted([*self.layout, replacement])
        self.world_size = world_size
        self.restart(resumed_from_step, delay_s=30.0)
        return self


def lose_a_node(job: ElasticJob, rank: int = 9) -> ElasticJob:
    """45 steps, then rank `rank` dies (its node is quarantined: capacity lost)."""
    job.start().steps(45)
    job.exit(rank, signal=9)
    return job


def decisions(outputs: list) -> list[InterruptionDecided]:
    return [o for o in outputs if isinstance(o, InterruptionDecided)]


def test_a_node_lost_with_no_spare_and_no_history_shrinks_by_the_prior() -> None:
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0))
    _, outputs = run_all(job.events, POLICY)
    (crash,) = [o for o in outputs if isinstance(o, Interruption)]
    (decided,) = decisions(outputs)
    assert (decided.capacity, decided.world_size, decided.expected_replacement_s) == ("shrink", 56, 1800.0)
    assert decided.reason.code == ReasonCode.CAPACITY_SHRINK and decided.caused_by == [crash.event_id]
    # the rule's numbers: R is the policy's 600 s before any restart is measured
    for text in ("8 of 64 ranks lost", "1,800 s", "600 s restart = 2,400 s", "56 of 64 ranks (87.5%)"):
        assert text in decided.reason.text, text
    # what the decision follows is out before it: the quarantine that makes the node lost
    kinds = [o.KIND for o in outputs]
    assert kinds.index("quarantine_node") < kinds.index("interruption_decided")


def test_a_launcher_that_does_not_say_its_spares_gets_the_decision_if_none_is_ready() -> None:
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0, spares=None))
    (decided,) = decisions(run_all(job.events, POLICY)[1])
    assert decided.capacity == "shrink" and decided.reason.text.startswith("if no spare is ready: shrink")


def test_a_ready_spare_takes_the_place_no_capacity_decision() -> None:
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0, spares=1))
    _, outputs = run_all(job.events, POLICY)
    (decided,) = decisions(outputs)
    (crash,) = [o for o in outputs if isinstance(o, Interruption)]
    assert (decided.capacity, decided.world_size, decided.expected_replacement_s) == (None, None, None)
    assert decided.reason == crash.reason  # the go-ahead, as before issue 45


def test_elastic_off_waits_and_says_what_the_rule_would_have_done() -> None:
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0))
    off = CorePolicy(elastic=ElasticPolicy(enabled=False))
    (decided,) = decisions(run_all(job.events, off)[1])
    assert (decided.capacity, decided.world_size) == ("wait", None)
    assert decided.reason.code == ReasonCode.CAPACITY_WAIT
    assert decided.reason.text.startswith("wait: elastic training is off (policy elastic.enabled); the rule")


def test_below_the_minimum_world_waits() -> None:
    job = lose_a_node(ElasticJob(world_size=16, ranks_per_node=8, step_s=10.0))
    strict = CorePolicy(elastic=ElasticPolicy(min_world_fraction=0.75))
    (decided,) = decisions(run_all(job.events, strict)[1])
    assert decided.capacity == "wait" and "between the minimum 12 and the 8 survivors" in decided.reason.text


def test_the_runs_own_replacement_time_replaces_the_prior() -> None:
    """With restarts of a minute (R), the prior's 30-minute replacement shrinks; but this
    run's replacement came 90 s after the loss (the next attempt at full size): with that
    history the next loss waits, 90 + 60 s against re-forming twice (240 s)."""
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0))
    job.restart(resumed_from_step=40, delay_s=90.0)  # the replacement in, the full world back
    job.steps(30)
    job.exit(20, signal=9)
    quick = CorePolicy(eviction=CorePolicy().eviction.model_copy(update={"default_restart_s": 60.0}))
    state, outputs = run_all(job.events, quick)
    first, second = decisions(outputs)
    assert first.capacity == "shrink" and first.expected_replacement_s == 1800.0
    assert second.capacity == "wait" and second.expected_replacement_s == pytest.approx(90.0, abs=1.0)
    assert "a replacement expected in 90 s" in second.reason.text
    # a restart at full size after a capacity decision may have waited: no sample of R
    assert not state.runs[job.run_id].capacity.restart_s


def test_the_grow_back_is_planned_and_the_smaller_world_counts_its_width() -> None:
    """Shrunk to 56 of 64 ranks for 100 steps of 10 s, then grown back at a checkpoint:
    the grow-back is an ELASTIC interruption caused by the loss (no page, no quarantine),
    and goodput charges (1 - 56/64) of the time trained at 56 ranks."""
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0))
    job.shrink_to("node-001", resumed_from_step=40)
    job.steps(100)
    job.grow_to(64, "spare-000", resumed_from_step=140)
    job.steps(20)
    state, outputs = run_all(job.events, POLICY)
    loss, grow = [o for o in outputs if isinstance(o, Interruption)]
    assert grow.cause == InterruptionCause.ELASTIC and grow.caused_by == [loss.interruption_id]
    assert grow.reason.code == ReasonCode.CAPACITY_GROW and "from 56 to 64 of 64 ranks" in grow.reason.text
    grown_decided = decisions(outputs)[-1]
    assert grown_decided.caused_by == [grow.event_id] and grown_decided.capacity is None
    after = [o for o in outputs if getattr(o, "ts", getattr(o, "issued_ts", 0.0)) >= grow.ts]
    assert not any(isinstance(o, Page | Quarantine | QuarantineNode) for o in after)
    run = state.runs[job.run_id]
    assert run.capacity.full_world == 64 and run.world_size == 64 and run.capacity.shrunk_by == ""
    b = total(run.goodput)
    # ~100 steps of 10 s at 56 ranks (steps jitter 5%): 1/8 of ~1,000 s
    assert b.narrow == pytest.approx(1000 * 8 / 64, rel=0.1)
    assert b.goodput < 1 - b.narrow / b.elapsed + 1e-9
    # the shrink's recovery measured the shrink, the grow's the grow: neither is a sample of R
    assert list(run.capacity.shrink_s) and list(run.capacity.grow_s) and not run.capacity.restart_s


def test_a_world_the_launcher_shrank_on_its_own_grows_back_as_planned() -> None:
    """Across hosts the survivors may go on smaller before the processor decides (or with
    a spare said to be ready, no decision at all): the grow-back is still planned, caused
    by the loss the smaller world restarted after."""
    job = lose_a_node(ElasticJob(world_size=64, ranks_per_node=8, step_s=10.0, spares=1))
    job.shrink_to("node-001", resumed_from_step=40)
    job.steps(30)
    job.grow_to(64, "spare-000", resumed_from_step=70)
    job.steps(5)
    _, outputs = run_all(job.events, POLICY)
    assert [d.capacity for d in decisions(outputs)] == [None, None]
    loss, grow = [o for o in outputs if isinstance(o, Interruption)]
    assert grow.cause == InterruptionCause.ELASTIC and grow.caused_by == [loss.interruption_id]
