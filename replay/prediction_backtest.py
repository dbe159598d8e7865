"""Failure prediction in a backtest (issue 46): prediction policies compared on a recorded
run (`trainguard backtest`, replay/backtest.py), e.g. policies that differ in
prediction.enabled, horizon_s or false_alarms_per_node_day.

A backtest is open loop: a node the candidate drains goes on reporting in the recording,
and fails there if it failed in the run. So the recording's failures are the truth the
drains are judged against: an interruption the baseline's replay attributes to a node (a
crash, a hang, SDC; not a planned stop) is that node's failure. For each policy:

- **drains**: its DrainNode commands (one per node);
- **precise**: the drained node failed in the recording within the horizon after the
  drain's decision; the rest are false drains (also per 1,000 node-days of the run);
- **failures drained**: the recording's failures whose node the policy drained at least
  ``drain_within_s`` before they struck (the boundary comes within it), over all the
  recording's failures; **lead**: the drain's decision to the failure;
- **value** of a drain (the cost model's rule, replay/cost_model.py's terms measured on
  the recording): a drain that takes out a node before its failure saves that failure's
  restart R and its lost work (the recording's InterruptionRecovered), less the drain's
  checkpoint C and swap (the policy's drain_swap_prior_s); one whose failure struck first
  (within ``drain_within_s``) is worth nothing; one of a node that never failed costs C +
  swap. A node the baseline drained never failed in the recording (it left): open loop,
  the backtest cannot see the failure it took away, so its value is what the same rule
  gives (C + swap spent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..processors.core import CorePolicy
from ..schemas import DrainNode, FailurePredicted, Interruption, InterruptionRecovered
from .cost_model import RunFacts
from .drain_rates import DrainRates
from .replay import Replayed

#: Interruption causes that are a node's failure (not a planned stop, not an operator's).
FAILURE_CAUSES = frozenset({"crash", "hang", "sdc"})
_DAY = 86_400.0


@dataclass(frozen=True)
class RecordedFailure:
    node: str
    ts: float
    lost_s: float  # the work its restart re-did (InterruptionRecovered), 0 when never recovered


@dataclass(frozen=True)
class DrainValue:
    node: str
    decided_ts: float
    failure_ts: float | None  # the node's next failure in the recording
    value_s: float  # seconds of the whole job the drain saves (negative: costs)
    rule: str


@dataclass(frozen=True)
class PredictionBacktest(DrainRates):
    """One policy's prediction numbers on the recording (module docstring)."""

    predictions: int
    drains: tuple[DrainValue, ...]
    precise: int
    failures: int  # the recording's failures
    drained: int  # of which the policy drained before they struck
    leads_s: tuple[float, ...]
    node_days: float

    @property
    def false_drains(self) -> int:
        return len(self.drains) - self.precise

    @property
    def precision(self) -> float | None:
        return self.precise / len(self.drains) if self.drains else None

    @property
    def recall(self) -> float | None:
        return self.drained / self.failures if self.failures else None

    @property
    def value_s(self) -> float:
        return sum(d.value_s for d in self.drains)


def recorded_failures(baseline: Replayed) -> list[RecordedFailure]:
    """The recording's failures by node, in time order, as the baseline's replay found them."""
    lost = {r.interruption_id: r.lost_s for r in baseline.derived if isinstance(r, InterruptionRecovered)}
    return sorted(
        (
            RecordedFailure(d.node, d.ts, lost.get(d.interruption_id, 0.0))
            for d in baseline.derived
            if isinstance(d, Interruption) and d.cause.value in FAILURE_CAUSES and d.node
        ),
        key=lambda f: f.ts,
    )


def drain_value(
    node: str, decided_ts: float, failures: list[RecordedFailure], facts: RunFacts, policy: CorePolicy
) -> DrainValue:
    """What draining `node` at `decided_ts` is worth against the recording (module docstring)."""
    cost = facts.checkpoint_s + policy.prediction.drain_swap_prior_s
    within = policy.prediction.drain_within_s
    failure = next((f for f in failures if f.node == node and f.ts > decided_ts), None)
    if failure is None:
        return DrainValue(
            node, decided_ts, None, -cost, f"drain: {node} never failed: C + swap {cost:,.0f} s"
        )
    if failure.ts < decided_ts + within:
        rule = f"drain: {node} failed {failure.ts - decided_ts:,.0f} s later, before the boundary: nothing"
        return DrainValue(node, decided_ts, failure.ts, 0.0, rule)
    value = facts.restart_s + failure.lost_s - cost
    rule = (
        f"drain: {node} failed {failure.ts - decided_ts:,.0f} s later: R {facts.restart_s:,.0f} s + "
        f"lost {failure.lost_s:,.0f} s - C + swap {cost:,.0f} s"
    )
    return DrainValue(node, decided_ts, failure.ts, value, rule)


def backtest_prediction(
    run: Replayed,
    failures: list[RecordedFailure],
    facts: RunFacts,
    policy: CorePolicy,
    nodes: int,
) -> PredictionBacktest:
    """A policy's replay scored against the recording's failures (module docstring)."""
    drains: dict[str, DrainValue] = {}
    for command in run.commands:
        if isinstance(command, DrainNode) and command.node not in drains:
            drains[command.node] = drain_value(command.node, command.issued_ts, failures, facts, policy)
    horizon = policy.prediction.horizon_s
    precise = sum(
        d.failure_ts is not None and d.failure_ts - d.decided_ts <= horizon for d in drains.values()
    )
    within = policy.prediction.drain_within_s
    leads = []
    for failure in failures:
        drain = drains.get(failure.node)
        if drain is not None and drain.failure_ts == failure.ts and failure.ts >= drain.decided_ts + within:
            leads.append(failure.ts - drain.decided_ts)
    return PredictionBacktest(
        predictions=sum(isinstance(d, FailurePredicted) for d in run.derived),
        drains=tuple(drains.values()),
        precise=precise,
        failures=len(failures),
        drained=len(leads),
        leads_s=tuple(leads),
        node_days=nodes * facts.elapsed_s / _DAY,
    )


def node_count(world_size: int, ranks_per_node: int) -> int:
    return math.ceil(world_size / max(1, ranks_per_node))
