"""Elastic training scored (issue 45): one scenario whose lost node's replacement takes time
(Scenario.replacement_s) run twice through the pure core in a closed loop, once with
elastic training off (the launcher waits for the replacement) and once with the policy as
given (the core's rule may shrink), and the goodput of each: the core's own accounting
over the whole run (processors/core/accounting/goodput.py: a second at W' of W ranks counts W'/W),
the time the run took to train its steps, and its score (harness/scoring/evaluate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.processors.core import CorePolicy
from trainguard.processors.core.accounting.goodput import total
from trainguard.producers.simulator import Scenario
from trainguard.schemas import InterruptionDecided

from .evaluate import ClosedLoop, ScenarioScore, closed_loop, score_loop


@dataclass(frozen=True)
class CapacityRun:
    """One policy's run of an elastic scenario."""

    policy: str  # "wait" (elastic off) or "shrink" (elastic on: the rule may shrink)
    goodput: float
    elapsed_s: float  # the run's time, first event to last, as the core counted it
    restart_s: float  # down: detection to the next attempt's first step
    narrow_s: float  # trained at a smaller world: (1 - W'/W) of that time
    lost_s: float  # work re-done
    steps: int  # the scenario's steps, all trained (when finished)
    finished: bool
    decisions: tuple[str, ...]  # the capacity decisions, each "capacity: reason"
    score: ScenarioScore

    @property
    def failed(self) -> bool:
        return self.score.failed or not self.finished


@dataclass(frozen=True)
class CapacityComparison:
    scenario: str
    world_size: int
    replacement_s: float
    wait: CapacityRun
    shrink: CapacityRun

    @property
    def gain(self) -> float:
        """Goodput points shrinking gains over waiting."""
        return self.shrink.goodput - self.wait.goodput


def elastic_off(policy: CorePolicy) -> CorePolicy:
    """`policy` with elastic training off: every capacity decision waits."""
    return policy.model_copy(update={"elastic": policy.elastic.model_copy(update={"enabled": False})})


def run_policy(
    scenario: Scenario, policy: CorePolicy, name: str, shard_ranks: int = 0, workers: int = 1
) -> CapacityRun:
    loop = closed_loop(scenario, policy, shard_ranks=shard_ranks, workers=workers)
    return _outcome(scenario, loop, name)


def compare_capacity(
    scenario: Scenario, policy: CorePolicy, shard_ranks: int = 0, workers: int = 1
) -> CapacityComparison:
    """`scenario` with elastic training off ("wait") and under `policy` ("shrink" where
    its rule says so), each through the pure core in a closed loop (harness/scoring/evaluate.py)."""
    wait = run_policy(scenario, elastic_off(policy), "wait", shard_ranks, workers)
    shrink = run_policy(scenario, policy, "shrink", shard_ranks, workers)
    return CapacityComparison(scenario.name, scenario.world_size, scenario.replacement_s, wait, shrink)


def capacity_json(comparisons: list[CapacityComparison]) -> list[dict[str, object]]:
    """Each comparison as plain data (`trainguard evaluate --json`: its "capacity" list)."""
    return [
        {
            "scenario": c.scenario,
            "world_size": c.world_size,
            "replacement_s": c.replacement_s,
            **{
                run.policy: {
                    "goodput": run.goodput,
                    "elapsed_s": run.elapsed_s,
                    "restart_s": run.restart_s,
                    "narrow_s": run.narrow_s,
                    "lost_s": run.lost_s,
                    "finished": run.finished,
                    "failed": run.failed,
                    "decisions": list(run.decisions),
                }
                for run in (c.wait, c.shrink)
            },
        }
        for c in comparisons
    ]


def _outcome(scenario: Scenario, loop: ClosedLoop, name: str) -> CapacityRun:
    run = loop.states[0].runs[loop.cluster.run_id]
    b = total(run.goodput)
    decided = tuple(
        f"{o.capacity}: {o.reason.text}"
        for o in loop.outputs
        if isinstance(o, InterruptionDecided) and o.capacity is not None
    )
    return CapacityRun(
        name,
        b.goodput,
        b.elapsed,
        b.restart,
        b.narrow,
        b.lost,
        scenario.steps,
        loop.cluster.phase.value == "finished",
        decided,
        score_loop(scenario, loop),
    )
