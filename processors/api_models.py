"""Request and response bodies of the run API (:mod:`.api`), as pydantic models: they
validate what clients send and generate the OpenAPI document's schemas."""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator

from ..common.checkpoint_location import checkpoint_location

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


# --------------------------------------------------------------------------- request models


def _seconds(value: object, expected: str = "seconds or a duration like '90s', '5m', '1.5h'") -> object:
    """A duration: seconds as a number, or a string like "90s", "5m", "1.5h"."""
    if isinstance(value, str) and (found := _DURATION.match(value)):
        return float(found.group(1)) * _UNITS[found.group(2)]
    if isinstance(value, str | bool) or value is None:
        raise ValueError(f"expected {expected}; got {value!r}")
    return value


def _interval(value: object) -> object:
    """'auto' or positive seconds; checked here so that an error names the field, not a
    branch of the union."""
    if value == "auto":
        return value
    expected = "'auto', positive seconds or a duration like '10m'"
    seconds = _seconds(value, expected)
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected {expected}; got {value!r}")
    return float(seconds)


_DURATION_SCHEMA = {
    "oneOf": [
        {"type": "number", "exclusiveMinimum": 0, "description": "seconds"},
        {"type": "string", "pattern": _DURATION.pattern, "examples": ["90s", "5m", "1.5h"]},
    ]
}
Seconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0), WithJsonSchema(_DURATION_SCHEMA)]
Interval = Annotated[
    Literal["auto"] | Annotated[float, Field(gt=0)],
    BeforeValidator(_interval),
    WithJsonSchema({"oneOf": [{"const": "auto"}, *_DURATION_SCHEMA["oneOf"]]}),
]


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class CheckpointSpec(_Body):
    uri: str = Field(
        min_length=1,
        max_length=2000,
        description="Where the run's checkpoints go: a directory every host mounts (a path or a "
        "file:// URI), or an object store's URL such as s3://bucket/ckpt "
        "(trainguard/common/checkpoint_location.py).",
    )

    @field_validator("uri")
    @classmethod
    def _a_directory(cls, uri: str) -> str:
        # LocationError (a ValueError) names the problem. The filesystem's package is
        # checked where the ranks run (trainguard launch), not on the processor's host.
        checkpoint_location(uri, need_package=False)
        return uri

    interval: Interval = Field(
        "auto", description='"auto": Young/Daly from measured C and MTBF (seed §6), or fixed seconds.'
    )


class HealthSpec(_Body):
    step_timeout: Seconds = Field(90.0, description="Hang timeout until 3 x p99 step time is measured.")
    straggler_sigma: float = Field(3.0, gt=0, description="Robust z above which a rank is slow.")


class RunSpec(_Body):
    """POST /runs (seed §3)."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Becomes the run_id's prefix."
    )
    world_size: int = Field(ge=1, le=1_048_576)
    image: str = Field("", max_length=2000, description="Container image (informational).")
    entrypoint: list[str] = Field(default_factory=list, max_length=256, description="The rank program.")
    checkpoint: CheckpointSpec
    health: HealthSpec = HealthSpec()


class CheckpointRequest(_Body):
    """POST /runs/{run_id}/checkpoint (the body is optional)."""

    reason: str = Field("", max_length=500, description="Why, for the command's reason (e.g. maintenance).")


class ResumeRequest(_Body):
    """POST /runs/{run_id}/resume (the body is optional)."""

    model_config = ConfigDict(populate_by_name=True)

    from_step: int | None = Field(
        None, alias="from", ge=0, description="A validated checkpoint step; default: the newest one."
    )
    reason: str = Field("", max_length=500)


# --------------------------------------------------------------------------- response models


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class FieldError(_Out):
    field: str
    reason: str


class ApiError(_Out):
    status: int
    error: str = Field(description="A short code: unauthorized, not_found, invalid_field, ...")
    message: str
    fields: list[FieldError] = Field(default_factory=list)


class Status(_Out):
    status: str = "OK"


class RunDeclared(_Out):
    run_id: str
    name: str
    world_size: int
    config_digest: str = Field(description="sha256 of the validated spec (16 hex digits).")
    known: bool = Field(description="True when the core already has the run (its RunStarted arrived).")
    launch: list[str] = Field(description="The command line that starts it under trainguard.")
    checkpoint: CheckpointSpec
    health: HealthSpec
    policy_differences: list[str] = Field(
        description="Where the spec asks for something this processor's policy (one for every run) differs."
    )


class InterruptionSummary(_Out):
    interruption_id: str
    at: float
    cause: str
    node: str
    rank: int
    step: int
    restart_seconds: float | None


class QuarantinedNode(_Out):
    node: str
    since: float
    attempt: int
    reason: str
    interruption_id: str | None


class SdcResult(_Out):
    step: int
    result: Literal["pass", "mismatch"]
    method: str | None = None
    node: str | None = None
    rank: int | None = None


class SdcChecks(_Out):
    last: SdcResult | None = Field(description="The newest check result the processor knows.")
    status: Literal["none", "pass", "mismatch"] = Field(
        description="mismatch: a mismatch is unresolved (no rollback to a clean ancestor yet)."
    )
    verified_step: int = Field(description="The verification watermark: newest step a check passed at.")
    mismatches: int
    self_checks_issued: int
    cross_checks_issued: int


class Health(_Out):
    run_id: str
    phase: str
    attempt: int
    world_size: int | None
    step: int
    as_of: float = Field(description="Event time of the newest record the core has of the run.")
    step_time_p50: float | None
    step_time_max: float | None
    slowest_rank: int | None
    goodput_7d: float
    interruptions: list[InterruptionSummary]
    quarantined_nodes: list[QuarantinedNode]
    sdc_checks: SdcChecks
    validated_checkpoints: list[int] = Field(description="Resumable steps the core keeps, oldest first.")


class DecisionOut(_Out):
    decision_id: str
    kind: str
    at: float
    reason_code: str
    reason: str


class TimelineEntry(_Out):
    interruption_id: str
    at: float
    attempt: int
    cause: str
    detected_by: str
    node: str
    rank: int
    step: int
    lost_steps: int
    last_checkpoint_step: int
    restart_seconds: float | None = Field(description="None until the next attempt completes a step.")
    resumed_attempt: int | None
    lost_seconds: float | None
    gpu_hours: float | None = Field(description="Cost: world size x (detect + restart + lost seconds).")
    phases: dict[str, float]
    reason_code: str
    reason: str
    decisions: list[DecisionOut]


class Timeline(_Out):
    run_id: str
    interruptions: list[TimelineEntry]


class CommandAccepted(_Out):
    run_id: str
    command_id: str
    kind: str
    attempt: int
    issued_ts: float
    checkpoint_step: int | None = None
    uri: str | None = None
    warnings: list[str] = Field(default_factory=list)
