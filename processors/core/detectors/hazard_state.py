"""Failure prediction's settings and state (data; behaviour in hazard.py and drain.py).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ....schemas.events import PRECURSOR_COUNTERS, PRECURSOR_FLAGS

#: The precursor counters a GpuHealth report carries, each a count that only grows while
#: the driver is loaded (a reset, a smaller value, starts it again): failures foretold by
#: memory (ECC, retired pages, remapped rows), the driver (XID) and the links (PCIe,
#: NVLink). Two are derived from the report: `hw_slowdown` counts the reports whose
#: clock-event reasons include a hardware slowdown or power brake (a failing power supply
#: or sensor), `xid_hardware` the XIDs the application did not cause (:func:`hardware_xid`).
COUNTERS: tuple[str, ...] = (*PRECURSOR_COUNTERS, "hw_slowdown", "xid_hardware")
#: XIDs an application causes (NVIDIA's Xid catalog: immediate action RESTART_APP): a
#: graphics engine exception (13), a memory page fault (31), a channel stopped or cleaned
#: up after the application's error (43, 45), an idle timeout (8), a video engine's
#: exception (68, 69). Every other code is the GPU's, its memory's, its links' or its
#: firmware's: a storm of them foretells a failure where an application's do not.
APPLICATION_XIDS: frozenset[int] = frozenset({8, 13, 31, 43, 45, 68, 69})


def hardware_xid(code: object) -> bool:
    """Whether an XID code (GpuHealth's `last_xid`) is the hardware's, not the
    application's; an unknown code (None) is neither."""
    return isinstance(code, int) and code > 0 and code not in APPLICATION_XIDS


#: Flags that count once when they turn true (a remap or retirement that awaits a reset,
#: a remap that failed: the memory has no spare rows left).
FLAGS: tuple[str, ...] = PRECURSOR_FLAGS
#: Levels whose rise over the window is compared with the fleet's rises (a failing fan,
#: a degrading power stage).
LEVELS: tuple[str, ...] = ("temperature_c", "power_w")
SIGNALS: tuple[str, ...] = (*COUNTERS, *FLAGS, *LEVELS)

#: Healthy background of each counter and flag per GPU per day, before the run has measured
#: its fleet's own (and its floor after: a count is never compared with a rate of 0).
_BACKGROUND = {
    "ecc_corrected": 20.0,
    "ecc_uncorrected": 0.01,
    "retired_pages": 0.01,
    "remapped_rows_correctable": 0.02,
    "remapped_rows_uncorrectable": 0.01,
    "xid_errors": 0.05,
    "xid_hardware": 0.01,
    "pcie_replays": 5.0,
    "nvlink_crc_errors": 20.0,
    "nvlink_retries": 5.0,
    "hw_slowdown": 0.5,
    "remap_pending": 0.01,
    "remap_failed": 0.002,
    "retired_pages_pending": 0.01,
}
#: The share of a signal's episodes a failure follows within the horizon, as a Beta prior
#: (hits, misses): what the probability starts from before the run's own outcomes. Memory
#: that ran out of spare rows, uncorrectable errors and XIDs foretell most; link retries and
#: a warm GPU the least.
_PRECISION = {
    "ecc_corrected": (3.0, 7.0),
    "ecc_uncorrected": (6.0, 4.0),
    "retired_pages": (5.0, 5.0),
    "remapped_rows_correctable": (3.0, 7.0),
    "remapped_rows_uncorrectable": (6.0, 4.0),
    "xid_errors": (4.0, 6.0),
    "xid_hardware": (5.0, 5.0),
    "pcie_replays": (2.0, 8.0),
    "nvlink_crc_errors": (2.0, 8.0),
    "nvlink_retries": (2.0, 8.0),
    "hw_slowdown": (2.0, 8.0),
    "remap_pending": (4.0, 6.0),
    "remap_failed": (7.0, 3.0),
    "retired_pages_pending": (4.0, 6.0),
    "temperature_c": (2.0, 8.0),
    "power_w": (1.0, 9.0),
}
#: The smallest spread of a level's rises over a window across the fleet (°C, W): the
#: fleet's measured spread (1.4826 MAD) is the scale, and this only keeps a degenerate
#: measurement (a few GPUs reading the same integers) from being taken for zero: half
#: NVML's 1 °C resolution, and 25 W (power readings swing by tens of watts with the load).
_LEVEL_SPREAD = {"temperature_c": 0.5, "power_w": 25.0}


DAY_S = 86_400.0


class PredictionPolicy(BaseModel):
    """Failure prediction (issue 46, seed §9.6): each node's precursors against its fleet's
    measured noise, calibrated into P(failure within the horizon), and a drain at a
    checkpoint boundary when it pays in expected goodput. Thresholds derive from the false
    alarm rate asked for, not from a scenario."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="False: predict nothing, drain nothing (the baseline).")
    horizon_s: float = Field(
        3600.0, gt=0, description="P(failure within this long) is what a prediction states."
    )
    window_s: float = Field(
        3600.0, gt=0, description="A node's counts are compared with the fleet's over this window."
    )
    check_every_s: float = Field(
        120.0, gt=0, description="Event time between two evaluations, and the buckets the window is cut into."
    )
    persist_checks: int = Field(
        2,
        ge=1,
        description="A signal must stand out on this many evaluations in a row: noise bursts once, "
        "a failing part keeps going.",
    )
    false_alarms_per_node_day: float = Field(
        1e-4,
        gt=0,
        lt=1,
        description="The false predictions per node-day the thresholds are derived for (shared over "
        "the signals and the evaluations of a day, Bonferroni).",
    )
    own_history_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="How far back a node's own usual rate of each signal reaches: a node is judged "
        "against the fleet's noise and its own past (a GPU with a chronically higher but steady "
        "count is not failing); it is judged once it has five buckets of its own history.",
    )
    min_fleet_nodes: int = Field(
        8,
        ge=2,
        description="The fleet's noise is measured once this many nodes report a signal; before, "
        "the background priors stand for it.",
    )
    background_per_gpu_day: dict[str, float] = Field(
        default_factory=lambda: dict(_BACKGROUND),
        description="Each counter's healthy background per GPU per day: the prior, and the floor.",
    )
    precision_prior: dict[str, tuple[float, float]] = Field(
        default_factory=lambda: dict(_PRECISION),
        description="Each signal's (hits, misses) Beta prior: the share of its episodes a failure "
        "follows within the horizon, until the run's own outcomes weigh in.",
    )
    decisive: tuple[str, ...] = Field(
        ("remap_failed",),
        description="Flags that stand out on their own, one occurrence being the part's verdict "
        "rather than a rate to test: a row remap that failed has no spare row left (NVIDIA's "
        "guidance: reset, then replace the GPU; DCGM's health check fails it). Their precision "
        "prior still calibrates P.",
    )
    level_spread: dict[str, float] = Field(
        default_factory=lambda: dict(_LEVEL_SPREAD),
        description="The smallest fleet spread of a level's rise over the window (°C, W).",
    )

    def background_per_s(self, signal: str) -> float:
        """The signal's healthy background per GPU per second: the prior, and the floor."""
        return self.background_per_gpu_day.get(signal, 0.0) / DAY_S

    @field_validator("decisive")
    @classmethod
    def _flags_only(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(value) - set(FLAGS))
        if unknown:
            raise ValueError(f"decisive: {unknown} are not flags (the flags: {', '.join(FLAGS)})")
        return value

    drain_swap_prior_s: float = Field(
        60.0,
        ge=0,
        description="A drain's cost besides its checkpoint: the ranks leave at the boundary and a "
        "pre-tested spare takes the node's place, until the run has measured its own.",
    )
    drain_within_s: float = Field(
        300.0,
        ge=0,
        description="A drain waits at most this long for the checkpoint the cadence makes due "
        "(less when the failure it risks by waiting costs more than the checkpoint it saves: "
        "drain.py); then it checkpoints at once.",
    )


@dataclass
class GpuTrack:
    """One GPU (rank) as its health reports go. Kept small (16,384 of them): the counters'
    and flags' last values (a name present: the GPU reports it), the window's buckets of
    non-zero increments only, and each level's per-bucket sums."""

    node: str
    first_ts: float
    last_ts: float = 0.0
    last: dict[str, float] = field(default_factory=dict)
    #: Signal -> [(bucket start, increment)], oldest first, non-zero increments in the window.
    buckets: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    #: Level -> [[bucket start, sum, samples]], oldest first, over the window.
    levels: dict[str, deque[list[float]]] = field(default_factory=dict)
    #: Level -> [residual x seconds, seconds]: the GPU's own usual residual against the
    #: fleet (decaying past own_history_s).
    usual: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class OwnRate:
    """A node's own usual rate of a signal. `count` / `seconds`: its history before the
    window, decaying past own_history_s (the buckets a window is judged on never judge
    themselves: a sparse precursor's few counts do not become the usual they are tested
    against). `recent`: the window's evaluations' contributions, oldest first, awaiting
    their turn (-1: frozen, the signal stood out). A node without history before the
    window yet (one that just joined) is judged against everything it has so far."""

    count: float = 0.0
    seconds: float = 0.0
    recent: deque[float] = field(default_factory=deque)

    def past(self) -> tuple[float, float]:
        """(count, seconds) of the history before the window."""
        return self.count, self.seconds

    def everything(self, every: float) -> tuple[float, float]:
        """(count, seconds) including the window's evaluations so far."""
        kept = [c for c in self.recent if c >= 0]
        return self.count + sum(kept), self.seconds + every * len(kept)


@dataclass
class Episode:
    """A signal standing out on a node: since when, how many evaluations in a row, and its
    outcome once known (a failure within the horizon, or the horizon passed)."""

    signal: str
    node: str
    first_ts: float
    streak: int = 1
    evidence: float = 0.0
    predicted: bool = False  # a FailurePredicted named it
    drained: bool = False  # the node was drained: its outcome is never known


@dataclass
class HazardState:
    """Failure prediction's view of one run (one shard's GPUs)."""

    gpus: dict[int, GpuTrack] = field(default_factory=dict)
    checked_ts: float = 0.0
    #: (node, signal) -> the episode open now.
    episodes: dict[tuple[str, str], Episode] = field(default_factory=dict)
    #: Episodes that ended (the signal went quiet) still awaiting their outcome.
    closed: list[Episode] = field(default_factory=list)
    #: Signal -> [hits, misses] of the run's own episodes (a failure on the node within the horizon).
    outcomes: dict[str, list[int]] = field(default_factory=dict)
    #: Node -> the probability of its last prediction (predicted again only on a rise).
    predicted: dict[str, float] = field(default_factory=dict)
    #: The fleet's measured noise: signal -> (per-GPU rate per second, share of a node's
    #: buckets active), smoothed over evaluations.
    noise: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: The fleet's volume noise: signal -> (per-GPU rate per second and dispersion of the
    #: nodes' window counts, each node's two largest buckets left out: bursts removed).
    volume: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: The fleet's measured chance that a node's active bucket is followed by another
    #: (bursts that straddle buckets, noise that clusters), smoothed: a streak's bar.
    follow: dict[str, float] = field(default_factory=dict)
    #: (node, signal) -> the node's own usual rate (before the window, decaying past
    #: own_history_s), frozen while the signal stands out on it.
    own: dict[tuple[str, str], OwnRate] = field(default_factory=dict)
    #: Level -> bucket -> [sum, reports] over the fleet: what every GPU's level is measured
    #: against (a node going from idle to load warms with the load, not with a fault).
    fleet_levels: dict[str, dict[float, list[float]]] = field(default_factory=dict)


@dataclass
class DrainState:
    """The drain decisions of a run (shard 0): nodes drained, those declined, the costs."""

    #: Node -> (decision id, attempt) of the drain issued for it.
    drained: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Node -> ts of its last declined decision (decided again on a stronger prediction).
    declined: dict[str, float] = field(default_factory=dict)
    #: Measured drains: seconds from the stop at the boundary to the next attempt's first step.
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    #: The planned interruptions the drains made (their recovery is a cost sample).
    interruptions: set[str] = field(default_factory=set)
