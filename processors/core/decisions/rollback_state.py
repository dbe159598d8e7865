"""The rollback policy's state: the validated checkpoints it may roll back to (data;
behaviour in rollback.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: keep_count meaning "prune nothing" (the cadence cannot be expressed in time yet).
KEEP_ALL = 1 << 62


@dataclass(frozen=True)
class Validated:
    step: int
    uri: str
    last_verified_step: int
    #: When it was validated (the CheckpointValidated's ts): retention's clock.
    ts: float = 0.0


@dataclass
class RollbackState:
    #: The retained validated checkpoints by step.
    validated: dict[int, Validated] = field(default_factory=dict)
    #: Attempts already rolled back (one rollback per attempt, however many mismatches).
    handled: set[int] = field(default_factory=set)
    #: Validated checkpoints retention dropped, in the order it dropped them (for reports;
    #: the checkpoint manager deletes them).
    pruned: list[Validated] = field(default_factory=list)
    #: ts of the run's first validated checkpoint: the milestone periods count from here.
    origin_ts: float | None = None
    #: Recent gaps between consecutive validations: the checkpoint interval as measured.
    gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    last_ts: float | None = None
    _pruned_keys: set[tuple[int, float]] = field(default_factory=set, repr=False)
