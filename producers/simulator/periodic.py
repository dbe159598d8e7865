"""Per-rank periodic reports (heartbeats, GPU health) at fixed, staggered phases.

Real ranks start at slightly different moments, so their heartbeats are spread over
the interval rather than arriving as one burst of 16,384. Each rank gets a fixed
phase in [0, interval) drawn from the scenario's seed; report k of rank r is due at
``base + k * interval + phase[r]``. Walking the ranks in phase order makes each call
cost O(reports due), and computing every due time from ``base`` (no running sum) makes
the times exact and independent of how often the caller asks.
"""

from __future__ import annotations

import random


class PhaseWheel:
    def __init__(self, world_size: int, interval_s: float, rng: random.Random) -> None:
        self.interval_s = interval_s
        pairs = sorted((rng.random() * interval_s, rank) for rank in range(world_size))
        self._offsets = [offset for offset, _ in pairs]
        self._ranks = [rank for _, rank in pairs]
        self._base = 0.0
        self._period = 0
        self._index = 0

    def reset(self, base: float) -> None:
        """Start a new schedule at `base` (a new attempt's processes start their timers)."""
        self._base, self._period, self._index = base, 0, 0

    def next_due(self) -> float:
        return self._base + self._period * self.interval_s + self._offsets[self._index]

    def take(self, limit: float, inclusive: bool) -> list[tuple[float, int]]:
        """(due time, rank) of every report due before `limit` (or at it, if inclusive), in time order."""
        out: list[tuple[float, int]] = []
        offsets, ranks, n = self._offsets, self._ranks, len(self._offsets)
        if n == 0:
            return out
        i, period = self._index, self._period
        start = self._base + period * self.interval_s
        while True:
            due = start + offsets[i]
            if due > limit or (due == limit and not inclusive):
                break
            out.append((due, ranks[i]))
            i += 1
            if i == n:
                i = 0
                period += 1
                start = self._base + period * self.interval_s
        self._index, self._period = i, period
        return out
