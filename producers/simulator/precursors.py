"""GPU health of a simulated fleet, for failure prediction (issue 46): healthy noise in
every counter and level of GpuHealth v3, and precursor episodes, true (a failure follows)
and false (it never does).

**Healthy noise.** Each counter is a Poisson process per GPU at a per-GPU-day rate, made
uneven and bursty as real fleets are: each GPU's rate is the fleet's times a Gamma
multiplier of mean 1 (shape `dispersion`: small is uneven, a few GPUs with many
correctable errors and most with none), and benign bursts (a Poisson number per GPU-day,
each a geometric number of counts) come on top. A row remap or a page retirement sets its
pending flag, which stays set (no GPU reset is modelled). Temperature and power follow
the load (idle before an attempt's first step and while the job is down, a time constant
of `thermal_tau_s` either way), with each GPU's own offset and load rise, a daily swing of
the machine room, and reading noise; a report now and then shows a hardware slowdown.

**Precursor episodes.** An episode is one GPU (an NVLink storm: also a peer GPU of its
node) on one node, from `start_ts` to `end_ts`, of one kind:

- ``ecc``: correctable ECC errors climbing (x e^(2.5 x) over the episode, x its elapsed
  share), a few uncorrectable ones at the end, XID 92/94;
- ``remap``: rows remapped (pending set), some for uncorrectable errors, then, often, a
  remap that fails (no spare row left), with elevated correctable ECC and XID 63/64;
- ``xid``: critical XIDs (48, 61, 62, 74, 79, 94, 95, 119, 120) at a growing rate;
- ``nvlink``: NVLink CRC errors and replays, a storm that grows, XID 74;
- ``pcie``: PCIe replays that grow, XID 79 towards the end;
- ``thermal``: a temperature that creeps up (a failing fan or cold plate), to the
  thermal slowdown past 87 °C.

Rates scale with the episode's `intensity` (lognormal across episodes: some precursors
are faint). A true episode ends when its failure strikes; a false one ends on its own,
climbing like a true one or fading (strong at first, dying away).

Pure and seeded: `FleetHealth` draws from the numpy Generator it is given; the run
(fleet.py) decides which GPUs report and when.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...schemas.events import PRECURSOR_COUNTERS, PRECURSOR_FLAGS

#: The counters of GpuHealth v3 that the model draws (each cumulative per GPU).
COUNTERS: tuple[str, ...] = PRECURSOR_COUNTERS
FLAGS: tuple[str, ...] = PRECURSOR_FLAGS
PrecursorKind = Literal["ecc", "remap", "xid", "nvlink", "pcie", "thermal"]
KINDS: tuple[str, ...] = ("ecc", "remap", "xid", "nvlink", "pcie", "thermal")
_DAY = 86_400.0
_HOUR = 3_600.0
#: Critical XIDs a failing GPU's driver logs (memory, bus, NVLink, GSP).
_FAILING_XIDS = (48, 61, 62, 74, 79, 94, 95, 119, 120)
#: Benign XIDs of healthy GPUs (an application's fault, a reset channel).
_BENIGN_XIDS = (13, 31, 43, 45)
#: Hardware XIDs a healthy GPU logs now and then (a contained ECC error, a burst of
#: single-bit errors, a row remapped): `HealthNoise.hardware_xid_share` of its XIDs.
_HEALTHY_HARDWARE_XIDS = (63, 92, 94)
THERMAL_SLOWDOWN_C = 87.0
#: A remapped row or a retired page awaits a GPU reset (none is modelled: the flag stays).
_PENDING = (("remapped_rows_correctable", "remap_pending"), ("retired_pages", "retired_pages_pending"))
#: The precursor kinds' default weights (true and false episodes alike).
_KIND_WEIGHTS: dict[PrecursorKind, float] = {
    "ecc": 0.25,
    "remap": 0.15,
    "xid": 0.2,
    "nvlink": 0.15,
    "pcie": 0.1,
    "thermal": 0.15,
}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CounterNoise(_Strict):
    """One counter's healthy noise per GPU."""

    per_gpu_day: float = Field(ge=0, description="The fleet's mean rate per GPU per day.")
    dispersion: float = Field(
        1.0, gt=0, le=1000, description="Gamma shape of each GPU's rate multiplier (small: uneven)."
    )
    bursts_per_gpu_day: float = Field(0.0, ge=0, description="Benign bursts per GPU per day.")
    burst_mean: float = Field(10.0, ge=1, description="A burst's mean count (geometric).")


#: Healthy backgrounds per GPU-day, a world assumption of this model (docs/prediction.md):
#: correctable ECC and link CRC errors common and very uneven across GPUs, uncorrectable
#: ECC, remaps and retirements rare, benign XIDs from applications now and then.
DEFAULT_COUNTERS: dict[str, CounterNoise] = {
    "ecc_corrected": CounterNoise(per_gpu_day=1.0, dispersion=0.3, bursts_per_gpu_day=0.02, burst_mean=20),
    "ecc_uncorrected": CounterNoise(per_gpu_day=0.0005),
    "retired_pages": CounterNoise(per_gpu_day=0.001),
    "remapped_rows_correctable": CounterNoise(per_gpu_day=0.002),
    "remapped_rows_uncorrectable": CounterNoise(per_gpu_day=0.0005),
    "xid_errors": CounterNoise(per_gpu_day=0.05, dispersion=0.5, bursts_per_gpu_day=0.005, burst_mean=3),
    "pcie_replays": CounterNoise(per_gpu_day=2.0, dispersion=0.5, bursts_per_gpu_day=0.02, burst_mean=50),
    "nvlink_crc_errors": CounterNoise(
        per_gpu_day=5.0, dispersion=0.5, bursts_per_gpu_day=0.02, burst_mean=200
    ),
    "nvlink_retries": CounterNoise(per_gpu_day=1.0, dispersion=0.5, bursts_per_gpu_day=0.01, burst_mean=50),
}


class HealthNoise(_Strict):
    """Healthy noise of every GPU (module docstring). `counters` overrides the defaults
    counter by counter; `scale` multiplies every counter's rate and burst rate."""

    counters: dict[str, CounterNoise] = Field(default_factory=dict)
    scale: float = Field(1.0, gt=0, le=1000)
    hw_slowdown_per_gpu_day: float = Field(
        0.2, ge=0, description="Reports per GPU-day showing a hardware slowdown or power brake."
    )
    hardware_xid_share: float = Field(
        0.05, ge=0, le=1, description="Share of a healthy GPU's XIDs with a hardware code (63, 92, 94)."
    )
    idle_c: float = 35.0
    load_rise_c: float = Field(30.0, ge=0, description="Mean rise from idle to full load (°C).")
    offset_c: float = Field(3.0, ge=0, description="SD of each GPU's own temperature offset.")
    rise_spread_c: float = Field(2.0, ge=0, description="SD of each GPU's own load rise.")
    noise_c: float = Field(0.7, ge=0, description="SD of a reading's noise.")
    diurnal_c: float = Field(1.5, ge=0, description="Amplitude of the room's daily swing.")
    thermal_tau_s: float = Field(120.0, gt=0)
    idle_w: float = 90.0
    load_w: float = 600.0
    power_offset_w: float = Field(20.0, ge=0)
    power_noise_w: float = Field(15.0, ge=0)

    @model_validator(mode="after")
    def _known(self) -> HealthNoise:
        unknown = sorted(set(self.counters) - set(COUNTERS))
        if unknown:
            raise ValueError(f"counters: unknown {unknown} (known: {', '.join(COUNTERS)})")
        return self

    def counter(self, name: str) -> CounterNoise:
        return self.counters.get(name, DEFAULT_COUNTERS[name])


class Precursors(_Strict):
    """Which failures are foretold, how long before, and the false alarms of the world."""

    share: float = Field(0.7, ge=0, le=1, description="Share of failures preceded by a precursor.")
    kinds: dict[PrecursorKind, float] = Field(
        default_factory=lambda: dict(_KIND_WEIGHTS),
        description="Relative weights of the precursor kinds (true and false episodes alike).",
    )
    lead_median_s: float = Field(2700.0, gt=0, description="Median lead: precursor onset to the failure.")
    lead_sigma: float = Field(0.9, ge=0, le=5, description="Lognormal sigma of the lead.")
    lead_min_s: float = Field(60.0, gt=0)
    lead_max_s: float = Field(6 * _HOUR, gt=0)
    intensity_sigma: float = Field(0.7, ge=0, le=5, description="Lognormal sigma of an episode's strength.")
    false_per_node_day: float = Field(0.0, ge=0, description="False episodes per node-day.")
    false_duration_median_s: float = Field(3600.0, gt=0)
    false_duration_sigma: float = Field(0.8, ge=0, le=5)
    fade_share: float = Field(0.5, ge=0, le=1, description="Share of false episodes that fade.")

    @model_validator(mode="after")
    def _sane(self) -> Precursors:
        if self.lead_min_s > self.lead_max_s:
            raise ValueError(f"lead_min_s ({self.lead_min_s}) exceeds lead_max_s ({self.lead_max_s})")
        if not self.kinds or sum(self.kinds.values()) <= 0 or min(self.kinds.values()) < 0:
            raise ValueError("kinds: weights must be >= 0 with a positive sum")
        return self

    def draw_lead(self, rng: np.random.Generator) -> float:
        lead = self.lead_median_s * math.exp(self.lead_sigma * float(rng.standard_normal()))
        return min(self.lead_max_s, max(self.lead_min_s, lead))

    def draw_kind(self, rng: np.random.Generator) -> str:
        names: list[str] = list(self.kinds)
        weights = np.array(list(self.kinds.values()), dtype=float)
        return names[int(rng.choice(len(names), p=weights / weights.sum()))]

    def draw_intensity(self, rng: np.random.Generator) -> float:
        return math.exp(self.intensity_sigma * float(rng.standard_normal()))


@dataclass
class Episode:
    """A precursor on one GPU of one node (and a peer GPU for NVLink) over [start, end)."""

    kind: str
    slot: int  # the node's place in the job (nodes[slot])
    gpu: int  # the GPU within the node
    start_ts: float
    end_ts: float
    intensity: float
    fades: bool = False
    failure: int | None = None  # the failure it foretells (fleet.py's id); None: a false episode
    node: str | None = None  # bound when it begins: the node in the slot then
    remap_fails_at: float = 0.9  # remap: the share of the episode when a remap fails (> 1: never)

    def share(self, ts: float) -> float:
        return min(1.0, max(0.0, (ts - self.start_ts) / max(1.0, self.end_ts - self.start_ts)))

    def profile(self, ts: float, growth: float) -> float:
        """The episode's strength at `ts` relative to its start: climbing e^(growth x), or
        fading e^(growth (1 - x)) (strong at first)."""
        x = self.share(ts)
        return math.exp(growth * (1.0 - x)) if self.fades else math.exp(growth * x)


@dataclass
class FleetHealth:
    """Every GPU's counters, flags and thermal constants, by rank (slot x ranks_per_node
    + gpu); a node swapped for a spare gets fresh GPUs (:meth:`replace_node`)."""

    noise: HealthNoise
    world_size: int
    ranks_per_node: int
    rng: np.random.Generator
    counts: dict[str, np.ndarray] = field(init=False)
    flags: dict[str, np.ndarray] = field(init=False)
    episodes: list[Episode] = field(default_factory=list)

    def __post_init__(self) -> None:
        w, rng = self.world_size, self.rng
        self.counts = {c: np.zeros(w, dtype=np.int64) for c in COUNTERS}
        self.flags = {f: np.zeros(w, dtype=bool) for f in FLAGS}
        self.mult = {c: self._multipliers(c, w) for c in COUNTERS}
        self.temp_offset = rng.normal(0.0, self.noise.offset_c, w)
        self.rise = self.noise.load_rise_c + rng.normal(0.0, self.noise.rise_spread_c, w)
        self.power_offset = rng.normal(0.0, self.noise.power_offset_w, w)
        self.xid_base = np.zeros(w, dtype=np.int64)
        self.last_xid = np.zeros(w, dtype=np.int64)
        # per tick: the reading noise, hardware-slowdown reports, precursor heat
        self.temp_noise = np.zeros(w)
        self.power_noise = np.zeros(w)
        self.slowdown = np.zeros(w, dtype=bool)
        self.extra_c: dict[int, float] = {}
        self._columns: Columns | None = None

    def _multipliers(self, counter: str, n: int) -> np.ndarray:
        shape = self.noise.counter(counter).dispersion
        return self.rng.gamma(shape, 1.0 / shape, n)

    # ------------------------------------------------------------------ the pool
    def replace_node(self, slot: int) -> None:
        """A spare took the node's place: fresh GPUs (driver just loaded: volatile counts 0)."""
        lo, hi = slot * self.ranks_per_node, min(self.world_size, (slot + 1) * self.ranks_per_node)
        n, rng = hi - lo, self.rng
        for c in COUNTERS:
            self.counts[c][lo:hi] = 0
            self.mult[c][lo:hi] = self._multipliers(c, n)
        for f in FLAGS:
            self.flags[f][lo:hi] = False
        self.temp_offset[lo:hi] = rng.normal(0.0, self.noise.offset_c, n)
        self.rise[lo:hi] = self.noise.load_rise_c + rng.normal(0.0, self.noise.rise_spread_c, n)
        self.power_offset[lo:hi] = rng.normal(0.0, self.noise.power_offset_w, n)
        self.xid_base[lo:hi] = 0
        self.last_xid[lo:hi] = 0
        self._columns = None

    def new_attempt(self) -> None:
        """The ranks' health readers start again: XIDs are counted from here."""
        self.xid_base = self.counts["xid_errors"].copy()
        self._columns = None

    # ------------------------------------------------------------------ one interval
    def tick(self, t0: float, dt: float, nodes: list[str]) -> None:
        """Draw every GPU's increments over (t0, t0 + dt] and the interval's reading noise;
        apply the episodes active at t0 on the nodes still in their slots (`nodes`)."""
        w, rng, noise = self.world_size, self.rng, self.noise
        days = dt / _DAY
        for c in COUNTERS:
            spec = noise.counter(c)
            rate = spec.per_gpu_day * noise.scale * days
            if rate > 0:
                drawn = rng.poisson(rate * self.mult[c])
                self.counts[c] += drawn
                if c == "xid_errors":
                    self._healthy_xids(np.flatnonzero(drawn))
            bursts = spec.bursts_per_gpu_day * noise.scale * days
            if bursts > 0:
                hit = np.flatnonzero(rng.random(w) < bursts)
                if hit.size:
                    self.counts[c][hit] += rng.geometric(1.0 / spec.burst_mean, hit.size)
                    if c == "xid_errors":
                        self._healthy_xids(hit)
        for counter, flag in _PENDING:
            self.flags[flag] |= self.counts[counter] > 0
        self.temp_noise = rng.normal(0.0, noise.noise_c, w)
        self.power_noise = rng.normal(0.0, noise.power_noise_w, w)
        self.slowdown = rng.random(w) < noise.hw_slowdown_per_gpu_day * days
        self.extra_c = {}
        self._columns = None
        for episode in self.episodes:
            if episode.start_ts <= t0 < episode.end_ts and episode.node == nodes[episode.slot]:
                self._apply(episode, t0, dt)

    def _healthy_xids(self, gpus: np.ndarray) -> None:
        """The newest XID code of healthy GPUs that just logged some: mostly an
        application's, `hardware_xid_share` of them the hardware's."""
        if gpus.size:
            hardware = self.rng.random(gpus.size) < self.noise.hardware_xid_share
            codes = np.where(
                hardware,
                self.rng.choice(_HEALTHY_HARDWARE_XIDS, gpus.size),
                self.rng.choice(_BENIGN_XIDS, gpus.size),
            )
            self.last_xid[gpus] = codes

    def _apply(self, e: Episode, ts: float, dt: float) -> None:
        rank = e.slot * self.ranks_per_node + e.gpu
        if rank >= self.world_size:
            return
        hours, x, k, rng = dt / _HOUR, e.share(ts), e.intensity, self.rng

        def add(counter: str, per_hour: float, at: int = rank) -> int:
            n = int(rng.poisson(max(0.0, per_hour) * k * hours))
            self.counts[counter][at] += n
            return n

        def xid(per_hour: float, codes: tuple[int, ...]) -> None:
            if add("xid_errors", per_hour):
                self.last_xid[rank] = int(rng.choice(codes))

        if e.kind == "ecc":
            add("ecc_corrected", 30.0 * e.profile(ts, 2.5))
            add("ecc_uncorrected", 1.0 if x > 0.8 and not e.fades else 0.0)
            xid(0.3 * x, (92, 94))
        elif e.kind == "remap":
            if add("remapped_rows_correctable", 2.0 * e.profile(ts, 1.0)):
                self.flags["remap_pending"][rank] = True
            add("remapped_rows_uncorrectable", 0.5 if x > 0.5 else 0.0)
            add("ecc_corrected", 10.0)
            if x >= e.remap_fails_at:
                self.flags["remap_failed"][rank] = True
            xid(0.5 * e.profile(ts, 1.0), (63, 64))
        elif e.kind == "xid":
            xid(3.0 * e.profile(ts, 1.0), _FAILING_XIDS)
        elif e.kind == "nvlink":
            peer = rank ^ 1 if (rank ^ 1) < self.world_size else rank
            add("nvlink_crc_errors", 300.0 * e.profile(ts, 2.0))
            add("nvlink_retries", 40.0 * e.profile(ts, 2.0))
            add("nvlink_crc_errors", 150.0 * e.profile(ts, 2.0), peer)
            xid(0.2, (74,))
        elif e.kind == "pcie":
            add("pcie_replays", 100.0 * e.profile(ts, 2.0))
            xid(0.1 * x, (79,))
        elif e.kind == "thermal":
            creep = (1.0 - x) if e.fades else x
            self.extra_c[rank] = self.extra_c.get(rank, 0.0) + 12.0 * k * creep**1.5

    # ------------------------------------------------------------------ a report
    def columns(self, ts: float) -> Columns:
        """What the interval's reports read, as lists (a list's item is ~10x cheaper than
        an array's): each GPU's counters and flags as one dict, and its levels at idle and
        their rise under load at the room's temperature of `ts`. Cached until a change."""
        if self._columns is None:
            noise = self.noise
            xids = self.counts["xid_errors"] - self.xid_base
            columns = [self.counts[c].tolist() for c in COUNTERS]
            columns[COUNTERS.index("xid_errors")] = xids.tolist()
            columns += [self.flags[f].tolist() for f in FLAGS]
            columns.append(np.where(xids > 0, self.last_xid, 0).tolist())
            keys = (*COUNTERS, *FLAGS, "last_xid")
            static = [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
            for fields in static:
                fields["last_xid"] = fields["last_xid"] or None
            extra = np.zeros(self.world_size)
            for rank, heat in self.extra_c.items():
                extra[rank] = heat
            diurnal = noise.diurnal_c * math.sin(2 * math.pi * ts / _DAY)
            idle_c = noise.idle_c + self.temp_offset + self.temp_noise + extra + diurnal
            idle_w = np.maximum(
                0.0, (noise.idle_w + self.power_offset) * (1.0 - 0.004 * extra) + self.power_noise
            )
            rise_w = (noise.load_w - noise.idle_w) * (1.0 - 0.004 * extra)
            self._columns = Columns(
                static,
                idle_c.tolist(),
                self.rise.tolist(),
                idle_w.tolist(),
                rise_w.tolist(),
                self.slowdown.tolist(),
            )
        return self._columns

    def reading(self, rank: int, ts: float, load: float) -> dict[str, Any]:
        """GPU `rank`'s report at `ts` (GpuHealth's fields), the job's load then in [0, 1]."""
        c = self.columns(ts)
        temp, power = c.idle_c[rank] + load * c.rise_c[rank], c.idle_w[rank] + load * c.rise_w[rank]
        return {
            "present": True,
            **c.static[rank],
            "temperature_c": temp,
            "power_w": power,
            "throttle_reasons": throttle_reasons(c.slowdown[rank], temp),
        }


def throttle_reasons(slowdown: bool, temperature_c: float) -> list[str]:
    """The clock-event reasons a report shows."""
    reasons = ["hw_slowdown"] if slowdown else []
    if temperature_c > THERMAL_SLOWDOWN_C:
        reasons += ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    return reasons


@dataclass(frozen=True)
class Columns:
    """One interval's report inputs per GPU (FleetHealth.columns)."""

    static: list[dict[str, Any]]  # counters, flags, last XID
    idle_c: list[float]
    rise_c: list[float]
    idle_w: list[float]
    rise_w: list[float]
    slowdown: list[bool]
