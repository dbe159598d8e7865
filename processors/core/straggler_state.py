"""The straggler detector's policy and state (data; behaviour in straggler.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Scales the MAD to the standard deviation of a normal distribution.
MAD_TO_SIGMA = 1.4826


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


@dataclass
class _Pending:
    """Reports collected for one step not yet evaluated. Plain buffers (cheap to write one
    rank at a time), read as numpy arrays without copying when the step is evaluated."""

    values: array[float]  # compute_s by rank (NaN: no report)
    stamps: array[float]  # ts of the kept report by rank
    seen: bytearray  # 1 where the rank reported
    ids: list[str | None]  # the kept report's event_id by rank (valid where seen)
    count: int  # ranks that reported
    need: int  # expected, not-missing ranks still to report


@dataclass
class _Flag:
    event_id: str
    flagged_step: int
    steps: int = 0  # evaluated steps since flagged
    in_band: int = 0  # current run of in-band steps


_NEVER = -(1 << 40)


_NAN = array("d", [float("nan")])


@dataclass
class StragglerState:
    """One run's straggler bookkeeping (keep one per RunState, across attempts).

    Per-rank streaks are Python lists, touched only for the (few) slow ranks of a step:
    a streak is over when more than max_gap_steps evaluations passed since the rank's
    last slow step, which is checked when it is slow again, so in-band ranks cost nothing.
    """

    attempt: int = -1
    expected: int | None = None  # world size; None: unknown, steps evaluate on age only
    #: First rank watched: a shard of a sharded run watches ranks [first, expected).
    first: int = 0
    capacity: int = 0
    newest_step: int = -1
    evaluated_through: int = -1
    pending: dict[int, _Pending] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    #: Per rank, the current slow streak: slow steps in it, the evaluation index of its
    #: last slow step, its first step, and its sums of z and compute/median.
    slow_run: list[int] = field(default_factory=list)
    last_slow: list[int] = field(default_factory=list)
    onset: list[int] = field(default_factory=list)
    z_sum: list[float] = field(default_factory=list)
    ratio_sum: list[float] = field(default_factory=list)
    #: Per rank: consecutive evaluated steps without its report.
    absent: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    any_absent: bool = False
    #: Ranks reported missing and not back since (not waited for).
    missing: set[int] = field(default_factory=set)
    #: The same ranks as a mask over the capacity (counting them is then one numpy call,
    #: however many are missing: a run whose most ranks never report stays cheap).
    missing_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.bool_))
    flagged: dict[int, _Flag] = field(default_factory=dict)
    #: An evaluated step's buffers, reused by the next (no fresh pages every step).
    spare: _Pending | None = None
    #: Work buffers of an evaluation (sized to the capacity).
    scratch: tuple[np.ndarray, np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.empty(0), np.empty(0), np.empty(0, np.bool_))
    )
    # counters (kept across attempts; `evaluated` also indexes evaluations)
    evaluated: int = 0
    duplicates: int = 0
    late: int = 0
    out_of_range: int = 0
