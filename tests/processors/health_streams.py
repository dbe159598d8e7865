"""A fleet's GPU health over hours, for failure prediction's tests (processors/core/detectors/hazard.py).

Every GPU of every node reports its counters every `interval_s`, as the rank's sampler
does: Poisson backgrounds at realistic per-GPU-day rates in every counter, overdispersed
by benign bursts (one report's worth of tens of errors, then nothing), a temperature and a
power with per-GPU offsets and noise. A failing node's correctable ECC count climbs from
an onset (a degrading HBM stack: its rate grows by half every ten minutes)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: 2026-01-01T00:00:00Z, a whole number of every bucket length the tests use.
T0 = 1_767_225_600.0
#: Healthy backgrounds per GPU per day (memory, links, driver).
RATES = {"ecc_corrected": 20.0, "pcie_replays": 5.0, "nvlink_crc_errors": 20.0, "xid_errors": 0.05}


@dataclass
class Fleet:
    nodes: int = 32
    gpus_per_node: int = 8
    interval_s: float = 120.0
    seed: int = 0
    #: Chance per GPU, report and counter of a benign burst (mean size 30).
    burst_prob: float = 0.002
    #: Reports a benign burst lasts (each as large): 1, one report's worth; more, noise that
    #: clusters over minutes (an application hammering a weak page, then stopping).
    burst_reports: int = 1
    #: node index -> (onset seconds after T0, the climb's first count per report).
    failing: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: node index -> seconds after T0 of one huge benign burst on its GPU 0.
    one_burst: dict[int, float] = field(default_factory=dict)
    #: node index -> its GPU 0's background multiplier, from the start (a chronically
    #: noisier GPU that never fails).
    chronic: dict[int, float] = field(default_factory=dict)
    #: node index -> seconds after T0 it goes from idle (cool, low power) to the job's load
    #: (a spare joining a restarted job).
    joins: dict[int, float] = field(default_factory=dict)
    #: node index -> seconds after T0 its GPU 0 starts warming, 0.3 °C a minute (a failing fan).
    creeping: dict[int, float] = field(default_factory=dict)
    #: node index -> (onset seconds after T0, XIDs per hour) its GPU 0's driver logs from
    #: then: a few an hour, most buckets empty (a failing GPU's critical XIDs).
    xids: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: node index -> (seconds after T0, count): one pair of buckets of XIDs on its GPU 0, then
    #: nothing (an application's faults).
    xid_burst: dict[int, tuple[float, int]] = field(default_factory=dict)
    #: node index -> the code of its `xids` and `xid_burst` (default 79, the GPU fallen off
    #: the bus); a healthy GPU's XIDs are an application's (13).
    xid_code: dict[int, int] = field(default_factory=dict)
    #: node index -> seconds after T0 a row remap on its GPU 0 fails (no spare row left).
    remap_fails: dict[int, float] = field(default_factory=dict)

    def node(self, index: int) -> str:
        return f"node-{index:04d}"

    def reports(self, hours: float) -> Iterator[tuple[int, str, float, dict[str, Any]]]:
        """(rank, node, ts, GpuHealth fields) in time order."""
        rng = random.Random(self.seed)
        gpus = self.nodes * self.gpus_per_node
        counts = [dict.fromkeys(RATES, 0) for _ in range(gpus)]
        last_xid: list[int | None] = [None] * gpus
        lasting: dict[tuple[int, str], tuple[int, int]] = {}  # a burst's size and reports left
        temperature = [62.0 + rng.gauss(0, 3) for _ in range(gpus)]
        for k in range(int(hours * 3600 / self.interval_s)):
            ts = T0 + k * self.interval_s
            for rank in range(gpus):
                index = rank // self.gpus_per_node
                mine = counts[rank]
                xids_before = mine["xid_errors"]
                scale = self.chronic.get(index, 1.0) if rank % self.gpus_per_node == 0 else 1.0
                for name, per_day in RATES.items():
                    mine[name] += _poisson(rng, scale * per_day / 86_400 * self.interval_s)
                    if name != "xid_errors" and (rank, name) in lasting:
                        size, left = lasting.pop((rank, name))
                        mine[name] += size
                        if left > 1:
                            lasting[(rank, name)] = (size, left - 1)
                    elif name != "xid_errors" and rng.random() < self.burst_prob:
                        size = int(rng.expovariate(1 / 30))
                        mine[name] += size
                        if self.burst_reports > 1:
                            lasting[(rank, name)] = (size, self.burst_reports - 1)
                onset = self.failing.get(index)
                if onset is not None and ts >= T0 + onset[0]:
                    mine["ecc_corrected"] += int(onset[1] * 1.5 ** min(20.0, (ts - T0 - onset[0]) / 600))
                if mine["xid_errors"] > xids_before:
                    last_xid[rank] = 13
                xids_before = mine["xid_errors"]
                xids = self.xids.get(index)
                if xids is not None and rank % self.gpus_per_node == 0 and ts >= T0 + xids[0]:
                    mine["xid_errors"] += _poisson(rng, xids[1] * self.interval_s / 3600)
                xid_burst = self.xid_burst.get(index)
                if (
                    xid_burst is not None
                    and rank % self.gpus_per_node == 0
                    and T0 + xid_burst[0] <= ts < T0 + xid_burst[0] + 2 * self.interval_s
                ):
                    mine["xid_errors"] += xid_burst[1]
                if mine["xid_errors"] > xids_before:  # the failing GPU's, or the burst's
                    last_xid[rank] = self.xid_code.get(index, 79)
                burst = self.one_burst.get(index)
                if (
                    burst is not None
                    and rank % self.gpus_per_node == 0
                    and T0 + burst <= ts < T0 + burst + self.interval_s
                ):
                    mine["ecc_corrected"] += 5000
                warm, power = temperature[rank] + rng.gauss(0, 1.5), 500.0 + rng.gauss(0, 30)
                joined = self.joins.get(index)
                if joined is not None and ts < T0 + joined:
                    warm, power = warm - 25.0, power - 380.0  # idle
                creep = self.creeping.get(index)
                if creep is not None and rank % self.gpus_per_node == 0 and ts > T0 + creep:
                    warm += 0.3 * (ts - T0 - creep) / 60
                failed_at = self.remap_fails.get(index)
                fields = {
                    "present": True,
                    **mine,
                    "remap_failed": failed_at is not None
                    and rank % self.gpus_per_node == 0
                    and ts >= T0 + failed_at,
                    "last_xid": last_xid[rank],
                    "temperature_c": warm,
                    "power_w": power,
                }
                yield rank, self.node(index), ts + rng.random(), fields


def _poisson(rng: random.Random, mean: float) -> int:
    limit, product, count = math.exp(-mean), rng.random(), 0
    while product > limit:
        product *= rng.random()
        count += 1
    return count
