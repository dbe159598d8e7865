"""The failure-rate baseline's policy (a pydantic model: kept apart from its state, which
runs compiled, processors/core/compiled.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ....common.checkpoint_interval import REFERENCE_MTBF_S, REFERENCE_WORLD_SIZE

_HOUR = 3600.0


class BaselinePolicy(BaseModel):
    """Settings of the failure-rate baseline; the defaults are the seed's numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reference_world_size: int = Field(
        REFERENCE_WORLD_SIZE,
        ge=1,
        description="World size of the reference point. Also the prior's world size when a run's "
        "is unknown (the most fragile size the seed quotes: a conservative, short MTBF).",
    )
    reference_mtbf_s: float = Field(
        REFERENCE_MTBF_S,
        gt=0,
        description="MTBF at the reference world size (seed: 3.1 h at 16,384 GPUs). The prior "
        "for world size W is reference_mtbf_s x reference_world_size / W.",
    )
    prior_weight_interruptions: float = Field(
        2.0,
        gt=0,
        description="How many interruptions the prior is worth (the Gamma prior's shape). "
        "Larger: a young run trusts the world-size prior longer.",
    )
    confidence: float = Field(
        0.9, gt=0, lt=1, description="Probability mass of the equal-tailed MTBF interval."
    )
    window_s: float = Field(
        _HOUR, gt=0, description="Trailing event-time window of the recent rate (R5: 'in 1 h')."
    )
    check_every_s: float = Field(
        1.0,
        ge=0,
        description="Between interruptions the estimate is re-checked at most once per this many "
        "seconds of event time (it moves only with exposure; checking on every event would "
        "dominate the core's cost at 16,384 ranks).",
    )
    publish_change_fraction: float = Field(
        0.1,
        ge=0,
        description="Besides on every interruption (always published), an MtbfUpdate is published "
        "when the estimate has moved by more than this fraction from the last published one "
        "(from the prior before the first). Between interruptions the estimate only grows with "
        "exposure, so this bounds the updates of a quiet run to a handful.",
    )
