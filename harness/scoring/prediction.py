"""Failure prediction scored (issue 46): each fleet scenario of the library (precursor and
noise runs, producers/simulator/fleet_scenario.py) through the pure core twice with the
same seed, prediction on (the policy's prediction section, enabled) and off
(``prediction.enabled: false``), against the run's ground truth (fleet_truth.py).

Definitions (`horizon` is the policy's prediction.horizon_s):

- **precision**: drains of a node that would have failed within the horizon of the drain's
  decision (a foretold failure bound to it, fleet_truth.py) / all drains;
- **recall**: precursor-preceded failures drained before they struck / all
  precursor-preceded failures of the run (those that struck or were drained; a failure
  whose node left the job for another reason is neither); **recall over all failures**:
  the same over every failure, foretold or not;
- **lead time**: from the drain's decision to when its failure would have struck, median
  and 10th percentile over the drained failures;
- **false drains**: all drains but the precise ones (of which *early*: the node would
  have failed, later than the horizon), and per 1,000 node-days of the scenario;
- **goodput gained**: the productive time of the run with prediction on minus the same
  run's with it off, from the truth (elapsed less checkpoints, lost work, restarts,
  stalls, drains), in seconds of the whole job and in goodput points; and the same from
  the core's own accounting (the month window of its GoodputReport, replay/longrun.py).

The same seed draws the same failures in both runs (the plan is drawn apart from the
noise and from every decision); only those a drain took away differ.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from trainguard.processors.core import engine
from trainguard.processors.core.accounting.goodput import Breakdown, breakdown
from trainguard.processors.core.outputs import Forward, Reject
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.core.state import CoreState
from trainguard.producers.simulator.fleet import simulate_fleet
from trainguard.producers.simulator.fleet_scenario import FleetScenario
from trainguard.producers.simulator.fleet_truth import FleetTruth
from trainguard.replay.drain_rates import DrainRates
from trainguard.replay.longrun import MONTH_S, month_policy
from trainguard.schemas import Command, DrainDecision, Envelope, FailurePredicted


def prediction_off(policy: CorePolicy) -> CorePolicy:
    """`policy` with failure prediction off: nothing predicted, nothing drained."""
    return _prediction(policy, False)


def prediction_on(policy: CorePolicy) -> CorePolicy:
    """`policy` with failure prediction on (its prediction section as it is otherwise)."""
    return _prediction(policy, True)


def _prediction(policy: CorePolicy, enabled: bool) -> CorePolicy:
    section = policy.prediction.model_copy(update={"enabled": enabled})
    return policy.model_copy(update={"prediction": section})


@dataclass
class FleetRun:
    """One policy's run of a fleet scenario through the pure core."""

    policy: str  # "on" | "off"
    truth: FleetTruth
    measured: Breakdown  # the core's goodput accounting over the whole run
    predictions: int = 0  # FailurePredicted
    decisions: list[DrainDecision] = field(default_factory=list)
    commands: Counter[str] = field(default_factory=Counter)
    events: int = 0
    seconds: float = 0.0  # wall time of the run

    @property
    def drains(self) -> int:
        return len(self.truth.drains)


def run_fleet(scenario: FleetScenario, policy: CorePolicy, name: str) -> FleetRun:
    """`scenario` through `engine.step` (one unsharded core, as replay/longrun.py drives a
    run-level simulation), the core's commands applied to the run."""
    policy = month_policy(policy)
    state = CoreState()
    run_id = f"fleet-{scenario.name}-{name}"
    out = FleetRun(name, FleetTruth(), Breakdown(MONTH_S, 0.0, 0.0, 0.0, 0.0, 0.0))

    def core(event: Envelope) -> list[Command]:
        out.events += 1
        _, outputs = engine.step(state, event, policy)
        commands: list[Command] = []
        for item in outputs:
            if isinstance(item, Forward | Reject):
                continue
            if isinstance(item, Command):
                commands.append(item)
                out.commands[item.KIND] += 1
            elif isinstance(item, FailurePredicted):
                out.predictions += 1
            elif isinstance(item, DrainDecision):
                out.decisions.append(item)
        return commands

    started = time.perf_counter()
    out.truth = simulate_fleet(scenario, core, interval_s=policy.interval.initial_s, run_id=run_id)
    out.seconds = time.perf_counter() - started
    goodput = state.runs[run_id].goodput
    end = out.truth.start_ts + out.truth.elapsed_s
    out.measured = breakdown(goodput, goodput.clock or end, MONTH_S)
    return out


@dataclass(frozen=True)
class PredictionScore(DrainRates):
    """A fleet scenario's prediction numbers (module docstring), on against off."""

    scenario: str
    world_size: int
    node_days: float
    noise_only: bool
    horizon_s: float
    drains: int
    precise: int  # the node would have failed within the horizon
    early: int  # the node would have failed, beyond the horizon
    late: int  # precise, but the node failed before the drain's boundary
    foretold: int  # precursor-preceded failures of the run
    foretold_drained: int
    failures: int  # every failure of the run (struck or drained)
    drained: int
    leads_s: tuple[float, ...]
    on_goodput: float
    off_goodput: float
    gained_s: float  # productive seconds of the whole job, on minus off
    core_on_goodput: float
    core_off_goodput: float
    off_drains: int  # drains with prediction off (must be 0)
    same_failures: bool  # both runs drew the same failures

    @property
    def false_drains(self) -> int:
        return self.drains - self.precise

    @property
    def precision(self) -> float | None:
        return self.precise / self.drains if self.drains else None

    @property
    def recall(self) -> float | None:
        return self.foretold_drained / self.foretold if self.foretold else None

    @property
    def recall_all(self) -> float | None:
        return self.drained / self.failures if self.failures else None

    @property
    def gained_points(self) -> float:
        """Goodput points gained (percent of the run's time)."""
        return 100.0 * (self.on_goodput - self.off_goodput)

    @property
    def failed(self) -> bool:
        """A harm: a drain on healthy noise, a drain with prediction off, or runs that met
        different failures."""
        return (self.noise_only and self.drains > 0) or self.off_drains > 0 or not self.same_failures


def score_prediction(
    scenario: FleetScenario, horizon_s: float, on: FleetRun, off: FleetRun
) -> PredictionScore:
    """The scoring arithmetic (module docstring) on two runs of `scenario`."""
    truth = on.truth
    counted = [f for f in truth.failures if truth.in_run(f) and f.outcome in ("struck", "drained")]
    foretold = [f for f in counted if f.precursor is not None]
    drained = [f for f in counted if f.outcome == "drained"]
    precise = sum(d.would_fail_within(horizon_s) for d in truth.drains)
    early = sum(d.failure_ts is not None and not d.would_fail_within(horizon_s) for d in truth.drains)
    plan = [(f.ts, f.slot, f.gpu, f.kind, f.precursor) for f in truth.failures]
    same = plan == [(f.ts, f.slot, f.gpu, f.kind, f.precursor) for f in off.truth.failures]
    return PredictionScore(
        scenario=scenario.name,
        world_size=scenario.fleet.world_size,
        node_days=scenario.fleet.node_days,
        noise_only=scenario.noise_only,
        horizon_s=horizon_s,
        drains=len(truth.drains),
        precise=precise,
        early=early,
        late=sum(d.late for d in truth.drains),
        foretold=len(foretold),
        foretold_drained=sum(f.outcome == "drained" for f in foretold),
        failures=len(counted),
        drained=len(drained),
        leads_s=tuple(f.gained_s for f in drained if f.gained_s is not None),
        on_goodput=truth.goodput,
        off_goodput=off.truth.goodput,
        gained_s=truth.productive_s - off.truth.productive_s,
        core_on_goodput=on.measured.goodput,
        core_off_goodput=off.measured.goodput,
        off_drains=off.drains + off.commands["drain_node"],
        same_failures=same,
    )


@dataclass(frozen=True)
class PredictionComparison:
    score: PredictionScore
    on: FleetRun
    off: FleetRun


def compare_prediction(scenario: FleetScenario, policy: CorePolicy) -> PredictionComparison:
    """`scenario` with prediction on and off (the same seed), scored."""
    on = run_fleet(scenario, prediction_on(policy), "on")
    off = run_fleet(scenario, prediction_off(policy), "off")
    return PredictionComparison(score_prediction(scenario, policy.prediction.horizon_s, on, off), on, off)


def prediction_json(comparisons: list[PredictionComparison]) -> list[dict[str, object]]:
    """Each comparison as plain data (`trainguard evaluate --json`: its "prediction" list)."""
    out: list[dict[str, object]] = []
    for c in comparisons:
        s = c.score
        out.append(
            {
                "scenario": s.scenario,
                "world_size": s.world_size,
                "node_days": s.node_days,
                "noise_only": s.noise_only,
                "failed": s.failed,
                "drains": s.drains,
                "precise": s.precise,
                "early": s.early,
                "late": s.late,
                "false_drains": s.false_drains,
                "false_per_1000_node_days": s.false_per_1000_node_days,
                "precision": s.precision,
                "recall": s.recall,
                "recall_all": s.recall_all,
                "foretold": s.foretold,
                "failures": s.failures,
                "lead_median_s": s.lead_median_s,
                "lead_p10_s": s.lead_p10_s,
                "goodput_on": s.on_goodput,
                "goodput_off": s.off_goodput,
                "gained_s": s.gained_s,
                "gained_points": s.gained_points,
                "core_goodput_on": s.core_on_goodput,
                "core_goodput_off": s.core_off_goodput,
                "predictions": c.on.predictions,
                "declined": sum(d.decision == "decline" for d in c.on.decisions),
                "recall_by": recall_breakdown(c.on.truth),
                "truth": truth_json(c.on.truth),
            }
        )
    return out


#: Lead buckets (minutes) of the recall breakdown.
LEAD_BUCKETS_MIN = (20, 40, 80)


def recall_breakdown(truth: FleetTruth) -> dict[str, dict[str, list[int]]]:
    """Precursor-preceded failures of the run, [drained, all], by precursor kind and by
    lead (minutes: "<20", "20-40", "40-80", ">=80")."""
    edges = LEAD_BUCKETS_MIN
    names = [
        f"<{edges[0]}",
        *(f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:], strict=False)),
        f">={edges[-1]}",
    ]
    by_kind: dict[str, list[int]] = {}
    by_lead: dict[str, list[int]] = {name: [0, 0] for name in names}
    for f in truth.failures:
        if f.precursor is None or not truth.in_run(f) or f.outcome not in ("struck", "drained"):
            continue
        lead = names[sum(f.lead_s / 60 >= e for e in edges)]
        for table, key in ((by_kind, f.precursor), (by_lead, lead)):
            row = table.setdefault(key, [0, 0])
            row[0] += f.outcome == "drained"
            row[1] += 1
    return {"kind": by_kind, "lead_min": by_lead}


def truth_json(truth: FleetTruth) -> dict[str, object]:
    """The run's failures (in the run) and drains, one record each (the bench's JSON)."""
    start = truth.start_ts
    return {
        "failures": [
            {
                "id": f.id,
                "at_s": f.ts - start,
                "kind": f.kind,
                "precursor": f.precursor,
                "lead_s": f.lead_s,
                "outcome": f.outcome,
                "node": f.node,
                "gained_s": f.gained_s,
            }
            for f in truth.failures
            if truth.in_run(f)
        ],
        "drains": [
            {
                "node": d.node,
                "at_s": d.decided_ts - start,
                "failure": d.failure,
                "failure_in_s": None if d.failure_ts is None else d.failure_ts - d.decided_ts,
                "late": d.late,
                "false_episode": d.false_episode,
            }
            for d in truth.drains
        ],
    }


#: The issue's acceptance (issue 46): precursor-preceded failures drained before they
#: strike, false drains per 1,000 node-days over the noise scenarios.
RECALL_TARGET = 0.70
FALSE_PER_1000_TARGET = 1.0


def acceptance_lines(scores: list[PredictionScore]) -> list[str]:
    """The acceptance over the scored scenarios, one line each, with PASS or FAIL (only the
    criteria whose scenarios were scored)."""
    lines: list[str] = []
    foretold = [s for s in scores if s.foretold]
    if foretold:
        drained, total = sum(s.foretold_drained for s in foretold), sum(s.foretold for s in foretold)
        verdict = "PASS" if drained >= RECALL_TARGET * total else "FAIL"
        lines.append(
            f"{verdict} precursor-preceded failures drained before they struck: {drained} of {total} "
            f"({drained / total:.0%}; target >= {RECALL_TARGET:.0%}) over {len(foretold)} scenario(s)"
        )
    noise = [s for s in scores if s.noise_only]
    if noise:
        false, days = sum(s.false_drains for s in noise), sum(s.node_days for s in noise)
        rate = 1000.0 * false / days
        verdict = "PASS" if rate <= FALSE_PER_1000_TARGET else "FAIL"
        lines.append(
            f"{verdict} false drains over the noise scenarios: {false} in {days:,.0f} node-days "
            f"({rate:.2f} per 1,000; target <= {FALSE_PER_1000_TARGET:g})"
        )
        named = [f"{s.scenario} ({s.drains})" for s in noise if s.drains]
        verdict = "PASS" if not named else "FAIL"
        lines.append(
            f"{verdict} no drain on any noise-only scenario" + (f": {', '.join(named)}" if named else "")
        )
    for s in scores:
        lines.append(
            f"{s.scenario}: net goodput gained {s.gained_s:+,.0f} s of the job "
            f"({s.gained_points:+.2f} points: {s.off_goodput:.4f} -> {s.on_goodput:.4f}; "
            f"the core's accounting {s.core_off_goodput:.4f} -> {s.core_on_goodput:.4f})"
        )
    return lines
