"""A month-long simulated run through the policy core (issue 4's acceptance runs).

`run_longrun` drives producers/simulator/longrun.py's run-level events through the same
`engine.step` the live processor runs, applies the commands the core issues (interval,
quarantine), and keeps what a reader needs: the simulator's ground truth, the core's own
accounting, its decisions, and optionally every decision and the launcher's records in
a DuckDB archive (the `interruption`, `timeline` and `goodput` views read them).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..processors.core import engine
from ..processors.core.accounting.baseline import mtbf_s
from ..processors.core.accounting.goodput import Breakdown, breakdown
from ..processors.core.decisions.interval import optimal_s, overhead
from ..processors.core.outputs import Forward, Reject
from ..processors.core.policy import CorePolicy
from ..processors.core.state import CoreState
from ..producers.simulator.longrun import LongRun, Truth, simulate
from ..schemas import Command, Envelope, GoodputReport, IntervalUpdate, Page, Record, StepTiming

#: The longest goodput window a month-long run is reported over (besides the policy's).
MONTH_S = 30 * 86_400.0


@dataclass
class LongRunResult:
    run: LongRun
    truth: Truth
    measured: Breakdown  # the core's accounting over the whole run
    interval_updates: list[IntervalUpdate]
    pages: list[Page]
    #: The last GoodputReport the core published per window (seconds -> report).
    reports: dict[float, GoodputReport] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    mtbf_s: float = 0.0  # the core's final MTBF estimate

    @property
    def measured_overhead(self) -> float:
        m = self.measured
        return (m.checkpoint + m.lost + m.restart) / m.elapsed

    def poisson_range(self) -> tuple[int, int]:
        return poisson_range(self.run.expected_interruptions())

    def formula(self, interval_s: float | None = None) -> tuple[float, float]:
        """(T, overhead) from the seed's formulas at the run's C, R and true MTBF: the optimal
        T (Young/Daly) unless `interval_s` is given."""
        run, policy = self.run, CorePolicy().interval
        m = run.failure_mtbf_s
        t = interval_s if interval_s is not None else optimal_s(run.checkpoint_s, m, policy)[0]
        return t, overhead(t, run.checkpoint_s, m, run.restart_s)


def month_policy(policy: CorePolicy) -> CorePolicy:
    """`policy` with a 30-day goodput window added (a month-long run is reported over it)."""
    windows = tuple(sorted({*policy.goodput.windows_s, MONTH_S}))
    return policy.model_copy(update={"goodput": policy.goodput.model_copy(update={"windows_s": windows})})


def run_longrun(
    run: LongRun,
    policy: CorePolicy,
    archive: str | Path | None = None,
    progress: Callable[[float], None] | None = None,
) -> LongRunResult:
    """Simulate `run` through the core; with `archive`, store the launcher's records (run
    starts, exits, checkpoints) and every output in that DuckDB file (step timings, one a
    step, are left out)."""
    policy = month_policy(policy)
    state = CoreState()
    counts: Counter[str] = Counter()
    updates: list[IntervalUpdate] = []
    pages: list[Page] = []
    reports: dict[float, GoodputReport] = {}
    kept: list[Record] = []
    next_progress = run.start_ts

    def core(event: Envelope) -> list[Command]:
        nonlocal next_progress
        _, outputs = engine.step(state, event, policy)
        if archive is not None and not isinstance(event, StepTiming):
            kept.append(event)
        commands = []
        for out in outputs:
            if isinstance(out, Forward | Reject):
                continue  # an unsharded run has nothing to forward; its ranks are all in range
            counts[out.KIND] += 1
            if isinstance(out, Command):
                commands.append(out)
            elif isinstance(out, IntervalUpdate):
                updates.append(out)
            elif isinstance(out, Page):
                pages.append(out)
            elif isinstance(out, GoodputReport):
                reports[out.window_s] = out
            if archive is not None:
                kept.append(out)
        if progress is not None and event.ts >= next_progress:
            progress((event.ts - run.start_ts) / (run.end_ts - run.start_ts))
            next_progress = event.ts + 3600.0
        return commands

    interval_s = policy.interval.initial_s
    truth = simulate(run, core, interval_s=interval_s)
    coordinator = state.runs[run.run_id]
    measured = breakdown(coordinator.goodput, coordinator.goodput.clock or run.end_ts, MONTH_S)
    if archive is not None:
        from ..sinks.archive_store import Archive

        with Archive(archive) as store:
            for i in range(0, len(kept), 50_000):
                store.write(kept[i : i + 50_000])
    return LongRunResult(
        run=run,
        truth=truth,
        measured=measured,
        interval_updates=updates,
        pages=pages,
        reports=reports,
        counts=counts,
        mtbf_s=mtbf_s(coordinator.baseline, policy.baseline),
    )


def poisson_range(mean: float, z: float = 2.576) -> tuple[int, int]:
    """The counts a Poisson variable of this mean falls within ~99% of the time (normal
    approximation with continuity; wide enough at means of ~15 too)."""
    half = z * math.sqrt(mean)
    return max(0, math.floor(mean - half - 0.5)), math.ceil(mean + half + 0.5)
