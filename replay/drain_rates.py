"""The lead-time and false-drain numbers that failure prediction's scoring (the
development harness's, harness/scoring/prediction.py) and a backtest's prediction policies
(prediction_backtest.py) share."""

from __future__ import annotations

import statistics


class DrainRates:
    """The lead and false-drain numbers a scenario's score and a backtest's share."""

    leads_s: tuple[float, ...]
    node_days: float

    @property
    def false_drains(self) -> int:
        raise NotImplementedError  # each score counts its own

    @property
    def lead_median_s(self) -> float | None:
        return statistics.median(self.leads_s) if self.leads_s else None

    @property
    def lead_p10_s(self) -> float | None:
        return percentile(self.leads_s, 0.10)

    @property
    def false_per_1000_node_days(self) -> float:
        return 1000.0 * self.false_drains / self.node_days if self.node_days > 0 else 0.0


def percentile(values: tuple[float, ...] | list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)
    x = q * (len(ordered) - 1)
    lo = int(x)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo)
