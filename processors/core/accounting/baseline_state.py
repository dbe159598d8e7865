"""The failure-rate baseline's state (data; behaviour in baseline.py; its policy in
baseline_policy.py, re-exported here).

Apart from the behaviour so that state.py, which holds a run's whole state, imports
no behaviour module: no import cycle (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from .baseline_policy import _HOUR, BaselinePolicy

__all__ = ["_HOUR", "BaselinePolicy", "BaselineState"]  # (the policy, for its old importers)


@mypyc_attr(serializable=True)  # compiled (compiled.py): pickled by snapshots
@dataclass
class BaselineState:
    """One run's failure-rate evidence (the engine keeps one per run, across attempts)."""

    start_ts: float | None = None
    end_ts: float = 0.0
    #: World size the prior is taken at (the reference's while the run's is unknown).
    world_size: int | None = None
    interruptions: int = 0
    by_cause: dict[str, int] = field(default_factory=dict)
    #: interruption_ids already counted: a re-delivered interruption counts once.
    counted: set[str] = field(default_factory=set)
    #: Sorted ts of interruptions still inside the trailing window.
    recent: list[float] = field(default_factory=list)
    published_mtbf_s: float | None = None
    #: end_ts at the last check of the estimate by `on_time` (throttles the per-event cost).
    checked_end_ts: float = float("-inf")

    @property
    def exposure_s(self) -> float:
        return 0.0 if self.start_ts is None else self.end_ts - self.start_ts
