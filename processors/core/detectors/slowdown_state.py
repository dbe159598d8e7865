"""The windowed slowdown detector's policy and state (data; behaviour in slowdown.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md). Not compiled (its policy is
a pydantic model, processors/core/compiled.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

RANK = "rank"
NODE = "node"
LEVELS = (RANK, NODE)
#: The two tests: a unit against the run's reference, and against its own past.
LEVEL = "level"
CHANGE = "change"


class SlowdownPolicy(BaseModel):
    """Settings of the windowed slowdown detector (issue 47). No threshold is set here: each
    is derived from the noise measured on the run and the false-alarm budget below."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="False: only the per-step rule (straggler.py) flags ranks.")
    block_steps: int = Field(
        32,
        ge=4,
        description="Steps per block: each rank's median compute of a block, against the block's "
        "median rank, is the unit of evidence (a GC pause or a tail event of one step moves a "
        "32-step median by one order statistic, not by its size).",
    )
    horizons: tuple[int, ...] = Field(
        (1, 2, 4, 8),
        description="Windows, in blocks, a rank's (and a node's) mean block excess is judged over: "
        "the longer, the smaller the slowdown it can see (noise falls as 1/sqrt(window)), the "
        "later: the smaller the slower.",
    )
    false_flags_per_10k_steps: float = Field(
        0.01,
        gt=0,
        description="The false-alarm budget: expected false flags per 10,000 steps of a "
        "`reference_ranks`-rank run on noise, split evenly over the two levels (rank, node) and "
        "the horizons; each window is then judged at the Gaussian quantile of its share, in "
        "units of the spread of that window's statistic measured across the run's ranks "
        "(~6.2 sigma for a rank, ~5.9 for a node of 8 at the defaults).",
    )
    reference_ranks: int = Field(16_384, ge=1, description="The run size the budget is stated for.")
    min_slowdown: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Floor of a flaggable slowdown; None: derived from the eviction payback, the "
        "slowdown whose eviction pays back exactly within the horizon (R / (P(healthy) x (1 - 1/s)) "
        "= horizon: 3.6% at R = 600 s, P = 0.8, 6 h). Below it nothing could be done about it.",
    )
    baseline_blocks: int = Field(
        16,
        ge=0,
        description="Blocks of each unit's own past (before its longest window) a second test "
        "compares its windows with: a GPU persistently a little slower (the silicon lottery) "
        "widens the spread across ranks, which the first test's thresholds must take in; "
        "against its own past it cancels, so a slowdown that starts after this many blocks is "
        "seen at the windows' noise alone. Flagged only if it also costs the job the payback "
        "floor. 0: the reference test only.",
    )
    noise_blocks: int = Field(
        16, ge=1, description="Blocks of measured spread each threshold's noise is the median of."
    )
    min_units: int = Field(
        16, ge=4, description="Fewer ranks (nodes) with a statistic in a window: the level is not judged."
    )
    min_group_nodes: int = Field(
        4,
        ge=3,
        description="A rack (placement group) of at least this many nodes here is a node's and its "
        "ranks' context: they are judged against the slower of the run's reference and their "
        "rack's median, so a rack slow as a whole stays the group detector's.",
    )
    clear_fraction: float = Field(
        0.5, gt=0, le=1, description="In band (for clearing): excess under this fraction of the threshold."
    )
    clear_blocks: int = Field(2, ge=1, description="Consecutive in-band blocks that clear a flag.")
    min_block_fraction: float = Field(
        0.5, gt=0, le=1, description="A block with fewer evaluated steps than this share is not judged."
    )

    @field_validator("horizons")
    @classmethod
    def _sorted(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(h < 1 for h in value) or list(value) != sorted(set(value)):
            raise ValueError(f"horizons must be increasing positive block counts, got {value}")
        return value


@dataclass
class _Flag:
    level: str
    unit: int  # local rank or node index
    rank: int  # the rank the flag names (a node's: its slowest)
    event_id: str
    flagged_step: int
    horizon: int  # index into the policy's horizons
    test: str = LEVEL  # LEVEL or CHANGE
    base: float = 0.0  # CHANGE: the unit's own past when flagged
    threshold: float = 0.0  # the threshold it crossed
    blocks: int = 0  # judged blocks since flagged
    in_band: int = 0


@dataclass
class _Layout:
    """This shard's ranks and nodes, and the groups (racks, placement groups) that are their
    context; rebuilt when the owned ranks or the run's node list change."""

    key: tuple[int, int, int, int]
    first: int
    n: int  # local ranks
    rpn: int  # ranks per node (0: no node level)
    node_names: list[str]
    #: (groups, max members) local node indices, -1 padded: each group's median in one call.
    members: np.ndarray
    #: Flat (node index, group index) pairs of `members`, for each node's slowest group.
    pairs: tuple[np.ndarray, np.ndarray]


@dataclass
class SlowdownState:
    """One run's windowed slowdown bookkeeping (one per RunState; reset per attempt)."""

    attempt: int = -1
    layout: _Layout | None = None
    block: int = -1  # the block being filled (step // block_steps)
    first_step: int = -1  # its first evaluated step
    columns: int = 0  # steps recorded in it
    holes: bool = False  # a rank did not report a step of it
    reports: int = 0  # reports recorded in it (at most: a step's count is the run's)
    #: (local ranks, block_steps) compute seconds of the block being filled (NaN: no report).
    buf: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    #: Rings of the last blocks' log excess (rank's block median over the block's median rank),
    #: per level: (units, longest horizon + baseline blocks); the step each column started at.
    ring: dict[str, np.ndarray] = field(default_factory=dict)
    ring_steps: deque[int] = field(default_factory=deque)
    pos: int = 0  # next ring column
    #: Per (test, level, horizon index): the spread measured across units in recent blocks.
    noise: dict[tuple[str, str, int], deque[float]] = field(default_factory=dict)
    flagged: dict[tuple[str, int], _Flag] = field(default_factory=dict)
    #: Per-step flags (straggler.py) on units this detector had flagged: neither they nor
    #: their clears go out (one flag per rank and node); kept by event id.
    absorbed: set[str] = field(default_factory=set)
    #: (level, unit) -> the step its flag cleared at (a node's too for its ranks): a window
    #: reaching back before it would re-flag the slowdown that just ended.
    cleared: dict[tuple[str, int], int] = field(default_factory=dict)
    judged: int = 0  # blocks judged (counter, kept across attempts)
    skipped: int = 0  # blocks too thinly reported to judge
