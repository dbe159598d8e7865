"""GPU-health diagnosis: its policy, the per-run health state and a node's health
(data; behaviour in diagnosis.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
from pydantic import BaseModel, ConfigDict, Field


class DiagnosisPolicy(BaseModel):
    """Settings of straggler diagnosis (seed R2's THERMAL_LIMIT, EXPECTED and BANDs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    thermal_limit_c: float = Field(
        85.0,
        gt=0,
        description="GPU temperature above which a node is thermal, and above which a rack's "
        "median makes it environmental (datacenter GPUs start throttling around 85-90 C).",
    )
    nvlink_expected_width: int | None = Field(
        None, ge=1, description="NVLink width expected when a report does not carry its own."
    )
    nvlink_retry_band: int = Field(
        100,
        ge=0,
        description="NVLink retries per health report (the agent reports the count since its "
        "previous report) above which the link is degraded; a healthy link shows ~0.",
    )
    nic_utilization_band: float = Field(
        0.9, gt=0, le=1, description="Shared-NIC utilisation above which the network is contended."
    )
    recent_reports: int = Field(
        3, ge=1, description="How many of each GPU's latest health reports are used (noise damping)."
    )
    max_unknown_evictions: int = Field(
        1, ge=0, description="UNKNOWN evictions recommended per run before recommending none (R2)."
    )


class _Reading(NamedTuple):
    """One GPU health report as the diagnosis keeps it. A tuple: a 16,384-rank run holds
    tens of thousands, and a worker's snapshot pickles them all (a frozen slots dataclass
    pickled through Python-level state methods: 240 ms of a 350 ms snapshot, issue 20)."""

    event_id: str
    temperature_c: float | None
    capped: bool
    throttled: bool
    nvlink_width: int | None
    nvlink_expected_width: int | None
    nvlink_retries: int | None
    nic_utilization: float | None


@dataclass
class HealthState:
    """One run's GPU health (keep one per RunState, across attempts)."""

    attempt: int = -1
    #: node -> rank -> that GPU's recent reports, newest last.
    readings: dict[str, dict[int, deque[_Reading]]] = field(default_factory=dict)
    #: rank -> node, from the health reports.
    rank_node: dict[int, str] = field(default_factory=dict)
    #: UNKNOWN evictions recommended in this run (R2: evict once, then stop).
    unknown_evictions: int = 0
    reports: int = 0

    # Snapshots (processors/snapshot.py) take the readings as one JSON document: pickle
    # goes through a Python method per NamedTuple and memoizes every value (~100 ms at
    # 16,384 ranks, issue 20). [node, [[rank, maxlen, [reading, ...]], ...]], ranks as ints.
    def __getstate__(self) -> dict[str, Any]:
        saved = self.__dict__.copy()
        saved["readings"] = orjson.dumps(
            [
                [node, [[rank, recent.maxlen, recent] for rank, recent in gpus.items()]]
                for node, gpus in self.readings.items()
            ],
            default=list,  # a deque
        )
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__dict__.update(saved)
        self.readings = {
            node: {
                rank: deque(map(_Reading._make, readings), maxlen=maxlen) for rank, maxlen, readings in gpus
            }
            for node, gpus in orjson.loads(saved["readings"])
        }


@dataclass(frozen=True)
class NodeHealth:
    """A node's health, aggregated over its GPUs' recent reports."""

    temperature_c: float | None
    capped: bool
    throttled: bool
    nvlink_width: int | None
    nvlink_expected_width: int | None
    nvlink_retries: int | None
    nic_utilization: float | None
    gpus: int
    event_ids: list[str]

    def evidence(self) -> dict[str, float]:
        values: dict[str, float | int | bool | None] = {
            "node_temp_c": self.temperature_c,
            "power_capped": self.capped,
            "thermal_throttle": self.throttled,
            "nvlink_width": self.nvlink_width,
            "nvlink_expected_width": self.nvlink_expected_width,
            "nvlink_retries": self.nvlink_retries,
            "nic_utilization": self.nic_utilization,
            "gpus_reporting": self.gpus,
        }
        return {k: float(v) for k, v in values.items() if v is not None}
