"""The straggler detector's state (data; behaviour in straggler.py; its policy in
straggler_policy.py, re-exported here).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
from mypy_extensions import mypyc_attr

from .straggler_policy import StragglerPolicy

__all__ = ["MAD_TO_SIGMA", "StragglerPolicy", "StragglerState"]  # (the policy, for its old importers)

#: Scales the MAD to the standard deviation of a normal distribution.
MAD_TO_SIGMA = 1.4826


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
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


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
@dataclass
class _Flag:
    event_id: str
    flagged_step: int
    steps: int = 0  # evaluated steps since flagged
    in_band: int = 0  # current run of in-band steps


_NEVER = -(1 << 40)


_NAN = array("d", [float("nan")])


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
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
