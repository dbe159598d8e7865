"""Paging's policy and state (data; behaviour in paging.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PagingPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    same_node_interruptions: int = Field(2, ge=2, description="Page when one node caused this many.")
    same_step_interruptions: int = Field(2, ge=2, description="Page when one step failed this many times.")
    same_start_interruptions: int = Field(
        3,
        ge=2,
        description="Page when this many attempts resumed from one checkpoint failed before "
        "completing a step (a first step that always fails; two happen by chance).",
    )
    on_repeat_step: Literal["pause", "skip"] = Field(
        "pause",
        description="After a same_step page: pause (PauseRun: the launcher stops restarting and "
        "waits for a human) or skip (SkipUpdate of the failing step, and the run continues).",
    )
    rate_multiple: float = Field(
        5.0, gt=1, description="Page when the last hour's rate exceeds this x baseline."
    )
    rate_min_interruptions: int = Field(
        3, ge=1, description="...and at least this many interruptions fell in that hour."
    )
    rate_max_p_value: float = Field(
        1e-3,
        gt=0,
        le=1,
        description="...and that many in an hour is this unlikely at the background rate. The rule "
        "is checked at every interruption, so the p-value is that of the OTHERS in the hour before "
        "it (a scan statistic; testing all k would page about monthly by chance at 16,384 ranks). "
        "At 0.32/h, four in an hour happen about monthly (p 0.005 for the three others); five do "
        "not (p 0.0004, ~0.1 false pages a month over 233 checks).",
    )


@dataclass
class PagingState:
    """One run's interruptions by node and by step (kept across attempts)."""

    counted: set[str] = field(default_factory=set)
    #: (detection ts, interruption_id) in the order counted: the failure-rate evidence.
    timeline: list[tuple[float, str]] = field(default_factory=list)
    by_node: dict[str, list[str]] = field(default_factory=dict)
    #: (step, before any step of its attempt completed) -> interruption ids.
    by_step: dict[tuple[int, bool], list[str]] = field(default_factory=dict)
    #: (rule, subject) already paged: a pattern pages once.
    paged: set[tuple[str, str]] = field(default_factory=set)
    #: interruption_id -> the node it named ('' none), for every interruption counted.
    nodes: dict[str, str] = field(default_factory=dict)
    #: interruption_id -> (node, Quarantine event id) of the quarantines it caused.
    quarantined: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Quarantine event ids already released (a node is released once per quarantine).
    released: set[str] = field(default_factory=set)
    #: node -> the QuarantineNode command that sent it out, while it is out (node_tests.py).
    out: dict[str, str] = field(default_factory=dict)
    #: node -> the NodeSelfTestResult it failed: out for the rest of the run, never released.
    self_test_failed: dict[str, str] = field(default_factory=dict)
    #: ts of the last failure-rate page (re-armed once its window has passed).
    rate_paged_ts: float | None = None
    #: ts of the last goodput page (likewise).
    goodput_paged_ts: float | None = None
