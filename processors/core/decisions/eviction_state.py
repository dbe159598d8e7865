"""The eviction policy's settings and state (data; behaviour in eviction.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ....schemas import (
    StragglerAction,
    StragglerDiagnosed,
)

#: Actions of a diagnosis that recommend eviction.
EVICTING_ACTIONS = frozenset(
    {StragglerAction.EVICT, StragglerAction.EVICT_ONCE, StragglerAction.EVICT_AND_REPLACE}
)


#: Stands for an infinite payback on the wire (records are finite-only).
NEVER_S = 1e12


#: Diagnosed event ids remembered for idempotency (flags are rare: this is hours of them).
_HANDLED_MAX = 4096


class EvictionPolicy(BaseModel):
    """Settings of straggler eviction (seed §7 step 3, R2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="False: decide nothing but 'not_evicted'; never evict.")
    horizon_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="Evict only if the payback R / (P(healthy) x straggler cost) is not longer than this.",
    )
    min_gap_s: float = Field(
        3600.0,
        ge=0,
        description="At most one eviction per this much event time per run; a candidate inside the "
        "gap is deferred and decided again when the gap has passed.",
    )
    prior_healthy: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Prior P(healthy replacement) before the run has eviction outcomes (Beta prior mean).",
    )
    prior_weight: float = Field(
        4.0,
        gt=0,
        description="How many evictions the prior is worth (Beta pseudo-counts a + b): the smaller, "
        "the sooner the run's own outcomes dominate.",
    )
    default_restart_s: float = Field(
        600.0, gt=0, description="R until the run has measured restarts (the seed's 10 minutes)."
    )
    restart_samples: int = Field(
        20, ge=1, description="R is the median restart_s of this many latest recoveries of the run."
    )
    outcome_steps: int = Field(
        200,
        ge=1,
        description="An eviction resolved the straggle when the next attempt completes this many steps "
        "without the rank being flagged again; keep it above the straggler detector's "
        "consecutive_steps (100), or a recurring straggle cannot be flagged in time.",
    )


@dataclass
class _Candidate:
    """A diagnosed straggler whose eviction was deferred by the rate limit."""

    diagnosed: StragglerDiagnosed
    rack: str | None
    decision_id: str  # the latest decision about it (the deferral)


@dataclass
class _Outcome:
    """An eviction whose outcome is not known yet."""

    decision_id: str
    rank: int
    attempt: int  # the attempt the eviction was issued in
    judged_attempt: int = -1  # the later attempt being watched (-1: none started yet)
    first_step: int = -1  # that attempt's first completed step


@dataclass(frozen=True)
class EvictionOutcome:
    """What an eviction turned out to do (returned by on_flagged/on_step for the caller's log)."""

    decision_id: str
    rank: int
    resolved: bool


@dataclass
class EvictionState:
    """One run's eviction history (keep one per RunState, across attempts)."""

    resolved: int = 0
    unresolved: int = 0
    #: The most recent eviction: event ts, rack (None: unknown), decision id.
    last_ts: float | None = None
    last_rack: str | None = None
    last_id: str = ""
    #: Evictions waiting for their outcome (at most a few: one an hour).
    pending: list[_Outcome] = field(default_factory=list)
    #: Rate-limited candidates by rank, re-decided by on_time.
    deferred: dict[int, _Candidate] = field(default_factory=dict)
    #: Earlier evictions whose same-rack page went out (page once per earlier eviction).
    paged_after: set[str] = field(default_factory=set)
    #: StragglerDiagnosed ids already decided (at-least-once delivery decides once).
    handled: OrderedDict[str, None] = field(default_factory=OrderedDict)
    #: Measured restart seconds (InterruptionRecovered), newest last.
    restarts: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    evictions: int = 0
    #: node -> (attempt, id of the decision or quarantine taking it out at that attempt's end).
    leaving: dict[str, tuple[int, str]] = field(default_factory=dict)
