"""Helpers for driving the pure simulator in tests: no broker, no clock."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.schemas import Command, Envelope, Reason, ReasonCode, StepTiming

T0 = 1_000.0


def make_cluster(sc: Scenario, **kwargs: Any) -> SimulatedCluster:
    kwargs.setdefault("id_prefix", "t")
    kwargs.setdefault("validate", True)
    return SimulatedCluster(sc, T0, run_id="run-1", **kwargs)


def of(kind: type[Envelope], events: Iterable[Envelope]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def command(kind: type[Any], c: SimulatedCluster, command_id: str = "", **kw: Any) -> Any:
    """A command of `kind` for the cluster's current attempt, issued now."""
    reason = Reason(code=ReasonCode.OPERATOR, text="test")
    return kind(
        command_id=command_id or f"{kind.KIND}-{c.commands_applied}",
        run_id=c.run_id,
        attempt=c.attempt,
        issued_ts=c.now,
        reason=reason,
        **kw,
    )


Controller = Callable[[SimulatedCluster, list[Envelope]], list[Command]]


def run(
    c: SimulatedCluster, until: float = 10_000.0, dt: float = 0.1, controller: Controller | None = None
) -> list[Envelope]:
    """Drive the cluster until it is done (or `until`); after each tick, `controller`
    sees the new events and returns commands, applied at once (their events included)."""
    out: list[Envelope] = []
    t = c.now
    while not c.done and t < T0 + until:
        t += dt
        events = c.advance(t)
        if controller is not None:
            for cmd in controller(c, events):
                events += c.apply(cmd).events
        out += events
    return out


def straggler_streaks(timings: Iterable[StepTiming], sigma: float = 3.0) -> dict[int, int]:
    """rank -> its longest run of consecutive steps with robust z = (compute_s - median) / MAD
    over `sigma` (seed §7), for the ranks that ever exceed it. One attempt's timings."""
    by_step: dict[int, dict[int, float]] = defaultdict(dict)
    for t in timings:
        by_step[t.step][t.rank] = t.compute_s
    best: dict[int, int] = {}
    current: dict[int, int] = {}
    for step in sorted(by_step):
        values = by_step[step]
        med = statistics.median(values.values())
        mad = statistics.median(abs(v - med) for v in values.values())
        over = {rank for rank, v in values.items() if mad > 0 and (v - med) / mad > sigma}
        current = {rank: current.get(rank, 0) + 1 for rank in over}
        for rank, n in current.items():
            best[rank] = max(best.get(rank, 0), n)
    return best


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
