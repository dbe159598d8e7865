"""Which validated checkpoints a run keeps (seed R6, change 1): enough recent ones that a
clean ancestor survives a late SDC detection, plus a milestone every 6 h for the whole run.

Pure: the caller says which checkpoints exist and deletes the ones not retained.

Recent checkpoints. The rollback target is the newest checkpoint at or before the
verification watermark (the newest passing SDC check), so the checkpoints written since
the watermark must not push it out. The watermark is at most one check interval W stale
when a mismatch is found, and a checkpoint is written every T, so

    keep = 3 x ceil(W / T) + 2

(:func:`keep_count_for`). The ratio is rounded UP: an interval of W can hold ceil(W / T)
checkpoints (the seed's own "up to three checkpoints can be written between checks" for
33 min / 13.6 min), so for the seed's numbers this keeps 3 x 3 + 2 = 11, where the
seed's unrounded 3 x 2.43 + 2 gives ~9. Two more checkpoints of insurance, and the same
rule as :func:`.rollback.retention_count`, which counts in steps.

W is how stale the watermark can get: the interval between consecutive passing checks
that advance it. Every passing check advances it, whichever rank it ran on (the
self-check rotates over the ranks, one rank per check, ``SdcPolicy.self_check_every``
steps apart), so W is the self-check interval; with self-checks off, the cross-rank
check interval (``cross_check_every``); with both off nothing advances the watermark
and no mismatch can come, so only ``min_keep`` are kept. :func:`watermark_interval_steps`.

Milestones. Time is cut into periods of ``milestone_every_s`` (6 h) from the run's first
validated checkpoint; the FIRST validated checkpoint of each period is its milestone and
is kept for the whole run. A period in which nothing was validated (the run was down)
has none. The rule is stable: a checkpoint that arrives later in a period never
displaces the period's milestone, so a milestone, once kept, is never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from .sdc_state import SdcPolicy

#: Float slack when rounding W / T up: 20 s / 10 s is two checkpoints, not three.
_EPS = 1e-9


class RetentionPolicy(BaseModel):
    """Retention of validated checkpoints beyond the recent ones the SDC cadence needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    milestone_every_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="One milestone checkpoint per this much run time (the first validated one of "
        "each period, counted from the run's first validated checkpoint), kept for the whole run "
        "(seed R6).",
    )
    min_keep: int = Field(
        2,
        ge=1,
        description="Never keep fewer recent validated checkpoints than this, whatever the check "
        "and checkpoint cadences say (the +2 of 3 x (W / T) + 2).",
    )


class Checkpoint(Protocol):
    """A validated checkpoint as retention sees it: its step (its identity) and when it was validated."""

    @property
    def step(self) -> int: ...

    @property
    def ts(self) -> float: ...


def watermark_interval_steps(sdc: SdcPolicy) -> int:
    """Steps between consecutive passing checks that advance the verification watermark:
    the rotating self-check's interval, else the cross-rank check's; 0 when both are off."""
    return sdc.self_check_every or sdc.cross_check_every


def keep_count_for(sdc_check_interval_s: float, checkpoint_interval_s: float) -> int:
    """Recent validated checkpoints to keep: 3 x ceil(W / T) + 2 (W: how stale the
    watermark can get, T: the checkpoint interval, both in seconds; see the module doc)."""
    if checkpoint_interval_s <= 0:
        raise ValueError(f"checkpoint interval must be positive, got {checkpoint_interval_s}")
    ratio = max(0.0, sdc_check_interval_s) / checkpoint_interval_s
    return 3 * math.ceil(ratio - _EPS) + 2


def retained(
    checkpoints: Iterable[Checkpoint],
    keep_count: int,
    policy: RetentionPolicy,
    origin_ts: float | None = None,
) -> set[int]:
    """Steps of the checkpoints to keep: the newest `keep_count` (at least ``min_keep``) by
    validation time, and each milestone period's first. Periods count from `origin_ts` (the
    run's first validated checkpoint; default: the earliest of `checkpoints`)."""
    order = sorted(checkpoints, key=lambda c: (c.ts, c.step))
    if not order:
        return set()
    keep = {c.step for c in order[-max(keep_count, policy.min_keep) :]}
    origin = order[0].ts if origin_ts is None else origin_ts
    milestones: dict[int, int] = {}
    for c in order:
        milestones.setdefault(math.floor((c.ts - origin) / policy.milestone_every_s), c.step)
    return keep | set(milestones.values())
