"""Failure prediction's detector (processors/core/detectors/hazard.py) on a fleet's health over hours:
quiet on bursty noise, a climbing ECC count found within minutes with its numbers, the
fleet's noise measured rather than assumed, and the run's outcomes calibrating P."""

from __future__ import annotations

import math

import pytest

from trainguard.processors.core.detectors import hazard, hazard_stats
from trainguard.processors.core.detectors.hazard_state import HazardState, PredictionPolicy
from trainguard.schemas import FailurePredicted

from .health_streams import T0, Fleet

#: One node's share of a job's failures: a 3-day job MTBF over 32 nodes.
PER_NODE = 1 / (3 * 86_400 * 32)


def predict(
    fleet: Fleet, hours: float, policy: PredictionPolicy | None = None
) -> tuple[list[FailurePredicted], HazardState]:
    """Fold the fleet's reports as the core does: each report, then an evaluation when due."""
    policy = policy or PredictionPolicy()
    state, found = HazardState(), []
    for rank, node, ts, fields in fleet.reports(hours):
        hazard.observe(state, rank, node, ts, fields, policy)
        found += hazard.on_time(state, "run-h", 0, ts, PER_NODE, policy)
    return found, state


def test_a_day_of_bursty_noise_predicts_nothing() -> None:
    found, state = predict(Fleet(nodes=32, seed=3), hours=24)
    assert found == []
    rate, share = state.noise["ecc_corrected"]
    assert 20 / 86_400 < rate < 60 / 86_400  # the background plus its bursts, per GPU-second
    assert 1e-3 < share < 0.05  # bursts make some buckets active: measured, not assumed


def test_a_climbing_ecc_count_is_predicted_within_minutes_and_explained() -> None:
    onset = 6 * 3600.0
    found, _ = predict(Fleet(nodes=32, seed=4, failing={7: (onset, 5.0)}), hours=8)
    assert [f.node for f in found][:1] == ["node-0007"]
    first = found[0]
    assert onset < first.ts - T0 < onset + 30 * 60  # within half an hour of the climb's start
    assert first.signals[0].startswith("ecc_corrected: ")
    assert any(
        words in first.signals[0]
        for words in ("of its 30 2-min buckets", "with each bucket capped at", "2-min buckets in a row over")
    )
    assert first.probability > 0.2  # the signal's prior share of episodes followed by a failure
    assert first.evidence >= hazard.threshold(PredictionPolicy())
    assert {f.node for f in found} == {"node-0007"}  # nobody else


def test_noise_that_clusters_over_minutes_raises_the_streaks_bar() -> None:
    """Benign bursts that last five reports (10 min of active buckets in a row): the fleet's
    measured chance that an active bucket follows another keeps them from passing for a
    climb, where independent buckets would make a streak of five a 1e-9 event."""
    found, state = predict(Fleet(nodes=32, seed=3, burst_reports=5), hours=12)
    assert found == []
    share = state.noise["ecc_corrected"][1]
    assert state.follow["ecc_corrected"] > 10 * share  # measured, not assumed independent


def test_one_huge_burst_is_one_active_bucket_and_predicts_nothing() -> None:
    found, _ = predict(Fleet(nodes=16, seed=5, one_burst={3: 2 * 3600.0}), hours=4)
    assert found == []


def test_a_chronically_noisier_gpu_is_judged_against_its_own_past() -> None:
    """A GPU with 300 times the fleet's background from the start, steady, never failing:
    against the fleet alone its buckets are active every hour; against its own past not."""
    found, state = predict(Fleet(nodes=16, seed=9, chronic={5: 300.0}), hours=12)
    assert found == []
    count, seconds = state.own[("node-0005", "ecc_corrected")].past()
    assert count / seconds > 10 * state.noise["ecc_corrected"][0] * 8  # its usual, far above the fleet's


def test_sparse_xids_that_keep_coming_are_predicted_and_a_pair_of_bursts_is_not() -> None:
    """A failing GPU's driver logs an XID every ~12 min: most buckets empty, so the signal is
    judged still going by its silence against its own rate, not by the last bucket. Another
    node's application faults twice in a row (5 XIDs a bucket) earlier, then never again."""
    onset = 5 * 3600.0
    found, _ = predict(
        Fleet(
            nodes=32,
            seed=12,
            xids={6: (onset, 5.0)},
            xid_burst={20: (onset - 2 * 3600.0, 5)},
            xid_code={20: 13},
        ),
        hours=7,
    )
    assert {f.node for f in found} == {"node-0006"}
    first = found[0]
    assert onset < first.ts - T0 < onset + 60 * 60
    assert first.signals[0].startswith(("xid_hardware: ", "xid_errors: "))


def test_hardware_xids_are_told_from_an_applications() -> None:
    """The same stream of XIDs, 4 an hour on one GPU: with a hardware code (79, fallen off
    the bus) it is found by its own signal, whose healthy rate is a fifth of all XIDs',
    sooner than with an application's code (13), which may not stand out at all."""
    onset, found_after = 5 * 3600.0, {}
    for code in (79, 13):
        for seed in (13, 14, 15):
            fleet = Fleet(nodes=32, seed=seed, xids={6: (onset, 4.0)}, xid_code={6: code})
            found, _ = predict(fleet, hours=6.5)
            assert {f.node for f in found} <= {"node-0006"}
            found_after[(code, seed)] = found[0].ts - T0 - onset if found else None
            if found and code == 79:
                assert found[0].signals[0].startswith("xid_hardware: 4 in the last 60 min")
    for seed in (13, 14, 15):
        hardware, application = found_after[(79, seed)], found_after[(13, seed)]
        assert hardware is not None and 0 < hardware < 40 * 60
        assert application is None or application > hardware


def test_a_node_warming_from_idle_to_the_fleets_load_has_not_drifted() -> None:
    """A spare joining a running job warms by 25 °C and draws 380 W more within minutes: up
    to the fleet's level, not past it."""
    found, _ = predict(Fleet(nodes=16, seed=10, joins={4: 3 * 3600.0, 9: 3.5 * 3600.0}), hours=6)
    assert found == []


def test_a_gpu_warming_past_the_fleet_is_predicted() -> None:
    onset = 3 * 3600.0
    found, _ = predict(Fleet(nodes=16, seed=11, creeping={6: onset}), hours=5)
    assert found and {f.node for f in found} == {"node-0006"}
    assert found[0].signals[0].startswith("temperature_c: rank 48 of node-0006")
    assert found[0].ts - T0 - onset < 3600  # within the hour (a window's drift)


def test_a_noisier_fleet_raises_the_bar_it_measures() -> None:
    quiet = predict(Fleet(nodes=16, seed=6, burst_prob=0.0005), hours=6)[1].noise["ecc_corrected"][1]
    noisy = predict(Fleet(nodes=16, seed=6, burst_prob=0.01), hours=6)[1].noise["ecc_corrected"][1]
    assert noisy > 4 * quiet
    # the same climb needs more active buckets against the noisier fleet's share
    assert hazard.binomial_surprise(6, 30, noisy) < hazard.binomial_surprise(6, 30, quiet)


def test_two_nodes_and_the_priors_still_predict_a_storm() -> None:
    """Too few nodes to measure a fleet (an end-to-end test's world): the background priors
    stand for the noise, and a storm on one GPU is still found."""
    fleet = Fleet(nodes=2, gpus_per_node=2, interval_s=20.0, burst_prob=0.0, failing={1: (600.0, 40.0)})
    policy = PredictionPolicy(check_every_s=20.0, window_s=600.0, horizon_s=1800.0)
    found, state = predict(fleet, hours=0.5, policy=policy)
    assert found and found[0].node == "node-0001"
    assert "ecc_corrected" not in state.noise  # never measured: the prior stood for it


def test_outcomes_calibrate_the_signals_share() -> None:
    policy = PredictionPolicy()
    state, found = _predicted_state(policy)
    before = hazard.precision(state, "ecc_corrected", policy)[0]
    hazard.on_failure(state, "node-0007", found[0].ts + 600, policy)  # within the horizon
    hit = hazard.precision(state, "ecc_corrected", policy)
    assert hit[1:] == (1, 0) and hit[0] > before

    state, found = _predicted_state(policy)
    last = found[-1].ts
    hazard.on_time(state, "run-h", 0, last + policy.horizon_s + 2 * policy.check_every_s, PER_NODE, policy)
    missed = hazard.precision(state, "ecc_corrected", policy)
    assert missed[1:] == (0, 1) and missed[0] < before


def test_a_drained_nodes_episode_is_never_an_outcome() -> None:
    policy = PredictionPolicy()
    state, found = _predicted_state(policy)
    hazard.on_drained(state, "node-0007")
    hazard.on_failure(state, "node-0007", found[-1].ts + 60, policy)
    assert hazard.precision(state, "ecc_corrected", policy)[1:] == (0, 0)


def test_prediction_off_folds_nothing() -> None:
    found, state = predict(Fleet(nodes=8, failing={2: (600.0, 5.0)}), 2, PredictionPolicy(enabled=False))
    assert found == [] and state.gpus == {}


def test_the_threshold_follows_the_false_alarms_asked_for() -> None:
    strict = hazard.threshold(PredictionPolicy(false_alarms_per_node_day=1e-6))
    loose = hazard.threshold(PredictionPolicy(false_alarms_per_node_day=1e-2))
    assert abs(strict - loose - 4) < 1e-9


def _predicted_state(policy: PredictionPolicy) -> tuple[HazardState, list[FailurePredicted]]:
    """A node whose ECC climbed and was predicted, and then went quiet (its episode closed)."""
    fleet = Fleet(nodes=16, seed=8, failing={7: (2 * 3600.0, 5.0)})
    state, found = HazardState(), []
    for rank, node, ts, fields in fleet.reports(3):
        if node == "node-0007" and ts - T0 > 2 * 3600 + 40 * 60:
            fields = {**fields, "ecc_corrected": 0}  # reset: the storm stops (a driver reload)
        hazard.observe(state, rank, node, ts, fields, policy)
        found += hazard.on_time(state, "run-h", 0, ts, PER_NODE, policy)
    assert found and found[0].node == "node-0007"
    return state, found


def test_a_failed_row_remap_is_decisive_on_its_own() -> None:
    """One failed remap (no spare row left) is predicted at once and calibrated by its prior;
    as a rate against the fleet's background it would never pass the threshold alone."""
    fails = 4 * 3600.0
    fleet = Fleet(nodes=16, seed=21, remap_fails={9: fails})
    found, _ = predict(fleet, hours=5)
    assert [f.node for f in found] == ["node-0009"]
    assert fails < found[0].ts - T0 <= fails + 3 * 120.0  # two evaluations in a row
    assert found[0].signals[0].startswith("remap_failed: on rank 72 of node-0009")
    assert found[0].probability >= 0.7  # its prior, 7 of 10
    statistical, _ = predict(fleet, hours=5, policy=PredictionPolicy(decisive=()))
    assert statistical == []
    with pytest.raises(ValueError, match="not flags"):
        PredictionPolicy(decisive=("ecc_corrected",))


def test_the_volume_tail_is_poissons_exact_tail_never_less_than_its_bound() -> None:
    """Three XIDs in an hour against 0.0033 expected: p 6e-9 exactly, where the Chernoff
    bound says 3e-8 (the difference between a third and a fourth XID at the threshold)."""
    for count, expected in ((3, 0.0033), (10, 2.0), (40, 25.0)):
        exact = 1.0 - sum(math.exp(-expected) * expected**j / math.factorial(j) for j in range(count))
        assert hazard_stats.tail_surprise(count, expected) == pytest.approx(-math.log10(exact), rel=1e-6)
        k, mu = count, expected
        bound = (k * math.log(k / mu) - k + mu) / math.log(10)
        assert hazard_stats.tail_surprise(count, expected) >= bound
    assert hazard_stats.tail_surprise(2, 5.0) == 0.0  # fewer than expected: no surprise
    # overdispersed: the tail of count/dispersion at expected/dispersion
    assert hazard_stats.tail_surprise(20, 4.0, 2.0) == pytest.approx(hazard_stats.tail_surprise(10, 2.0))
