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

W is how stale the watermark can get. There are two (one per kind of evidence): the
self-check watermark, which every passing self-check advances (one rank per check,
``SdcPolicy.self_check_every`` steps apart), bounds a rollback after a transient fault;
each rank's cross-rank watermark, which every ring check advances for all ranks
(``SdcPolicy.cross_check_interval()`` steps apart), bounds a rollback after a
deterministic one. W is the self-check interval (the ring's when self-checks are off);
with both off nothing advances a watermark and no mismatch can come, so only
``min_keep`` are kept. :func:`watermark_interval_steps`.

Pinned. A deterministic fault's rollback needs the newest validated checkpoint at or
before the culprit's cross-rank watermark, up to one ring interval old (10,000 steps at
the default budget, 100 x the self-check's). Rather than keeping every checkpoint of a
ring interval (3 x ceil(W_ring / T) + 2: a hundred times as many at the defaults), the
newest validated checkpoint at or before the OLDEST per-rank cross-rank watermark is
kept whatever the count says. Every rank's watermark is at least that old, so it is an
ancestor for any culprit; with every rank covered at every ring check it is exactly the
one a culprit found at the next check needs, and a rank whose watermark is stuck (it
stopped reporting) keeps its own ancestor pinned.

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

from ..detectors.sdc_state import SdcPolicy

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
    """How many steps stale the self-check watermark can be when a mismatch is found: the
    self-check interval; with self-checks off, the ring check's; 0 when both are off. (A
    deterministic fault's bound, the cross-rank watermark, is protected by the pin.)"""
    return sdc.self_check_every or sdc.cross_check_interval()


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
    pin: int | None = None,
) -> set[int]:
    """Steps of the checkpoints to keep: the newest `keep_count` (at least ``min_keep``) by
    validation time, each milestone period's first, and the newest at or before `pin` (the
    oldest per-rank cross-rank watermark: what a deterministic-fault rollback may need).
    Periods count from `origin_ts` (the run's first validated checkpoint; default: the
    earliest of `checkpoints`)."""
    order = sorted(checkpoints, key=lambda c: (c.ts, c.step))
    if not order:
        return set()
    keep = {c.step for c in order[-max(keep_count, policy.min_keep) :]}
    if pin is not None:
        pinned = [c.step for c in order if c.step <= pin]
        if pinned:
            keep.add(max(pinned))
    origin = order[0].ts if origin_ts is None else origin_ts
    milestones: dict[int, int] = {}
    for c in order:
        milestones.setdefault(math.floor((c.ts - origin) / policy.milestone_every_s), c.step)
    return keep | set(milestones.values())
