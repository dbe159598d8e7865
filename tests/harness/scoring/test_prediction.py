"""Failure prediction scored (harness/scoring/prediction.py, issue 46): the scoring's arithmetic on
a hand-made truth, prediction off draining nothing, the same seed meeting the same
failures with prediction on and off, healthy noise drained never, `trainguard evaluate`
on a fleet scenario, and `trainguard backtest` comparing prediction policies on a
recorded fleet run (replay/prediction_backtest.py). Small fleets, a day at most: the
library's 1,024- and 16,384-rank runs are bench/bench_prediction.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.devtools.stack import builtin_policy
from harness.scoring.prediction import (
    FleetRun,
    acceptance_lines,
    compare_prediction,
    prediction_off,
    recall_breakdown,
    run_fleet,
    score_prediction,
)
from trainguard.cli import app
from trainguard.processors.core.accounting.goodput import Breakdown
from trainguard.processors.core.policy import load_policy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.rank.shipper import pack
from trainguard.producers.simulator import fleet_scenario
from trainguard.producers.simulator.fleet import simulate_fleet
from trainguard.producers.simulator.fleet_scenario import FleetScenario
from trainguard.producers.simulator.fleet_truth import DrainTruth, FailureTruth, FleetTruth
from trainguard.replay.backtest import backtest
from trainguard.replay.log import Recording
from trainguard.replay.replay import REPLAY_SECRET
from trainguard.schemas import Command, Envelope

POLICY = load_policy(str(builtin_policy("evaluate")))
START = 1_767_225_600.0
#: Strong, long ECC precursors before every failure: what any detector should see.
ECC = {
    "world_size": 128,
    "days": 1,
    "seed": 2,
    "failures": {"per_day": 4, "kinds": {"crash": 1.0}},
    "precursors": {
        "share": 1.0,
        "kinds": {"ecc": 1.0},
        "lead_median_s": 7200,
        "lead_sigma": 0.0,
        "intensity_sigma": 0.0,
    },
}


def scenario(name: str = "ecc", **fields: object) -> FleetScenario:
    return FleetScenario.parse({"name": name, "fleet": {**ECC, **fields}})


# --------------------------------------------------------------------------- arithmetic


def run_of(truth: FleetTruth, name: str = "on", goodput: float = 0.9) -> FleetRun:
    elapsed = truth.elapsed_s
    return FleetRun(name, truth, Breakdown(elapsed, elapsed, (1 - goodput) * elapsed, 0.0, 0.0, 0.0))


def failure(i: int, ts: float, **kw: object) -> FailureTruth:
    return FailureTruth(i, START + ts, slot=i, gpu=0, kind="crash", **kw)  # type: ignore[arg-type]


def test_the_scoring_arithmetic_on_a_hand_made_truth() -> None:
    sc = FleetScenario.parse({"name": "arith", "fleet": {"world_size": 1024, "days": 1}})  # 128 node-days
    plan = [
        failure(
            0, 10_000, precursor="ecc", precursor_ts=START + 5000, outcome="drained", drained_ts=START + 8000
        ),
        failure(1, 20_000, precursor="xid", precursor_ts=START + 18_000, outcome="struck"),
        failure(2, 30_000, outcome="struck"),  # no precursor
        failure(
            3,
            40_000,
            precursor="pcie",
            precursor_ts=START + 30_000,
            outcome="drained",
            drained_ts=START + 32_000,
        ),
        failure(
            4, 50_000, precursor="ecc", precursor_ts=START + 45_000, outcome="removed"
        ),  # left for another reason
        failure(
            5, 90_000, precursor="ecc", precursor_ts=START + 85_000, outcome="struck"
        ),  # after the run's end
    ]
    drains = [
        DrainTruth(
            "n00000", START + 8000, START + 8200, failure=0, failure_ts=START + 10_000
        ),  # 2,000 s before
        DrainTruth(
            "n00003", START + 32_000, START + 32_200, failure=3, failure_ts=START + 40_000
        ),  # early: 8,000 s
        DrainTruth("n00009", START + 60_000, START + 60_200),  # never failed
        DrainTruth(
            "n00001", START + 19_900, None, failure=1, failure_ts=START + 20_000, late=True
        ),  # too late
    ]
    on = FleetTruth(START, 86_400.0, checkpoint_s=1000.0, restart_s=1200.0, lost_s=500.0, drain_s=20.0)
    on.failures, on.drains = plan, drains
    off = FleetTruth(START, 86_400.0, checkpoint_s=1000.0, restart_s=2400.0, lost_s=1500.0)
    off.failures = [
        FailureTruth(f.id, f.ts, f.slot, f.gpu, f.kind, f.precursor, f.precursor_ts) for f in plan
    ]
    s = score_prediction(sc, 3600.0, run_of(on), run_of(off, "off", 0.8))
    assert (s.drains, s.precise, s.early, s.late, s.false_drains) == (4, 2, 1, 1, 2)
    assert s.precision == pytest.approx(2 / 4)  # the late drain named the right node
    # foretold in the run: 0, 1 and 3 (4 left for another reason, 5 after the end)
    assert (s.foretold, s.foretold_drained) == (3, 2) and s.recall == pytest.approx(2 / 3)
    assert (s.failures, s.drained) == (4, 2) and s.recall_all == pytest.approx(0.5)
    assert s.leads_s == (2000.0, 8000.0)
    assert s.lead_median_s == pytest.approx(5000.0) and s.lead_p10_s == pytest.approx(2600.0)
    assert s.false_per_1000_node_days == pytest.approx(2 / 128 * 1000)
    # productive: 86,400 - 2,720 on, 86,400 - 4,900 off
    assert s.gained_s == pytest.approx(2180.0)
    assert s.gained_points == pytest.approx(100 * 2180 / 86_400)
    assert (s.core_on_goodput, s.core_off_goodput) == (pytest.approx(0.9), pytest.approx(0.8))
    assert recall_breakdown(on) == {
        "kind": {"ecc": [1, 1], "xid": [0, 1], "pcie": [1, 1]},
        "lead_min": {"<20": [0, 0], "20-40": [0, 1], "40-80": [0, 0], ">=80": [2, 2]},
    }
    assert s.same_failures and not s.failed  # not a noise-only scenario: false drains are scored, not failed
    lines = acceptance_lines([s])
    assert lines[0].startswith("FAIL precursor-preceded failures drained before they struck: 2 of 3 (67%")
    assert "net goodput gained +2,180 s" in lines[-1]


def test_the_acceptance_over_noise_scenarios() -> None:
    def noise(name: str, days: float, drains: int) -> object:
        sc = FleetScenario.parse(
            {"name": name, "fleet": {"world_size": 1024, "days": days, "failures": {"per_day": 0}}}
        )
        truth = FleetTruth(START, days * 86_400.0)
        truth.drains = [DrainTruth(f"n{i:05d}", START + 100.0 * i) for i in range(drains)]
        return score_prediction(sc, 3600.0, run_of(truth), run_of(FleetTruth(START, days * 86_400.0), "off"))

    clean, dirty = noise("quiet", 8, 0), noise("loud", 4, 1)
    assert clean.noise_only and not clean.failed and dirty.failed  # type: ignore[attr-defined]
    lines = acceptance_lines([clean, dirty])  # type: ignore[list-item]
    assert (
        lines[0]
        == "PASS false drains over the noise scenarios: 1 in 1,536 node-days (0.65 per 1,000; target <= 1)"
    )
    assert lines[1] == "FAIL no drain on any noise-only scenario: loud (1)"


# --------------------------------------------------------------------------- through the core


@pytest.fixture(scope="module")
def ecc() -> object:
    return compare_prediction(scenario(), POLICY)


def test_prediction_off_predicts_and_drains_nothing() -> None:
    off = run_fleet(scenario(), prediction_off(POLICY), "off")
    assert off.predictions == 0 and off.decisions == [] and off.commands["drain_node"] == 0
    assert off.truth.drains == []
    in_run = [f for f in off.truth.failures if off.truth.in_run(f)]
    assert in_run and all(f.outcome == "struck" for f in in_run)


def test_the_same_seed_meets_the_same_failures_and_prediction_drains_foretold_ones(ecc: object) -> None:
    c = ecc
    s = c.score  # type: ignore[attr-defined]
    assert s.same_failures and s.off_drains == 0
    on, off = c.on.truth, c.off.truth  # type: ignore[attr-defined]
    assert [(f.ts, f.slot) for f in on.failures] == [(f.ts, f.slot) for f in off.failures]
    # every failure here is foretold two hours ahead by climbing ECC errors
    assert s.foretold >= 2 and s.foretold_drained >= 1, s
    for f in on.failures:
        if f.outcome == "drained" and on.in_run(f):
            assert off.failures[f.id].outcome == "struck"  # what the drain took away
            assert 0 < f.gained_s <= 7200
    assert all(lead > 0 for lead in s.leads_s)
    # the core's accounting agrees with the truth within a restart's worth
    assert abs(s.core_on_goodput - s.on_goodput) < 0.01 and abs(s.core_off_goodput - s.off_goodput) < 0.01


def test_healthy_noise_is_never_drained() -> None:
    quiet = FleetScenario.parse(
        {
            "name": "quiet",
            "fleet": {"world_size": 256, "days": 1, "seed": 8, "failures": {"per_day": 0}},
        }
    )
    c = compare_prediction(quiet, POLICY)
    assert c.score.noise_only and c.score.drains == 0 and not c.score.failed
    assert c.score.gained_s == 0.0


# --------------------------------------------------------------------------- the CLI


def test_evaluate_reports_a_fleet_scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = scenario("precursor-small", days=0.5)
    monkeypatch.setattr(fleet_scenario, "fleet_library", lambda: {small.name: small})
    out = tmp_path / "scores.json"
    done = CliRunner().invoke(app, ["evaluate", "--scenario", "precursor-small", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "Failure prediction" in done.output and "precursor-small: net goodput gained" in done.output
    (row,) = json.loads(out.read_text())["prediction"]
    assert row["scenario"] == "precursor-small" and row["failed"] is False
    assert row["foretold"] >= 1 and row["drains"] == row["precise"] + row["false_drains"]
    unknown = CliRunner().invoke(app, ["evaluate", "--scenario", "no-such-scenario"])
    assert unknown.exit_code == 2 and "no library scenario no-such-scenario" in unknown.output


# --------------------------------------------------------------------------- backtest


def recorded(sc: FleetScenario) -> Recording:
    """The fleet run with prediction off, as the live processor would have logged it: one
    record per event, folded by a CoreDriver whose commands the run applies."""
    run_id = "fleet-recorded"
    driver = CoreDriver(prediction_off(POLICY), REPLAY_SECRET)
    recording = Recording(run_id)

    def core(event: Envelope) -> list[Command]:
        (record,) = pack([event], run_id, sc.fleet.world_size, 0, "p", len(recording.records))
        recording.records.append((0, len(recording.records), record.value))
        result = driver.handle(record.value)
        recording.derived += result.derived
        recording.commands += result.commands
        return list(result.commands)

    simulate_fleet(sc, core, interval_s=POLICY.interval.initial_s, run_id=run_id)
    return recording


def test_backtest_compares_prediction_policies_on_a_recorded_run() -> None:
    sc = scenario(days=0.5)
    result = backtest(recorded(sc), [("off", prediction_off(POLICY)), ("on", POLICY)], processes=1)
    off, on = result.runs
    assert off.prediction is not None and on.prediction is not None
    assert off.prediction.drains == () and off.prediction.predictions == 0
    assert off.prediction.failures >= 1 and on.prediction.failures == off.prediction.failures
    p = on.prediction
    assert p.drains and p.drained >= 1 and p.leads_s
    drained = [d for d in p.drains if d.failure_ts is not None and d.value_s > 0]
    assert drained, p.drains
    facts = result.facts
    for d in drained:  # R and the lost work of the recorded failure, less C and the swap
        assert d.rule.startswith(f"drain: {d.node} failed") and f"R {facts.restart_s:,.0f} s" in d.rule
        lost = float(d.rule.split("lost ")[1].split(" s")[0].replace(",", ""))
        assert d.value_s == pytest.approx(facts.restart_s + lost - facts.checkpoint_s - 60.0, abs=1.0)
    rows = [r for r in on.rows if r.decision == "drain"]
    assert {r.subject for r in rows} == {d.node for d in p.drains}
    assert sum(r.saving_s or 0.0 for r in rows) == pytest.approx(p.value_s)
    assert p.node_days == pytest.approx(16 * 0.5, rel=0.05)
