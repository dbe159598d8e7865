"""An archive with a lemon in it (issue 46): past runs on the same nodes, each simulated and
driven in a closed loop by the pure policy core (archive_scenarios.simulate: the simulator
executes the core's commands), archived as the writer stores them, the ranks' telemetry,
the core's derived events and its commands.

Three runs of 4 ranks on node-0000 and node-0001 (2 ranks a node), days apart:

  lemon-a  (20 days ago)  rank 2 (node-0001) crashes at step 20; rank 0 (node-0000) at step 60
  lemon-b  (10 days ago)  rank 3 (node-0001) crashes at step 30; rank 1 (node-0000) at step 70
  lemon-c  (2 days ago)   rank 2 (node-0001) crashes at step 40

So node-0001 failed three times across three runs (a lemon by the default rule), node-0000
twice (not one). Each crash is an interruption, a Quarantine event and a QuarantineNode
command: three records of one failure.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from trainguard.common.lemons import DAY_S
from trainguard.producers.simulator import Scenario
from trainguard.sinks.archive_store import Archive

from .archive_scenarios import SimulatedRun, simulate

LEMON = "node-0001"
TWICE = "node-0000"


@dataclass(frozen=True)
class PastRun:
    run_id: str
    days_ago: float
    crashes: tuple[tuple[int, int], ...]  # (rank, step)


PAST = (
    PastRun("lemon-a", 20.0, ((2, 20), (0, 60))),
    PastRun("lemon-b", 10.0, ((3, 30), (1, 70))),
    PastRun("lemon-c", 2.0, ((2, 40),)),
)


def scenario(past: PastRun) -> Scenario:
    return Scenario.parse(
        dict(
            name=past.run_id,
            run_id=past.run_id,
            world_size=4,
            ranks_per_node=2,
            nodes_per_rack=2,
            step_time_s=0.2,
            steps=90,
            checkpoint_every=10,
            checkpoint_write_s=0.2,
            checkpoint_validate_s=0.1,
            heartbeat_interval_s=0.5,
            restart_delay_s=1.0,
            seed=46,
            faults=[dict(kind="crash", rank=rank, at_step=step) for rank, step in past.crashes],
        )
    )


@functools.cache
def _simulated(now_ts: float) -> tuple[SimulatedRun, ...]:
    return tuple(simulate(scenario(p), now_ts - p.days_ago * DAY_S) for p in PAST)


def past_runs(now_ts: float) -> tuple[SimulatedRun, ...]:
    """The three runs, started `days_ago` before `now_ts` (simulated once per `now_ts`)."""
    return _simulated(float(now_ts))


def write_lemon_archive(path: Path, now_ts: float) -> Path:
    """The runs archived at `path`, one batch per run, as the writer stores them."""
    with Archive(path) as archive:
        for run in past_runs(now_ts):
            archive.write(run.records())
    return path
