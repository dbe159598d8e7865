"""The straggler detector's policy (a pydantic model: kept apart from its state, which runs
compiled, processors/core/compiled.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StragglerPolicy(BaseModel):
    """Settings of the straggler detector. Defaults are the seed's (§3 `straggler_sigma: 3`,
    §7 "z > 3 for 100 consecutive steps") where it gives one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sigma: float = Field(3.0, gt=0, description="Robust z above which a rank's step is slow (seed §3).")
    consecutive_steps: int = Field(
        100, ge=1, description="Slow evaluated steps in one streak before the rank is flagged (seed §7)."
    )
    max_gap_steps: int = Field(
        2,
        ge=0,
        description="Consecutive evaluated steps without a slow report (in band, or no report) "
        "a slow streak survives; they neither count nor break it. An 18%-slow rank at 3% "
        "jitter dips under 3 sigma on ~1% of steps: with 0 (the literal rule) 20 of 30 seeded "
        "18% stragglers were flagged later than 110 steps after onset, with 2 none (at most "
        "103). A healthy rank's isolated spikes never chain into 100 slow steps either way.",
    )
    clear_steps: int = Field(
        10, ge=1, description="Consecutive in-band steps after which a flagged rank is cleared."
    )
    min_ranks: int = Field(
        4, ge=3, description="Below this many reports in a step no statistics are computed."
    )
    mad_floor_fraction: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="The MAD is at least this fraction of the median, so a near-perfectly uniform "
        "job does not flag noise: at sigma 3 the smallest flaggable slowdown is then "
        "3 x 1.4826 x 1% = 4.4% of the median. Below that an eviction costing a ~600 s "
        "restart would take over 4 h to pay back (seed §7 payback), and 1% is the order of "
        "timer and clock noise on the measurement itself.",
    )
    max_pending_steps: int = Field(
        8,
        ge=1,
        description="A step still incomplete when a step this much newer has been seen is "
        "evaluated without its late ranks (8 steps = 16 s at 2 s/step, against 1 s "
        "per-node telemetry batches).",
    )
    missing_after_steps: int = Field(
        3,
        ge=1,
        description="Consecutive evaluated steps a rank must be absent from to be reported "
        "missing. One lost report (the rank agent drops its oldest events rather than "
        "block training) is not a missing rank.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> StragglerPolicy:
        if self.max_gap_steps >= self.clear_steps:
            raise ValueError(
                f"max_gap_steps ({self.max_gap_steps}) must be below clear_steps ({self.clear_steps}): "
                "a rank must not clear while its slow streak is still alive"
            )
        return self
