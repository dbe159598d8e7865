"""A bounded running quantile: the last `window` values, for nearest-rank quantiles in
O(log n) per value. The SDC checks calibrate their tolerances with it, on the processor
(processors/core/detectors/sdc_state.py) and on the rank (producers/training/supervisor.py)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque


class RunningQuantile:
    """The last `window` values, kept sorted as well, for O(log n) nearest-rank quantiles."""

    def __init__(self) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, value: float, window: int) -> None:
        self._order.append(value)
        insort(self._sorted, value)
        while len(self._order) > window:
            del self._sorted[bisect_left(self._sorted, self._order.popleft())]

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (the same definition as the watchdog's p99)."""
        n = len(self._sorted)
        if n == 0:
            return math.nan
        return self._sorted[min(n - 1, max(0, math.ceil(q * n) - 1))]

    def values(self) -> list[float]:
        return list(self._order)
