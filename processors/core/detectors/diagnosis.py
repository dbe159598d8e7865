"""Straggler diagnosis before any action (seed R2, ``diagnose_straggler``).

Evicting a symptom whose cause is environmental only moves the symptom, so a flagged
straggler is classified from the GPU-health reports of its node first:

1. node over the thermal limit, power-capped or thermally throttled: if the median
   temperature of the OTHER nodes of its rack is over the limit too, the aisle is hot
   (ENVIRONMENTAL: alert facilities, do not evict); otherwise NODE_THERMAL (evict);
2. NVLink narrower than expected, or retries over the band: NODE_LINK (evict);
3. NIC utilisation over the band: NETWORK_CONTENTION (evict and change placement);
4. otherwise UNKNOWN: evict once per run, then stop (action NONE) and leave it to a human.

A node's health is the aggregate of its GPUs' recent reports: temperature is the hottest
GPU (each GPU's mean over its last `recent_reports` reports), power-capped and throttled
are "any GPU in any recent report", NVLink width is the narrowest, retries and NIC
utilisation the highest. A GPU that reports present=False has no health; a node without
any health is UNKNOWN. Readings of an older attempt are dropped when a newer attempt
reports (placement may have changed); the count of UNKNOWN evictions is per run and kept.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from ....schemas import (
    Diagnosis,
    GpuHealth,
    Reason,
    ReasonCode,
    StragglerAction,
    StragglerDiagnosed,
    StragglerFlagged,
)
from ..ids import derived_id
from .diagnosis_state import DiagnosisPolicy, HealthState, NodeHealth, _Reading

if TYPE_CHECKING:  # state.py embeds this module's state: no import cycle at run time
    from ..state import RunState

T = TypeVar("T")


def observe_health(state: HealthState, run: RunState, event: GpuHealth, policy: DiagnosisPolicy) -> None:
    """Keep the GPU's latest `recent_reports` reports; present=False forgets the GPU."""
    reading = reading_of(
        event.event_id,
        event.temperature_c,
        event.power_capped,
        event.thermal_throttle,
        event.nvlink_width,
        event.nvlink_expected_width,
        event.nvlink_retries,
        event.nic_utilization,
        policy.nvlink_expected_width,
    )
    keep_reading(state, event.attempt, event.rank, event.node, event.present, reading, policy.recent_reports)


def reading_of(
    event_id: str,
    temperature_c: float | None,
    power_capped: bool | None,
    thermal_throttle: bool | None,
    nvlink_width: int | None,
    nvlink_expected_width: int | None,
    nvlink_retries: int | None,
    nic_utilization: float | None,
    default_expected_width: int | None,
) -> _Reading:
    """What the diagnosis keeps of a report (unreported flags are off; an unreported
    expected NVLink width is the policy's)."""
    return _Reading(
        event_id=event_id,
        temperature_c=temperature_c,
        capped=bool(power_capped),
        throttled=bool(thermal_throttle),
        nvlink_width=nvlink_width,
        nvlink_expected_width=nvlink_expected_width or default_expected_width,
        nvlink_retries=nvlink_retries,
        nic_utilization=nic_utilization,
    )


def keep_reading(
    state: HealthState,
    attempt: int,
    rank: int,
    node: str,
    present: bool,
    reading: _Reading,
    recent_reports: int,
) -> None:
    """observe_health of a report read as `reading` (also quiet.py's, from a row)."""
    if attempt != state.attempt:
        if attempt < state.attempt:
            return
        state.attempt = attempt
        state.readings.clear()
        state.rank_node.clear()
    if rank < 0:
        return
    state.reports += 1
    previous = state.rank_node.get(rank)
    if previous is not None and previous != node:
        _forget(state, previous, rank)
    if not present:
        _forget(state, node, rank)
        state.rank_node[rank] = node
        return
    state.rank_node[rank] = node
    gpus = state.readings.get(node)
    if gpus is None:  # (setdefault would make a dict for every report)
        gpus = state.readings[node] = {}
    recent = gpus.get(rank)
    if recent is None or recent.maxlen != recent_reports:
        recent = gpus[rank] = deque(recent or (), maxlen=recent_reports)
    recent.append(reading)


def node_health(state: HealthState, node: str) -> NodeHealth | None:
    """The node's aggregated health, or None when none of its GPUs has reported any."""
    gpus = {rank: recent for rank, recent in state.readings.get(node, {}).items() if recent}
    if not gpus:
        return None
    temps = [
        statistics.fmean(t) for recent in gpus.values() if (t := _present(r.temperature_c for r in recent))
    ]
    readings = [r for recent in gpus.values() for r in recent]
    widths = _present(r.nvlink_width for r in readings)
    expected = _present(r.nvlink_expected_width for r in readings)
    retries = _present(r.nvlink_retries for r in readings)
    nic = _present(r.nic_utilization for r in readings)
    return NodeHealth(
        temperature_c=max(temps) if temps else None,
        capped=any(r.capped for r in readings),
        throttled=any(r.throttled for r in readings),
        nvlink_width=min(widths) if widths else None,
        nvlink_expected_width=max(expected) if expected else None,
        nvlink_retries=max(retries) if retries else None,
        nic_utilization=max(nic) if nic else None,
        gpus=len(gpus),
        event_ids=[recent[-1].event_id for _, recent in sorted(gpus.items())],
    )


def diagnose(
    state: HealthState, run: RunState, rank: int, policy: DiagnosisPolicy, node: str | None = None
) -> tuple[Diagnosis, StragglerAction, dict[str, float], Reason]:
    """Classify why `rank` (on `node`, default: where it last reported health) straggles.

    Not read-only: an UNKNOWN that recommends EVICT_ONCE counts against the run's
    `max_unknown_evictions`, so call it once per flagged straggler."""
    if node is None:
        known = run.ranks.get(rank)
        node = state.rank_node.get(rank) or (known.node if known is not None else "")
    health = node_health(state, node)
    if health is None:
        return _unknown(state, node, {"gpus_reporting": 0.0}, "no GPU health reported", policy)
    evidence = health.evidence()
    limit = policy.thermal_limit_c
    hot = health.temperature_c is not None and health.temperature_c > limit
    if hot or health.capped or health.throttled:
        rack = run.racks.get(node)
        peers = _rack_peer_temps(state, run, node, rack)
        evidence["thermal_limit_c"] = limit
        evidence["rack_peers"] = float(len(peers))
        what = _thermal_words(health, limit)
        if peers:
            rack_median = statistics.median(peers)
            evidence["rack_median_c"] = rack_median
            if rack_median > limit:
                return (
                    Diagnosis.ENVIRONMENTAL,
                    StragglerAction.ALERT_FACILITIES,
                    evidence,
                    Reason(
                        code=ReasonCode.ENVIRONMENTAL,
                        text=f"{node} is {what}, and the other {len(peers)} nodes of {rack} are at a "
                        f"median {rack_median:.1f} C (limit {limit:g} C): the aisle is hot; evicting "
                        "would move the symptom. Alert facilities, do not evict",
                    ),
                )
        context = (
            f"while the other {len(peers)} nodes of {rack} are at a median {evidence['rack_median_c']:.1f} C"
            if peers
            else "with no rack peers reporting"
        )
        return (
            Diagnosis.NODE_THERMAL,
            StragglerAction.EVICT,
            evidence,
            Reason(
                code=ReasonCode.NODE_THERMAL,
                text=f"{node} is {what} {context}: a node fault (fan, paste); evict",
            ),
        )
    narrow = (
        health.nvlink_width is not None
        and health.nvlink_expected_width is not None
        and health.nvlink_width < health.nvlink_expected_width
    )
    retrying = health.nvlink_retries is not None and health.nvlink_retries > policy.nvlink_retry_band
    if narrow or retrying:
        evidence["nvlink_retry_band"] = float(policy.nvlink_retry_band)
        return (
            Diagnosis.NODE_LINK,
            StragglerAction.EVICT,
            evidence,
            Reason(
                code=ReasonCode.NODE_LINK,
                text=f"{node} NVLink degraded: width {health.nvlink_width} of "
                f"{health.nvlink_expected_width}, {health.nvlink_retries} retries per report "
                f"(band {policy.nvlink_retry_band}); evict",
            ),
        )
    if health.nic_utilization is not None and health.nic_utilization > policy.nic_utilization_band:
        evidence["nic_utilization_band"] = policy.nic_utilization_band
        return (
            Diagnosis.NETWORK_CONTENTION,
            StragglerAction.EVICT_AND_REPLACE,
            evidence,
            Reason(
                code=ReasonCode.NETWORK_CONTENTION,
                text=f"{node} shared NIC at {health.nic_utilization:.0%} utilisation (band "
                f"{policy.nic_utilization_band:.0%}): evict and change placement",
            ),
        )
    return _unknown(state, node, evidence, "GPU health is normal", policy)


def diagnosed(
    state: HealthState, run: RunState, flagged: StragglerFlagged, policy: DiagnosisPolicy
) -> StragglerDiagnosed:
    """The StragglerDiagnosed event for a StragglerFlagged (same envelope, id derived from it)."""
    diagnosis, action, evidence, reason = diagnose(state, run, flagged.rank, policy, node=flagged.node)
    health = node_health(state, flagged.node)
    used = health.event_ids[:63] if health is not None else []
    return StragglerDiagnosed(
        event_id=derived_id("straggler_diagnosed", flagged.event_id),
        run_id=flagged.run_id,
        attempt=flagged.attempt,
        rank=flagged.rank,
        node=flagged.node,
        step=flagged.step,
        ts=flagged.ts,
        reason=reason,
        caused_by=[flagged.event_id, *used],
        diagnosis=diagnosis,
        action=action,
        evidence={**evidence, "slowdown": flagged.slowdown, "robust_z": flagged.robust_z},
    )


# --------------------------------------------------------------------------- internals


def _present(values: Iterable[T | None]) -> list[T]:
    return [v for v in values if v is not None]


def _forget(state: HealthState, node: str, rank: int) -> None:
    gpus = state.readings.get(node)
    if gpus is not None:
        gpus.pop(rank, None)
        if not gpus:
            del state.readings[node]


def _rack_peer_temps(state: HealthState, run: RunState, node: str, rack: str | None) -> list[float]:
    if rack is None:
        return []
    temps = []
    for peer in state.readings:
        if peer != node and run.racks.get(peer) == rack:
            health = node_health(state, peer)
            if health is not None and health.temperature_c is not None:
                temps.append(health.temperature_c)
    return temps


def _thermal_words(health: NodeHealth, limit: float) -> str:
    parts = []
    if health.temperature_c is not None:
        parts.append(f"at {health.temperature_c:.1f} C (limit {limit:g} C)")
    if health.throttled:
        parts.append("thermally throttled")
    if health.capped:
        parts.append("power-capped")
    return ", ".join(parts)


def _unknown(
    state: HealthState, node: str, evidence: dict[str, float], why: str, policy: DiagnosisPolicy
) -> tuple[Diagnosis, StragglerAction, dict[str, float], Reason]:
    if state.unknown_evictions < policy.max_unknown_evictions:
        state.unknown_evictions += 1
        action = StragglerAction.EVICT_ONCE
        verdict = f"evict once ({state.unknown_evictions} of {policy.max_unknown_evictions} allowed per run)"
    else:
        action = StragglerAction.NONE
        verdict = (
            f"no action: {state.unknown_evictions} unexplained eviction(s) already recommended in this "
            "run; evicting again would repeat an unproven remedy, a human must look"
        )
    evidence["unknown_evictions"] = float(state.unknown_evictions)
    return (
        Diagnosis.UNKNOWN,
        action,
        evidence,
        Reason(code=ReasonCode.UNKNOWN_CAUSE, text=f"{node or 'unknown node'}: {why}; {verdict}"),
    )
