"""The rack and placement-group slowdown detector's policy and state (data; behaviour in group_slowdown.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

RACK = "rack"


PLACEMENT_GROUP = "placement_group"


class GroupSlowdownPolicy(BaseModel):
    """Settings of the group slowdown detector."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="False: racks and placement groups are not watched.")
    min_slowdown: float = Field(
        0.03,
        gt=0,
        lt=1,
        description="Floor of the relative excess that counts as slow: a group under 3% slow is not "
        "worth a page (and 3% is ~9 noise widths of a 128-rank rack's median at 3% jitter).",
    )
    noise_sigma: float = Field(
        5.0, gt=0, description="The threshold is at least this many noise widths of the group's median."
    )
    consecutive_steps: int = Field(
        50,
        ge=1,
        description="Slow steps in one streak before the group is flagged: at 5% slow a 128-rank "
        "rack is slow on every step, so it is found 50 steps after the onset.",
    )
    max_gap_steps: int = Field(
        2, ge=0, description="Judged steps without a slow excess that a streak survives (straggler.py)."
    )
    clear_steps: int = Field(10, ge=1, description="Consecutive in-band steps that clear a flagged group.")
    clear_fraction: float = Field(
        0.5, gt=0, le=1, description="In band (for clearing): excess under this fraction of the threshold."
    )
    min_groups: int = Field(
        4, ge=3, description="Racks (or groups) needed in a step for a reference and a noise estimate."
    )
    min_group_ranks: int = Field(
        4, ge=1, description="A group with fewer ranks reporting in a step is not judged in that step."
    )
    noise_window: int = Field(200, ge=1, description="Steps of measured spread the noise is the median of.")
    max_pending_steps: int = Field(
        8,
        ge=1,
        description="Sharded runs: a step still missing a shard's summary when a step this much newer "
        "has a summary is judged without it.",
    )
    health_every_steps: int = Field(
        10,
        ge=1,
        description="Sharded runs: every this many steps a shard's summary carries its groups' "
        "health digests (shard 0 never sees other shards' GpuHealth).",
    )

    @model_validator(mode="after")
    def _coherent(self) -> GroupSlowdownPolicy:
        if self.max_gap_steps >= self.clear_steps:
            raise ValueError(
                f"max_gap_steps ({self.max_gap_steps}) must be below clear_steps ({self.clear_steps})"
            )
        return self


@dataclass
class _Group:
    name: str
    kind: str  # RACK or PLACEMENT_GROUP
    nodes: list[str]
    size: int  # ranks in the whole run
    local: np.ndarray  # this shard's ranks of it (int64)


@dataclass
class _SizeClass:
    """Local groups with the same number of local ranks: their medians are one numpy call."""

    groups: np.ndarray  # group indices
    perm: np.ndarray  # their local ranks, concatenated
    size: int
    top: int  # the highest rank in perm


@dataclass
class _Flag:
    event_id: str
    flagged_step: int
    steps: int = 0
    in_band: int = 0


_NEVER = -(1 << 40)


@dataclass
class GroupState:
    """One run's group bookkeeping (keep one per RunState; reset per attempt)."""

    attempt: int = -1
    groups: list[_Group] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    classes: list[_SizeClass] = field(default_factory=list)
    is_rack: np.ndarray = field(default_factory=lambda: np.zeros(0, np.bool_))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    shards: int = 1
    #: step -> shard -> (group indices, medians, counts): parts not judged yet.
    pending: dict[int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)
    newest_step: int = -1
    judged_through: int = -1
    judged: int = 0  # judged steps (also indexes the streaks)
    noise: deque[float] = field(default_factory=deque)
    run_len: list[int] = field(default_factory=list)
    last_slow: list[int] = field(default_factory=list)
    onset: list[int] = field(default_factory=list)
    excess_sum: list[float] = field(default_factory=list)
    flagged: dict[int, _Flag] = field(default_factory=dict)
    #: Flagged groups diagnosed ENVIRONMENTAL (their ranks are not evicted one by one).
    environmental: set[int] = field(default_factory=set)
    #: Other shards' latest health digest per group index.
    health: dict[int, dict[str, float]] = field(default_factory=dict)
    late: int = 0
