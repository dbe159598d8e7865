"""Straggler diagnosis before action (seed R2): the GPU-health fingerprint of each cause,
through the same streams as the straggler tests (a slow rank, its node's health)."""

from __future__ import annotations

import pytest

from harness.straggler_streams import Harness, HealthFault, Slow, SyncJob, of_kind
from trainguard.processors.core.detectors.diagnosis import diagnose, observe_health
from trainguard.processors.core.detectors.diagnosis_state import DiagnosisPolicy, HealthState
from trainguard.schemas import (
    Diagnosis,
    GpuHealth,
    ReasonCode,
    StragglerAction,
    StragglerDiagnosed,
    StragglerFlagged,
)

STRAGGLER = 21  # node-002, rack-0 (nodes 0-3); 64 ranks, 8 per node, 4 nodes per rack


def run_with_health(
    faults: list[HealthFault], slow: list[Slow] | None = None, steps: int = 130, seed: int = 1
) -> tuple[SyncJob, Harness, list[StragglerDiagnosed]]:
    """A job with a straggler whose node reports `faults` every 10 steps (NVML polling)."""
    job = SyncJob(seed=seed, slow=slow if slow is not None else [Slow(STRAGGLER, 1.2)]).start()
    job.health(faults)
    for _ in range(steps // 10):
        job.steps(10).health(faults)
    harness = Harness()
    outputs = harness.feed(job.events)
    flagged = of_kind(outputs, StragglerFlagged)
    diagnosed = of_kind(outputs, StragglerDiagnosed)
    assert [d.event_id for d in diagnosed] and len(diagnosed) == len(flagged)
    for flag, diag in zip(flagged, diagnosed, strict=True):
        assert diag.caused_by[0] == flag.event_id
        assert (diag.rank, diag.node, diag.step, diag.ts) == (flag.rank, flag.node, flag.step, flag.ts)
    return job, harness, diagnosed


def test_hot_node_in_a_cool_rack_is_node_thermal_evict() -> None:
    job, _, (diag,) = run_with_health([HealthFault("thermal", rank=STRAGGLER)])
    assert (diag.diagnosis, diag.action) == (Diagnosis.NODE_THERMAL, StragglerAction.EVICT)
    assert diag.reason.code == ReasonCode.NODE_THERMAL and "evict" in diag.reason.text
    assert diag.evidence["node_temp_c"] > 88
    assert diag.evidence["rack_median_c"] < 65 and diag.evidence["rack_peers"] == 3
    assert diag.evidence["thermal_throttle"] == 1.0
    assert diag.evidence["slowdown"] == pytest.approx(1.2, abs=0.02)
    # The health reports used are named as causes, newest per GPU of the node.
    health_ids = {e.event_id for e in job.events if isinstance(e, GpuHealth) and e.node == diag.node}
    assert len(diag.caused_by) == 1 + 8 and set(diag.caused_by[1:]) <= health_ids


def test_power_capped_node_is_node_thermal_evict() -> None:
    _, _, (diag,) = run_with_health([HealthFault("power_cap", node="node-002")])
    assert (diag.diagnosis, diag.action) == (Diagnosis.NODE_THERMAL, StragglerAction.EVICT)
    assert diag.evidence["power_capped"] == 1.0 and diag.evidence["node_temp_c"] < 85
    assert "power-capped" in diag.reason.text


def test_hot_aisle_is_environmental_alert_facilities_and_no_eviction() -> None:
    _, _, (diag,) = run_with_health([HealthFault("hot_rack", rack="rack-0")])
    assert (diag.diagnosis, diag.action) == (Diagnosis.ENVIRONMENTAL, StragglerAction.ALERT_FACILITIES)
    assert diag.action not in (
        StragglerAction.EVICT,
        StragglerAction.EVICT_ONCE,
        StragglerAction.EVICT_AND_REPLACE,
    )
    assert diag.reason.code == ReasonCode.ENVIRONMENTAL and "do not evict" in diag.reason.text
    assert diag.evidence["rack_median_c"] > diag.evidence["thermal_limit_c"] == 85.0
    assert diag.evidence["rack_peers"] == 3


def test_a_hot_rack_next_door_does_not_excuse_a_hot_node() -> None:
    faults = [HealthFault("thermal", rank=STRAGGLER), HealthFault("hot_rack", rack="rack-1")]
    _, _, (diag,) = run_with_health(faults)
    assert diag.diagnosis == Diagnosis.NODE_THERMAL and diag.evidence["rack_median_c"] < 65


def test_degraded_nvlink_is_node_link_evict() -> None:
    _, _, (diag,) = run_with_health([HealthFault("link", node="node-002")])
    assert (diag.diagnosis, diag.action) == (Diagnosis.NODE_LINK, StragglerAction.EVICT)
    assert diag.reason.code == ReasonCode.NODE_LINK
    assert diag.evidence["nvlink_width"] == 9 and diag.evidence["nvlink_expected_width"] == 18
    assert diag.evidence["nvlink_retries"] >= 250


def test_shared_nic_contention_is_evict_and_change_placement() -> None:
    _, _, (diag,) = run_with_health([HealthFault("nic", node="node-002")])
    assert (diag.diagnosis, diag.action) == (Diagnosis.NETWORK_CONTENTION, StragglerAction.EVICT_AND_REPLACE)
    assert diag.reason.code == ReasonCode.NETWORK_CONTENTION
    assert diag.evidence["nic_utilization"] == pytest.approx(0.97)


def test_healthy_looking_node_is_unknown_evict_once() -> None:
    _, harness, (diag,) = run_with_health([])
    assert (diag.diagnosis, diag.action) == (Diagnosis.UNKNOWN, StragglerAction.EVICT_ONCE)
    assert diag.reason.code == ReasonCode.UNKNOWN_CAUSE
    assert diag.evidence["unknown_evictions"] == 1.0 and diag.evidence["node_temp_c"] < 85
    assert harness.health.unknown_evictions == 1


def test_absent_gpu_means_no_health_and_unknown() -> None:
    _, _, (diag,) = run_with_health([HealthFault("absent", node="node-002")])
    assert diag.diagnosis == Diagnosis.UNKNOWN and diag.evidence["gpus_reporting"] == 0
    assert "no GPU health" in diag.reason.text


def test_unknown_evicts_once_per_run_then_stops() -> None:
    # Two unexplained stragglers in one run: the first eviction is allowed, the second not.
    slow = [Slow(STRAGGLER, 1.2), Slow(45, 1.2, from_step=60)]
    job, harness, (first, second) = run_with_health([], slow=slow, steps=180)
    assert (first.rank, second.rank) == (STRAGGLER, 45)
    assert first.action == StragglerAction.EVICT_ONCE
    assert (second.diagnosis, second.action) == (Diagnosis.UNKNOWN, StragglerAction.NONE)
    assert "a human must look" in second.reason.text
    # Per run, not per attempt: after a restart (same slow GPUs) nothing is evicted again.
    n = len(job.events)
    job.restart(resumed_from_step=170).health([])
    for _ in range(12):
        job.steps(10).health([])
    again = of_kind(harness.feed(job.events[n:]), StragglerDiagnosed)
    assert sorted(d.rank for d in again) == [STRAGGLER, 45]
    assert all(d.attempt == 1 and d.action == StragglerAction.NONE for d in again)
    assert harness.health.unknown_evictions == 1


def test_r2_order_thermal_before_link_before_network() -> None:
    both = [HealthFault("thermal", rank=STRAGGLER), HealthFault("link", node="node-002")]
    assert run_with_health(both)[2][0].diagnosis == Diagnosis.NODE_THERMAL
    link_and_nic = [HealthFault("link", node="node-002"), HealthFault("nic", node="node-002")]
    assert run_with_health(link_and_nic)[2][0].diagnosis == Diagnosis.NODE_LINK


def test_only_the_recent_reports_count() -> None:
    # The node ran hot an hour ago; its last three reports are normal.
    job = SyncJob(seed=3).start()
    job.health([HealthFault("thermal", node="node-002")])
    for _ in range(3):
        job.health([])
    harness = Harness()
    harness.feed(job.events)
    diagnosis, action, evidence, _ = diagnose(harness.health, harness.run, STRAGGLER, DiagnosisPolicy())
    assert diagnosis == Diagnosis.UNKNOWN and evidence["node_temp_c"] < 85
    # With a window of four the throttled report is still in it.
    longer = DiagnosisPolicy(recent_reports=4)
    harness = Harness(diagnosis_policy=longer)
    harness.feed(job.events)
    diagnosis, action, evidence, _ = diagnose(harness.health, harness.run, STRAGGLER, longer)
    assert (diagnosis, action) == (Diagnosis.NODE_THERMAL, StragglerAction.EVICT)
    assert evidence["thermal_throttle"] == 1.0


def test_a_thermal_node_with_no_rack_peers_reporting_is_node_thermal() -> None:
    job = SyncJob(seed=2).start()
    harness = Harness()
    harness.feed(job.events)
    state = HealthState()
    policy = DiagnosisPolicy()
    for event in job.health([HealthFault("thermal", node="node-002")]).events:
        if isinstance(event, GpuHealth) and event.node == "node-002":
            observe_health(state, harness.run, event, policy)
    diagnosis, action, evidence, reason = diagnose(state, harness.run, STRAGGLER, policy)
    assert (diagnosis, action) == (Diagnosis.NODE_THERMAL, StragglerAction.EVICT)
    assert evidence["rack_peers"] == 0 and "rack_median_c" not in evidence
    assert "no rack peers" in reason.text


def test_a_new_attempt_forgets_old_readings() -> None:
    job = SyncJob(seed=4).start().health([HealthFault("link", node="node-002")])
    harness = Harness()
    harness.feed(job.events)
    assert diagnose(harness.health, harness.run, STRAGGLER, DiagnosisPolicy())[0] == Diagnosis.NODE_LINK
    n = len(job.events)
    job.restart(resumed_from_step=-1).health([])  # the node was replaced: clean readings
    harness.feed(job.events[n:])
    assert diagnose(harness.health, harness.run, STRAGGLER, DiagnosisPolicy())[0] == Diagnosis.UNKNOWN
