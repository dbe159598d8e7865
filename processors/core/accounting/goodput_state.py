"""Goodput accounting's state (data; behaviour and policy in goodput.py, which re-exports
it): compiled (processors/core/compiled.py), since the quiet folds read and write its
clock per event (block.py, quiet.py), and goodput.py's pydantic policy and pickled frozen
Breakdown keep that module interpreted."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
@dataclass
class Minute:
    elapsed: float = 0.0
    restart: float = 0.0
    lost: float = 0.0
    checkpoint: float = 0.0
    straggler: float = 0.0
    interruptions: int = 0
    #: Training time lost to a smaller world (issue 45): (1 - W'/W) of each second at W'.
    narrow: float = 0.0

    def add(self, other: Minute) -> None:
        self.elapsed += other.elapsed
        self.restart += other.restart
        self.lost += other.lost
        self.checkpoint += other.checkpoint
        self.straggler += other.straggler
        self.interruptions += other.interruptions
        self.narrow += other.narrow


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
@dataclass
class Slid:
    """Minutes at or before `cursor` have slid out of a window; `out` is their sum."""

    cursor: int
    out: Minute = field(default_factory=Minute)


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
@dataclass
class GoodputState:
    clock: float | None = None
    minutes: OrderedDict[int, Minute] = field(default_factory=OrderedDict)
    #: Sum of every minute ever filled (kept when old minutes are dropped).
    totals: Minute = field(default_factory=Minute)
    #: Per window length: what has slid out of it.
    slid: dict[float, Slid] = field(default_factory=dict)
    #: Slowdown of each flagged straggler (rank -> compute / median compute).
    slowdowns: dict[int, float] = field(default_factory=dict)
    #: The world trained at, as a fraction of the run's full world (elastic training: the
    #: global batch is the same, so a second at W' of W ranks does W'/W of a second's work).
    width: float = 1.0
    checkpoints: set[tuple[int, int]] = field(default_factory=set)
    counted: set[str] = field(default_factory=set)
    last_report_ts: float | None = None
