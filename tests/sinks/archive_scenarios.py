"""A realistic archive for the query tests: two simulated runs, each driven in a closed loop by
the pure policy core (the simulator executes the core's commands, no broker), archived as
the writer would store them: the ranks' telemetry, the core's derived events and its commands.

The runs share a cluster (node names), so one node can kill two jobs. Ground truth comes from
the scenarios (the faults planned) and the simulator (the faults as they fired); tests derive
their expectations from it and from the raw telemetry, never from the views they check.

run-a (16 ranks, 4 nodes), from one minute before midnight UTC into the next day:
  crash    rank 13 (node-0003) during step 77, while checkpoint 75 is still being written
  hang     rank 6 (node-0001) during step 200 (detected by the step timeout)
  slow     rank 9 (node-0002) 30% slow from step 205, thermal: flagged, diagnosed, evicted
  bitflip  rank 2 (node-0000) at its first self-check at or after step 300: SDC, rollback
run-b (16 ranks), an hour after midnight:
  crash    rank 12 (node-0003) during step 60, after an uncorrectable ECC error on its GPU
  slow     rank 5 (node-0001) NVLink at half width for 12 steps (too short to be flagged: under
           the 30-step streak, and under half of the windowed detector's 32-step block)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainguard.processors.core import CorePolicy, CoreState, step
from trainguard.processors.core.accounting.goodput import GoodputPolicy
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy
from trainguard.processors.core.outputs import Forward
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.producers.simulator.cluster import CommandRefused, FiredFault
from trainguard.schemas import Command, Derived, Envelope, GpuHealth, Record
from trainguard.sinks.archive_store import Archive

#: 2023-11-15 00:00:00 UTC.
MIDNIGHT = 1_700_006_400.0
DAY = 86_400.0

#: The core's defaults except: reports every 20 s of event time (the runs last minutes, not
#: hours) and a straggler flagged after 30 slow steps instead of 100.
POLICY = CorePolicy(
    goodput=GoodputPolicy(report_every_s=20.0),
    straggler=StragglerPolicy(consecutive_steps=30),
)

_CLUSTER = dict(
    world_size=16, ranks_per_node=4, nodes_per_rack=2, step_time_s=0.2, checkpoint_every=25,
    checkpoint_blocking_s=0.02, checkpoint_write_s=1.0, checkpoint_validate_s=0.2,
    heartbeat_interval_s=0.5, gpu_health_interval_s=2.0, restart_delay_s=2.0,
)  # fmt: skip

RUN_A = Scenario.parse(
    dict(
        name="archive-a",
        run_id="run-a",
        steps=400,
        sdc_check_every=10,
        seed=11,
        **_CLUSTER,
        faults=[
            dict(kind="crash", rank=13, at_step=77),
            dict(kind="hang", rank=6, at_step=200),
            dict(kind="slow", rank=9, from_step=205, to_step=290, factor=1.3, cause="thermal"),
            dict(kind="bitflip", rank=2, at_step=300),
        ],
    )  # fmt: skip
)
RUN_B = Scenario.parse(
    dict(
        name="archive-b",
        run_id="run-b",
        steps=150,
        seed=12,
        **_CLUSTER,
        faults=[
            dict(kind="crash", rank=12, at_step=60),
            dict(kind="slow", rank=5, from_step=100, to_step=112, factor=1.1, cause="link"),
        ],
    )  # fmt: skip
)
START = {"run-a": MIDNIGHT - 60.0, "run-b": MIDNIGHT + 3600.0}

#: run-b's rank 12 reports an uncorrectable ECC error from this step on (its crash follows).
ECC_RANK, ECC_FROM_STEP, ECC_CORRECTED, ECC_UNCORRECTED = 12, 50, 37, 1


@dataclass(frozen=True)
class SimulatedRun:
    scenario: Scenario
    start_ts: float
    telemetry: list[Envelope]  # what the ranks and the launcher sent
    derived: list[Derived]  # the core's events
    commands: list[Command]  # the core's commands (executed by the simulator, or refused)
    fired: list[FiredFault]  # the faults as they struck: attempt, step, time

    @property
    def run_id(self) -> str:
        assert self.scenario.run_id is not None
        return self.scenario.run_id

    def records(self) -> list[Record]:
        """Everything the archive receives for this run, in the order it was produced."""
        return sorted([*self.telemetry, *self.derived, *self.commands], key=_time)


def _time(record: Record) -> float:
    return record.issued_ts if isinstance(record, Command) else float(getattr(record, "ts", 0.0))


def simulate(
    scenario: Scenario,
    start_ts: float,
    policy: CorePolicy = POLICY,
    tweak: Callable[[Envelope], Envelope] | None = None,
    dt_s: float = 0.05,
) -> SimulatedRun:
    """The closed loop of harness/scoring/evaluate.py run_core, keeping every record (not a score).
    `tweak` rewrites telemetry before the core sees it (what a real GPU would have reported)."""
    cluster = SimulatedCluster(scenario, start_ts, run_id=scenario.run_id, id_prefix=scenario.name)
    state = CoreState()
    telemetry: list[Envelope] = []
    derived: list[Derived] = []
    commands: list[Command] = []

    def feed(events: Iterable[Envelope], forwarded: bool = False) -> None:
        for event in events:
            if not forwarded:
                event = tweak(event) if tweak is not None else event
                telemetry.append(event)
            for item in step(state, event, policy, scenario.world_size)[1]:
                if isinstance(item, Command):
                    commands.append(item)
                    try:
                        feed(cluster.apply(item).events)
                    except CommandRefused:  # e.g. a check commanded while the job restarts
                        continue
                elif isinstance(item, Forward):
                    feed([item.event], forwarded=True)
                else:
                    derived.append(item)

    t, limit = start_ts, start_ts + 20 * scenario.steps * scenario.step_time_s + 600
    while not cluster.done and t < limit:
        t += dt_s
        feed(cluster.advance(t))
    assert cluster.done, f"{scenario.name} did not finish"
    return SimulatedRun(scenario, start_ts, telemetry, derived, commands, list(cluster.fired))


def _ecc_before_crash(event: Envelope) -> Envelope:
    """run-b's rank 12 reads ECC counters: zero, then an uncorrectable error before it dies."""
    if not (isinstance(event, GpuHealth) and event.rank == ECC_RANK and event.attempt == 0):
        return event
    bad = event.step >= ECC_FROM_STEP
    counters = {
        "ecc_corrected": ECC_CORRECTED if bad else 0,
        "ecc_uncorrected": ECC_UNCORRECTED if bad else 0,
    }
    return GpuHealth(**{**event.model_dump(), **counters})  # validated: the simulator's events are not


@functools.cache
def fixture_runs() -> tuple[SimulatedRun, ...]:
    """Both runs (deterministic: fixed seeds and id prefixes); simulated once per process."""
    return (
        simulate(RUN_A, START["run-a"]),
        simulate(RUN_B, START["run-b"], tweak=_ecc_before_crash),
    )


def write_archive(path: Path, runs: Sequence[SimulatedRun], chunk: int = 5000, reverse: bool = False) -> Path:
    """Archive the runs' records in transactions of `chunk` records, as the writer does; with
    `reverse`, in the opposite order (a consumer that read the topics in another order)."""
    records = [r for run in runs for r in run.records()]
    if reverse:
        records.reverse()
    with Archive(path) as archive:
        for i in range(0, len(records), chunk):
            archive.write(records[i : i + chunk])
    return path
