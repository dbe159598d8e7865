"""A fleet scenario: a run-level simulated run with GPU health, for failure prediction
(issue 46), as one validated YAML file in the scenario library.

The per-rank simulator (cluster.py) emits every rank's every step; a prediction scenario
spans node-days at 1,024 and 16,384 ranks, which only a run-level model can afford
(fleet.py: one reporting rank's steps, the launcher's records, every GPU's health every
``health_interval_s``). Its file has a ``fleet:`` section, which the per-rank
:class:`~.scenario.Scenario` refuses and :meth:`Scenario.library` leaves to this
loader, so that ``trainguard evaluate`` routes each kind to its simulator::

    name: precursor-1k
    description: ...
    fleet:
      world_size: 1024
      days: 7
      failures: {per_day: 3}
      precursors: {share: 0.7, false_per_node_day: 0.002}
      noise: {scale: 1.0}
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .precursors import HealthNoise, Precursors
from .runlevel import DAY_S, llama3_mtbf_s
from .scenario import FLEET_SECTION, LIBRARY_DIR, ScenarioError, read_mapping

FailureKind = Literal["crash", "hang", "wrong_gpu"]
_KIND_WEIGHTS: dict[FailureKind, float] = {"crash": 0.75, "hang": 0.15, "wrong_gpu": 0.10}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Failures(_Strict):
    """Hard failures: a Poisson process in wall-clock time over the fleet's nodes.

    A crash is seen at once (the dying rank exits). A hang stalls the job until the
    progress watchdog's step timeout, `hang_detect_s`. A wrong GPU computes wrong answers
    while the job trains on, until the next ring cross-rank check (every
    `ring_check_every_s` of training) finds it, and the job returns to the checkpoint
    before its onset. Each reaches the core as the culprit rank's exit at detection."""

    per_day: float | None = Field(
        None, ge=0, description="Failures per day over the whole job; None: the Llama 3 rate at this size."
    )
    kinds: dict[FailureKind, float] = Field(
        default_factory=lambda: dict(_KIND_WEIGHTS),
        description="Relative weights of the kinds.",
    )
    hang_detect_s: float = Field(90.0, gt=0, description="A hang's stall until the watchdog's timeout.")
    ring_check_every_s: float = Field(1800.0, gt=0, description="Training between two ring checks.")

    @model_validator(mode="after")
    def _weights(self) -> Failures:
        if not self.kinds or sum(self.kinds.values()) <= 0 or min(self.kinds.values()) < 0:
            raise ValueError("kinds: weights must be >= 0 with a positive sum")
        return self


class Fleet(_Strict):
    """The job, its fleet's health and its failures."""

    world_size: int = Field(ge=8, le=131_072)
    ranks_per_node: int = Field(8, ge=1, le=64)
    nodes_per_rack: int = Field(32, ge=1)
    days: float = Field(gt=0, le=60)
    step_s: float = Field(10.0, gt=0, le=600)
    checkpoint_s: float = Field(30.0, ge=0, description="C: a checkpoint's blocking time.")
    restart_s: float = Field(600.0, gt=0, description="R: detection to the next attempt's first step.")
    reschedule_fraction: float = Field(0.5, ge=0, le=1, description="Share of R before the launch.")
    drain_swap_s: float = Field(
        10.0, ge=0, description="A drain's stop: the checkpoint's end to the next first step (spare in)."
    )
    spares: int = Field(16, ge=0, description="Pre-tested spare nodes ready (RunStarted.spares).")
    spare_idle: bool = Field(
        True,
        description="A spare joins idle and warms up from its first step (it waited in the pool); "
        "False: it joins at the others' load (straight from a burn-in at full load).",
    )
    health_interval_s: float = Field(
        120.0,
        ge=10,
        le=3600,
        description="Every GPU reports its health this often (real ranks: 30 s; the core's buckets: 120 s).",
    )
    seed: int = 0
    failures: Failures = Field(default_factory=Failures)
    precursors: Precursors = Field(default_factory=Precursors)
    noise: HealthNoise = Field(default_factory=HealthNoise)

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)

    @property
    def node_days(self) -> float:
        return self.nodes * self.days

    @property
    def failures_per_day(self) -> float:
        if self.failures.per_day is not None:
            return self.failures.per_day
        return DAY_S / llama3_mtbf_s(self.world_size)


class FleetScenario(_Strict):
    """A fleet scenario of the library: a name, what it shows, its fleet."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = Field(default="", max_length=2000)
    fleet: Fleet

    @property
    def noise_only(self) -> bool:
        """No failure and no precursor: healthy noise only (a drain here is always false)."""
        f = self.fleet
        return f.failures_per_day == 0 and f.precursors.false_per_node_day == 0

    @classmethod
    def parse(cls, data: dict[str, object], source: str = "<fleet scenario>") -> FleetScenario:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = []
            for err in exc.errors(include_url=False):
                loc = ".".join(str(p) for p in err["loc"])
                lines.append(f"  {loc}: {err['msg'].removeprefix('Value error, ')}")
            raise ScenarioError(f"{source}: invalid fleet scenario:\n" + "\n".join(lines)) from exc

    @classmethod
    def load(cls, path: str | Path) -> FleetScenario:
        path = Path(path)
        data = read_mapping(path)
        if FLEET_SECTION not in data:
            raise ScenarioError(f"{path}: not a fleet scenario (no fleet: section)")
        return cls.parse(data, str(path))


def fleet_library(directory: Path | None = None) -> dict[str, FleetScenario]:
    """The library's fleet scenarios (those with a ``fleet:`` section), by name, sorted."""
    out: dict[str, FleetScenario] = {}
    for path in sorted((directory or LIBRARY_DIR).glob("*.yaml")):
        data = read_mapping(path)
        if FLEET_SECTION not in data:
            continue
        scenario = FleetScenario.parse(data, str(path))
        if scenario.name != path.stem:
            raise ScenarioError(f"{path}: name {scenario.name!r} differs from the file name")
        out[scenario.name] = scenario
    return out
