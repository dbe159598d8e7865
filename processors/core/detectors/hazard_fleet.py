"""Failure prediction, the fleet's side (issue 46): each node's closed buckets of the
window summed over its GPUs (:class:`NodeCounts`), and from all nodes the fleet's noise
the detector (hazard.py) judges each node against: per signal the per-GPU rate, the share
of buckets the noise makes active, the chance an active bucket is followed by another,
and the volume's rate and dispersion, each measured with the noisiest nodes (_TRIM of
them) left out and smoothed across evaluations. Pure: time is the events' ts.
"""

from __future__ import annotations

import math

from .hazard_levels import drift as level_drift
from .hazard_levels import fleet_means
from .hazard_state import COUNTERS, FLAGS, HazardState, PredictionPolicy
from .hazard_stats import ACTIVE_P, active_level

#: The fleet's noise estimates move this far toward each evaluation's measurement.
_SMOOTHING = 0.2
#: The share of nodes with the largest counts left out of the fleet's rate (the failing ones).
_TRIM = 0.02


class NodeCounts:
    """One node's signals over the window: per closed bucket the node's count, the GPUs
    reporting each signal, the GPU contributing most, the window's coverage; each level's
    rises per GPU."""

    __slots__ = ("buckets", "gpus", "top", "span", "rises")

    def __init__(self) -> None:
        self.buckets: dict[str, dict[float, float]] = {}
        self.gpus: dict[str, int] = {}
        self.top: dict[str, dict[int, float]] = {}
        self.span: dict[str, float] = {}
        self.rises: dict[str, list[tuple[float, float, int]]] = {}

    def count(self, name: str) -> float:
        return sum(self.buckets.get(name, {}).values())

    def top_gpu(self, name: str) -> tuple[int, float]:
        per = self.top.get(name, {})
        rank = max(per, key=lambda r: per[r]) if per else -1
        return rank, per.get(rank, 0.0)


def window_counts(state: HazardState, ts: float, policy: PredictionPolicy) -> dict[str, NodeCounts]:
    """Every node still reporting, its closed buckets of the window summed over its GPUs."""
    every = policy.check_every_s
    oldest = state.checked_ts - policy.window_s  # the window's closed buckets: [oldest, checked_ts)
    out: dict[str, NodeCounts] = {}
    means = {name: fleet_means(buckets) for name, buckets in state.fleet_levels.items()}
    power = state.fleet_levels.get("power_w", {})
    for rank, track in state.gpus.items():
        if track.last_ts < ts - policy.window_s:
            continue  # gone quiet: left the run
        counts = out.get(track.node)
        if counts is None:
            counts = out[track.node] = NodeCounts()
        span = max(
            0.0, min(policy.window_s, state.checked_ts - math.floor(track.first_ts / every) * every - every)
        )
        for name in track.last:
            counts.gpus[name] = counts.gpus.get(name, 0) + 1
            counts.span[name] = max(counts.span.get(name, 0.0), span)
        for name, buckets in track.buckets.items():
            while buckets and buckets[0][0] < oldest:
                buckets.popleft()  # a GPU that stopped counting: its old buckets age out here
            per = counts.buckets.setdefault(name, {})
            for bucket, value in buckets:
                if bucket < state.checked_ts:  # closed
                    per[bucket] = per.get(bucket, 0.0) + value
                    top = counts.top.setdefault(name, {})
                    top[rank] = top.get(rank, 0.0) + value
        for name in track.levels:
            frozen = (track.node, name) in state.episodes
            drift = level_drift(track, name, means.get(name, {}), power, frozen, state.checked_ts, policy)
            if drift is not None:
                counts.rises.setdefault(name, []).append((*drift, rank))
    return out


def fleet_noise(
    state: HazardState, nodes: dict[str, NodeCounts], policy: PredictionPolicy
) -> dict[str, tuple[float, float]]:
    """Each counter's and flag's per-GPU rate (per second) and the share of a node's
    buckets its noise makes active, measured over the fleet (the nodes with the most
    activity, _TRIM of them, left out) and smoothed; before min_fleet_nodes report it, the
    policy's background and the active level's own share (ACTIVE_P), which are also
    the floors."""
    every = policy.check_every_s
    noise: dict[str, tuple[float, float]] = {}
    for name in (*COUNTERS, *FLAGS):
        floor = policy.background_per_s(name)
        reporting = [c for c in nodes.values() if name in c.gpus and c.span[name] >= every]
        previous = state.noise.get(name)
        if len(reporting) >= policy.min_fleet_nodes:
            reporting.sort(key=lambda c: c.count(name) / (c.gpus[name] * c.span[name]))
            calm = reporting[: len(reporting) - math.ceil(len(reporting) * _TRIM)] or reporting[:1]
            exposure = sum(c.gpus[name] * c.span[name] for c in calm)
            rate = max(floor, sum(c.count(name) for c in calm) / exposure)
            shares = []
            for c in reporting:
                level = active_level(rate * c.gpus[name] * every)
                closed = c.span[name] / every
                shares.append(sum(1 for v in c.buckets.get(name, {}).values() if v >= level) / closed)
            shares.sort()
            kept = shares[: max(1, len(shares) - math.ceil(len(shares) * _TRIM))]
            share = sum(kept) / len(kept)
            if previous is not None:
                rate = previous[0] + _SMOOTHING * (rate - previous[0])
                share = previous[1] + _SMOOTHING * (share - previous[1])
            state.noise[name] = (rate, share)
            _volume(state, name, reporting, rate, policy)
            _follow(state, name, reporting, rate, policy)
        elif previous is None:
            noise[name] = (floor, ACTIVE_P)
            continue
        rate, share = state.noise[name]
        noise[name] = (max(rate, floor), max(share, ACTIVE_P))
    return noise


def _follow(
    state: HazardState, name: str, reporting: list[NodeCounts], rate: float, policy: PredictionPolicy
) -> None:
    """The fleet's chance that an active bucket is followed by another active one (the
    nodes with the most active buckets, _TRIM of them, left out), smoothed; unmeasured
    while the fleet has no active bucket with a closed successor."""
    every = policy.check_every_s
    last_closed = state.checked_ts - every
    per_node = []
    for c in reporting:
        level = active_level(rate * c.gpus[name] * every)
        active = {b for b, v in c.buckets.get(name, {}).items() if v >= level}
        followed = [b in active for b in (a + every for a in active) if b <= last_closed]
        per_node.append((len(active), len(followed), sum(followed)))
    per_node.sort()
    calm = per_node[: max(1, len(per_node) - math.ceil(len(per_node) * _TRIM))]
    base, pairs = sum(n for _, n, _ in calm), sum(k for _, _, k in calm)
    if base == 0:
        return
    follow, previous = pairs / base, state.follow.get(name)
    state.follow[name] = follow if previous is None else previous + _SMOOTHING * (follow - previous)


def capped(c: NodeCounts, name: str, cap: float) -> float:
    """A node's window count of the signal with each bucket capped at `cap` (the count that
    makes a bucket active): a burst adds at most one bucket's worth, a climb every bucket's."""
    return sum(min(v, cap) for v in c.buckets.get(name, {}).values())


def _volume(
    state: HazardState, name: str, reporting: list[NodeCounts], rate: float, policy: PredictionPolicy
) -> None:
    """The fleet's per-GPU rate and dispersion of the nodes' capped window counts (the
    nodes with the most, _TRIM of them, left out), smoothed."""
    every = policy.check_every_s
    samples = sorted(
        (capped(c, name, active_level(rate * c.gpus[name] * every)), c.gpus[name] * c.span[name])
        for c in reporting
    )
    calm = samples[: max(1, len(samples) - math.ceil(len(samples) * _TRIM))]
    exposure = sum(e for _, e in calm)
    if exposure <= 0:
        return
    mean = sum(c for c, _ in calm) / exposure
    pearson = [(c - mean * e) ** 2 / (mean * e) for c, e in calm if mean * e > 0]
    dispersion = max(1.0, sum(pearson) / len(pearson)) if pearson else 1.0
    previous = state.volume.get(name)
    if previous is not None:
        mean = previous[0] + _SMOOTHING * (mean - previous[0])
        dispersion = previous[1] + _SMOOTHING * (dispersion - previous[1])
    state.volume[name] = (mean, dispersion)
