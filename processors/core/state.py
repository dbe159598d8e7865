"""The core's state: what it knows about each run. Plain data, no behaviour beyond
bookkeeping; detectors in sibling modules read and update it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import orjson
from mypy_extensions import mypyc_attr

from .accounting.baseline_state import BaselineState
from .accounting.goodput_state import GoodputState
from .decisions.capacity_state import CapacityState
from .decisions.eviction_state import EvictionState
from .decisions.interval import IntervalState
from .decisions.paging_state import PagingState
from .decisions.rollback_state import RollbackState
from .dedupe import DedupeWindow
from .detectors.diagnosis_state import HealthState
from .detectors.group_state import GroupState
from .detectors.hazard_state import DrainState, HazardState
from .detectors.sdc_state import SdcState
from .detectors.slowdown_state import SlowdownState
from .detectors.straggler_state import StragglerState


class RunPhase(StrEnum):
    """A run attempt's lifecycle (an explicit state machine: docs/architecture.md)."""

    STARTING = "starting"  # registered, no step completed yet in this attempt
    TRAINING = "training"
    INTERRUPTED = "interrupted"  # an interruption was declared; waiting for the next attempt
    FINISHED = "finished"


#: Allowed lifecycle transitions; anything else is a bug in the core.
TRANSITIONS: dict[RunPhase, frozenset[RunPhase]] = {
    RunPhase.STARTING: frozenset({RunPhase.TRAINING, RunPhase.INTERRUPTED, RunPhase.STARTING}),
    RunPhase.TRAINING: frozenset({RunPhase.INTERRUPTED, RunPhase.FINISHED, RunPhase.STARTING}),
    RunPhase.INTERRUPTED: frozenset({RunPhase.STARTING}),
    RunPhase.FINISHED: frozenset({RunPhase.STARTING}),
}


@mypyc_attr(native_class=False)  # compiled (core/compiled.py): an exception stays a Python class
class IllegalTransition(RuntimeError):
    pass


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class RankState:
    node: str
    last_step: int = -1
    #: Emitter-clock ts of the rank's latest completed step (or of its first sign of
    #: life in this attempt). Compared only with the same rank's later ts: skew-free.
    progress_ts: float | None = None
    last_seen_ts: float = 0.0
    compute_s: float = 0.0
    total_s: float = 0.0
    exited: bool = False
    requested_exit: bool = False
    stack_signature: str = ""
    #: The training phase of its latest heartbeat ('' not reported): a hang's evidence
    #: when no stack dump comes.
    phase: str = ""
    phase_ts: float = 0.0
    #: A non-coordinator shard: the phase last forwarded to shard 0 in this stall.
    forwarded_phase: str = ""

    def note_step(self, step: int, ts: float, compute_s: float, total_s: float) -> None:
        """A step timing of this rank: its newest step, its progress, its latest times."""
        if step > self.last_step:
            self.last_step = step
        if self.progress_ts is None or ts > self.progress_ts:
            self.progress_ts = ts
        self.compute_s, self.total_s = compute_s, total_s


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class PendingHang:
    """A hang was detected and an abort with stack dump sent; collecting stacks."""

    event_id: str
    detected_ts: float
    last_step: int
    #: The rank whose heartbeat showed the stall first: a witness, never the culprit as such.
    witness_rank: int
    stalled_s: float = 0.0
    #: When the collection window opened (processors/core/detectors/stack_window.py); None: not yet.
    window_from: float | None = None


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class PendingCrash:
    """Ranks died of a lost peer (RankExit.peer_lost): evidence about another rank, so the
    core waits for the culprit's own exit or for the window to show which hosts went silent
    (processors/core/detectors/peer_loss.py)."""

    event_id: str  # the first such exit, or the hang that handed over
    first_ts: float
    #: The hang that opened this wait (engine._maybe_conclude_hang: its stacks named nobody
    #: and a host went silent); None: a peer-lost exit opened it. When no host turns out
    #: lost, the hang's verdict stands, not a lost peer's (no rank said it lost one).
    hang: PendingHang | None = None


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class OpenInterruption:
    """Declared, waiting for the next attempt's first step to measure restart time."""

    interruption_id: str
    event_id: str
    detected_ts: float
    #: Fault onset to detection (a hang's stall; 0 for a crash, which reports itself).
    detect_s: float = 0.0
    lost_steps: int = 0
    #: ts of the next attempt's launch (its RunStarted), when seen.
    launched_ts: float | None = None
    #: The newest step completed when it was declared, the checkpoint its lost steps count
    #: back to (the newest validated one known then: the restart may resume from a newer
    #: one, validated after the crash, or an older one, if that fails verification), and
    #: the median step time its lost work was charged at.
    step: int = -1
    checkpoint_step: int = -1
    step_s: float = 0.0


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class RunState:
    run_id: str
    world_size: int | None = None
    #: This state's shard of the run and the ranks per shard (0: not sharded); see
    #: schemas/sharding.py. Shard 0 coordinates: it alone makes run-level decisions.
    shard: int = 0
    shard_ranks: int = 0
    ranks_per_node: int = 1
    #: The attempt's hosts in placement order (RunStarted): rank r runs on
    #: nodes[r // ranks_per_node]; () when no RunStarted was seen.
    nodes: tuple[str, ...] = ()
    racks: dict[str, str] = field(default_factory=dict)
    attempt: int = 0
    phase: RunPhase = RunPhase.STARTING
    ranks: dict[int, RankState] = field(default_factory=dict)
    #: Newest completed step of the job in this attempt (max over ranks).
    job_step: int = -1
    #: Highest step ever completed in any attempt (for lost-work accounting).
    high_water_step: int = -1
    resumed_from_step: int = -1
    last_validated_step: int = -1
    #: Newest step any rank completed in this attempt as its exits report it (RankExit's
    #: step and job_step, from the ranks' progress files): exact even while the survivors'
    #: last StepTimings are still on their way.
    exit_step: int = -1
    #: The interruption this attempt restarts after ('' none): a resume's rejections belong to it.
    restart_of: str = ""
    #: An attempt whose ranks found no valid checkpoint to resume from (decisions/resume.py): its
    #: crashes are a checkpoint fault, not a node's.
    no_checkpoint_attempt: int = -1
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    pending_hang: PendingHang | None = None
    pending_crash: PendingCrash | None = None
    open_interruption: OpenInterruption | None = None
    interruptions: int = 0
    first_ts: float | None = None
    last_ts: float = 0.0
    #: Steps of useful progress (never counts a step twice across restarts).
    useful_steps: int = 0
    #: Failure-rate baseline: kept across attempts (it is the run's history).
    baseline: BaselineState = field(default_factory=BaselineState)
    #: Silent-data-corruption checks and the verification watermark (R3, R6).
    sdc: SdcState = field(default_factory=SdcState)
    #: Straggler streaks (seed §7) and the GPU health that diagnoses them (R2).
    straggler: StragglerState = field(default_factory=StragglerState)
    health: HealthState = field(default_factory=HealthState)
    #: Rack and placement-group slowdown (issue 14): per shard its groups' step medians,
    #: on shard 0 the run-wide reference, streaks and flags.
    groups: GroupState = field(default_factory=GroupState)
    #: Nodes and ranks persistently a few percent slow, judged over windows (issue 47).
    slowdown: SlowdownState = field(default_factory=SlowdownState)
    #: Checkpoint cost samples and the interval in force (seed §6).
    interval: IntervalState = field(default_factory=IntervalState)
    #: Interruptions by node and step, and the pages already sent (seed R5).
    paging: PagingState = field(default_factory=PagingState)
    #: Where the run's time went, by minute (seed §6).
    goodput: GoodputState = field(default_factory=GoodputState)
    #: Straggler evictions: the rate limit, the rack rule and P(healthy) (seed R2).
    eviction: EvictionState = field(default_factory=EvictionState)
    #: Validated checkpoints, for the rollback to the clean ancestor (R6).
    rollback: RollbackState = field(default_factory=RollbackState)
    #: Elastic training: the full world, spares, and what waits, shrinks and grows cost (issue 45).
    capacity: CapacityState = field(default_factory=CapacityState)
    #: Failure prediction: each GPU's precursors and the fleet's noise (any shard), and the
    #: drains decided (shard 0) (issue 46).
    hazard: HazardState = field(default_factory=HazardState)
    drain: DrainState = field(default_factory=DrainState)
    seen: DedupeWindow = field(default_factory=DedupeWindow)
    duplicates: int = 0
    stale: int = 0
    #: Records refused: a rank outside the world size (no RankState is made for it).
    rejected: int = 0

    # A worker's snapshot pickles every run it holds (processors/snapshot.py). The dedupe
    # window (200,000 ids at 16,384 ranks) goes as one JSON array, oldest first: pickle
    # takes a container item by item in Python and memoizes every string (~95 ms, issue 20).
    # Field by field, not through __dict__: a compiled RunState has none (core/compiled.py).
    def __getstate__(self) -> dict[str, Any]:
        saved = {f.name: getattr(self, f.name) for f in fields(self)}
        saved["seen"] = orjson.dumps(list(self.seen))
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        for name, value in saved.items():
            if name != "seen":
                setattr(self, name, value)
        self.seen = DedupeWindow(orjson.loads(saved["seen"]))

    @property
    def coordinator(self) -> bool:
        return self.shard == 0

    def owned(self) -> range | None:
        """The ranks this state watches (None while the world size is unknown)."""
        first, stop = self.owned_bounds()
        return None if stop is None else range(first, stop)

    def owned_bounds(self) -> tuple[int, int | None]:
        """owned()'s start and stop, (0, None) while the world size is unknown: the ranks
        schemas/sharding.py owned_ranks routes to this shard, computed here in the compiled
        core (a hot path's check, block.steady, calls it per event)."""
        size, per_shard = self.world_size, self.shard_ranks
        if size is None:
            return 0, None
        if per_shard == 0:
            return 0, size
        return self.shard * per_shard, min(size, (self.shard + 1) * per_shard)

    def move_to(self, phase: RunPhase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"run {self.run_id}: {self.phase} -> {phase} is not allowed")
        self.phase = phase


def state_key(run_id: str, shard: int) -> str:
    """Where a run's shard lives in CoreState.runs: the run id for shard 0 (and for an
    unsharded run), so that lone records (ticks, forwards) reach the coordinator."""
    return run_id if shard == 0 else f"{run_id}#{shard}"


@mypyc_attr(serializable=True)  # compiled: pickled by snapshots
@dataclass
class CoreState:
    runs: dict[str, RunState] = field(default_factory=dict)
