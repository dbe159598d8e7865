"""Failure prediction's levels (hazard.py): a GPU's temperature and power against the
fleet's at the same time and its own usual, and the fleet's spread of those drifts. Apart
so that hazard.py stays a module of its counters' rules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .hazard_state import LEVELS, GpuTrack, PredictionPolicy
from .hazard_stats import decayed_add, robust


def drift(
    track: GpuTrack,
    name: str,
    fleet: Mapping[float, float],
    power: Mapping[float, list[float]],
    frozen: bool,
    checked_ts: float,
    policy: PredictionPolicy,
) -> tuple[float, float] | None:
    """A level against the fleet's at the same time (its residual, bucket by bucket): how
    much the residual rose over the window (the last quarter's mean less the first's) and
    how far it is now (the last quarter's mean) above the GPU's own usual residual (its
    history, decaying over own_history_s, frozen while the level stands out on the node),
    once the GPU has a window of history and the buckets cover half the window. A GPU that
    warms with the fleet's load, or from idle up to the fleet's level, has not drifted; nor
    has one that always runs warmer; one that keeps warming past its own usual has. The
    usual is the GPU's at the fleet's load (loaded): a spare idling for hours, then
    joining, is not judged against its idle self. `fleet`: the fleet's mean level by bucket
    (:func:`fleet_means`, once per evaluation for every GPU)."""
    sums = track.levels[name]
    if len(sums) < 4 or sums[-1][0] - sums[0][0] < policy.window_s / 2:
        return None
    residuals = []
    closed: float | None = None  # the latest closed bucket
    closed_residual = 0.0  # its residual
    for bucket, total, n in sums:
        across = fleet.get(bucket)
        if across is not None:
            residual = total / n - across
            residuals.append(residual)
            if bucket < checked_ts:
                closed, closed_residual = bucket, residual
    if len(residuals) < 4:
        return None
    usual = track.usual.setdefault(name, [0.0, 0.0])
    known, mean = usual[1] >= policy.window_s, usual[0] / usual[1] if usual[1] > 0 else 0.0
    if closed is not None and not frozen and loaded(track, closed, power):
        every = policy.check_every_s
        added = closed_residual * every
        usual[0], usual[1] = decayed_add(usual[0], usual[1], added, every, policy.own_history_s)
    if not known:
        return None
    quarter = max(1, len(residuals) // 4)
    head, tail = residuals[:quarter], residuals[-quarter:]
    now = sum(tail) / quarter
    return now - sum(head) / quarter, now - mean


def fleet_means(fleet: Mapping[float, list[float]]) -> dict[float, float]:
    """The fleet's mean level by bucket (its [sum, count] by bucket), buckets with a report."""
    return {bucket: total / n for bucket, (total, n) in fleet.items() if n > 0}


def loaded(track: GpuTrack, bucket: float, fleet_power: Mapping[float, list[float]]) -> bool:
    """Whether the GPU ran at the fleet's load in `bucket`: it drew at least half the
    fleet's mean power (an idle GPU draws a sixth of a loaded one's); unknown: yes."""
    across = fleet_power.get(bucket)
    mine = next((s for s in reversed(track.levels.get("power_w", ())) if s[0] == bucket), None)
    if across is None or across[1] <= 0 or mine is None or mine[2] <= 0:
        return True
    return mine[1] / mine[2] >= 0.5 * across[0] / across[1]


def level_spread(
    rises: Iterable[Mapping[str, list[tuple[float, float, int]]]], policy: PredictionPolicy
) -> dict[str, tuple[float, float, float, float]]:
    """Each level's fleet drifts (`rises`: each node's level -> (rise, now, rank) per GPU):
    the median and robust spread (1.4826 MAD, floored) of the GPUs' rises against the
    fleet, then of how far they are now above their own usual."""
    out: dict[str, tuple[float, float, float, float]] = {}
    for name in LEVELS:
        drifts = [(r, n) for node in rises for r, n, _ in node.get(name, [])]
        floor = policy.level_spread.get(name, 1.0)
        if len(drifts) < policy.min_fleet_nodes:
            out[name] = (0.0, floor, 0.0, floor)
            continue
        out[name] = (*robust([r for r, _ in drifts], floor), *robust([n for _, n in drifts], floor))
    return out
