"""The policy settings the core reads. One frozen, typed object; every field documented.

The numbers are the seed's (§3 `step_timeout: "90s"`, ARCHITECTURE.md "Hang: ... default
3x p99 step time"). Issue 4 grows this into the versioned policy file.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .baseline import BaselinePolicy
from .diagnosis import DiagnosisPolicy
from .interval import IntervalPolicy
from .paging import PagingPolicy
from .sdc_state import SdcPolicy
from .straggler import StragglerPolicy


class HangPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    p99_multiplier: float = Field(3.0, gt=1, description="step_timeout = multiplier x p99 step time.")
    default_timeout_s: float = Field(
        90.0, gt=0, description="Used until min_samples step times have been seen (seed §3)."
    )
    min_samples: int = Field(50, ge=1, description="Step times needed before the p99 is trusted.")
    window: int = Field(2000, ge=10, description="How many recent step times the p99 is taken over.")
    floor_s: float = Field(10.0, gt=0, description="Never time out faster than this.")
    ceiling_s: float = Field(1800.0, gt=0, description="Never wait longer than this.")
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Allowed from a rank's first sign of life to its first step of an attempt."
    )
    stack_collect_s: float = Field(
        30.0, gt=0, description="After an abort, how long to wait for every rank's stack dump."
    )

    @model_validator(mode="after")
    def _ordered(self) -> HangPolicy:
        if self.floor_s > self.ceiling_s:
            raise ValueError(f"floor_s ({self.floor_s}) must not exceed ceiling_s ({self.ceiling_s})")
        return self


class CorePolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    hang: HangPolicy = HangPolicy()
    baseline: BaselinePolicy = BaselinePolicy()
    sdc: SdcPolicy = SdcPolicy()
    straggler: StragglerPolicy = StragglerPolicy()
    diagnosis: DiagnosisPolicy = DiagnosisPolicy()
    interval: IntervalPolicy = IntervalPolicy()
    paging: PagingPolicy = PagingPolicy()
    dedupe_window: int = Field(
        200_000, ge=1000, description="Event ids remembered per run to drop redelivered events."
    )


def load_policy(path: str | None) -> CorePolicy:
    """The policy from a YAML file (defaults for every field it omits); None -> defaults.

    Invalid values raise pydantic's ValidationError naming the field and the reason."""
    if path is None:
        return CorePolicy()
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return CorePolicy.model_validate(data)
