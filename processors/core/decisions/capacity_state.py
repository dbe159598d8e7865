"""Elastic training's settings and state (issue 45; data, behaviour in capacity.py): what
the core needs to decide, when an interruption takes nodes out and no spare is ready,
whether the run waits for a replacement or goes on at a smaller world (the rule itself:
trainguard/common/elastic.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports no
behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class ElasticPolicy(BaseModel):
    """When capacity is lost and no spare is ready: wait for the replacement or go on at a
    smaller world, whichever loses less of the full world's training until it trains
    again (trainguard/common/elastic.py). Costs come from the run's history where it has
    some, else from these priors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        True,
        description="Shrink when the rule says so; false: always wait for the replacement (the "
        "decision still carries the rule's numbers, for a backtest to price).",
    )
    replacement_prior_s: float = Field(
        1800.0,
        ge=0,
        description="Expected seconds from a loss to a replacement node ready to join, until the run "
        "has measured its own (the time from a loss with no spare to the next attempt at full size).",
    )
    shrink_prior_s: float = Field(
        120.0,
        ge=0,
        description="Seconds from the loss to training at the smaller world, the survivors in their "
        "processes (process-group re-init, checkpoint reload, first step), until measured.",
    )
    grow_prior_s: float = Field(
        120.0,
        ge=0,
        description="Seconds a planned grow-back costs: the stop at a checkpoint boundary to the first "
        "step at full size (the replacement's processes started ahead), until measured.",
    )
    min_world_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Never train at fewer ranks than this fraction of the full world: below it, wait.",
    )
    world_multiple: int = Field(
        0,
        ge=0,
        description="A smaller world must be a multiple of this (a node, a tensor- or pipeline-"
        "parallel group); 0: the run's ranks per node (whole nodes).",
    )
    batch_divisor: int = Field(
        0,
        ge=0,
        description="A smaller world must divide this (the global batch in micro-batches, or the "
        "job's data shards, split evenly over the ranks); 0: no such constraint.",
    )
    samples: int = Field(
        8, ge=1, description="Each measured cost is the median of this many latest samples of the run."
    )


@dataclass
class CapacityState:
    """A run's elastic bookkeeping, on its coordinator."""

    #: The run's full world: the largest it has trained at.
    full_world: int = 0
    #: The newest attempt whose RunStarted was seen.
    attempt: int = -1
    #: Spares the launcher said were ready when the attempt started (None: not said), and
    #: nodes lost since (each takes one).
    spares: int | None = None
    taken: int = 0
    #: Losses with no spare ready, by interruption id: their detection ts, until an attempt
    #: at full size starts (a sample of the replacement's arrival).
    waiting: dict[str, float] = field(default_factory=dict)
    #: The capacity decisions made ("wait", "shrink"), by interruption id, until recovered:
    #: a shrink's recovery measures the shrink, a wait's the replacement, not a restart.
    decided: dict[str, str] = field(default_factory=dict)
    #: Planned grow-backs declared, until recovered (their recovery measures a grow).
    grows: set[str] = field(default_factory=set)
    #: The newest loss a capacity decision was made for, and the one whose smaller world is
    #: in force ('' none): the planned grow-back's cause.
    last_loss: str = ""
    shrunk_by: str = ""
    #: Set when an attempt at a larger world starts while shrunk: the grow-back to declare,
    #: and the smaller world it grows from.
    growing: str = ""
    grow_from: int = 0
    #: Measured seconds: replacement arrivals, restarts onto a ready node, shrinks, grows.
    eta_s: deque[float] = field(default_factory=deque)
    restart_s: deque[float] = field(default_factory=deque)
    shrink_s: deque[float] = field(default_factory=deque)
    grow_s: deque[float] = field(default_factory=deque)
