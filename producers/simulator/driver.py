"""Runs a :class:`SimulatedCluster` in real time against Kafka: the demo's workload
and the benchmarks' load.

One loop thread owns the cluster. Each tick it advances the cluster to the simulated
now, executes the commands the actuator handed over since the last tick, and submits
the resulting events to ONE :class:`TelemetryShipper` (the simulator is one process
standing in for every node, so one shipper batches per node for all of them). The
actuator runs on its own consumer thread and must not touch the cluster, so its
handlers only enqueue the command and wait, briefly, for the loop to execute it:
the ack then carries what really happened ("aborted 63 ranks; restarting ...").

Simulated time is ``start_ts + speed * wall seconds``, and events carry simulated
time, so a run at speed 20 looks to the processors like a run 20x longer.
"""

from __future__ import annotations

import logging
import queue
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...kafka.topics import TopicNames
from ...schemas import Command, Envelope, auth
from ...schemas.commands import COMMAND_KINDS
from ...schemas.sharding import DEFAULT_SHARD_RANKS
from ..rank.shipper import DeliveryHook, ShipperConfig, ShipperStats, TelemetryShipper
from .cluster import CommandRefused, FiredFault, LauncherNote, Phase, SimulatedCluster
from .scenario import FaultTruth, Scenario

if TYPE_CHECKING:
    from ..rank.actuator import Actuator

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Progress:
    """Reported to the `progress` callback about once per wall-clock second."""

    wall_s: float
    sim_ts: float
    step: int
    attempt: int
    phase: Phase
    events: int
    lag_s: float


@dataclass
class SimulationResult:
    run_id: str
    scenario: str
    world_size: int
    finished: bool
    steps_completed: int  # step completions, repeats after restarts included
    last_step: int
    high_water_step: int
    attempts: int
    events_generated: int
    shipper: ShipperStats
    commands_received: int
    commands_executed: int
    commands_refused: int
    wall_s: float
    sim_s: float
    cpu_s: float
    #: Delay between an event's simulated moment and its hand-off to the shipper (wall s).
    max_lag_s: float
    mean_lag_s: float
    kept_real_time: bool
    #: The launcher gave up after the scenario's max_restarts.
    gave_up: bool = False
    #: Why a PauseRun paused the run (a step that fails on every node), when one did.
    paused: str | None = None
    skipped_updates: list[int] = field(default_factory=list)
    self_checks_run: int = 0
    cross_rank_checks_run: int = 0
    ring_checks_run: int = 0
    fired: list[FiredFault] = field(default_factory=list)
    truth: list[FaultTruth] = field(default_factory=list)
    notes: list[LauncherNote] = field(default_factory=list)
    validated_checkpoints: list[int] = field(default_factory=list)
    #: Wall time each command reached the simulated cluster (the actuator's first handler
    #: call) and the time the loop executed it (None: refused), by command id.
    command_times: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    #: Wall time the simulation stopped (no command reaches it after this).
    ended_ts: float = 0.0
    #: What the actuator read and did, and whether it was still running at the end ("" without one).
    actuator: str = ""
    #: The consumer group the actuator keeps its offsets in ("" without one).
    actuator_group: str = ""

    @property
    def events_per_s(self) -> float:
        return self.events_generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def delivered_per_s(self) -> float:
        return self.shipper.delivered / self.wall_s if self.wall_s > 0 else 0.0


class CommandInbox:
    """The thread-safe hand-off from the actuator's thread to the simulation loop.

    The actuator calls a handler once per (command, targeted rank); the first call of a
    command id enqueues it, and every call waits for the loop's verdict, which becomes
    the ack's detail (or a FAILED ack if the cluster refused it)."""

    def __init__(self, wait_s: float = 10.0, remember: int = 10_000) -> None:
        self.wait_s = wait_s
        self.received = 0
        self.wake = threading.Event()
        self._queue: queue.SimpleQueue[tuple[Command, Future[str]]] = queue.SimpleQueue()
        self._futures: dict[str, Future[str]] = {}
        self._remember = remember
        self._lock = threading.Lock()
        self._closed = False
        #: Wall time of each command's first handler call (the actuator read it), by id.
        self.arrived: dict[str, float] = {}

    def handler(self, command: Command, rank: int) -> str | None:
        with self._lock:
            future = self._futures.get(command.command_id)
            if future is None:
                future = Future()
                if self._closed:
                    future.set_exception(CommandRefused("the simulation has ended"))
                else:
                    self.arrived.setdefault(command.command_id, time.time())
                    self._queue.put((command, future))
                    self.received += 1
                    self.wake.set()
                self._futures[command.command_id] = future
                if len(self._futures) > self._remember:
                    self._futures.pop(next(iter(self._futures)))
        return future.result(timeout=self.wait_s)

    def drain(self) -> list[tuple[Command, Future[str]]]:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for _, future in self.drain():
            future.set_exception(CommandRefused("the simulation has ended"))


def _tick_s(scenario: Scenario, speed: float) -> float:
    """A few ticks per simulated step, between 5 ms and 100 ms of wall clock."""
    return min(0.1, max(0.005, scenario.step_time_s / speed / 4))


def run_simulation(
    scenario: Scenario,
    bootstrap: str,
    topics: TopicNames,
    secret: bytes | None,
    speed: float = 1.0,
    max_seconds: float | None = None,
    progress: Callable[[Progress], None] | None = None,
    *,
    run_id: str | None = None,
    start_ts: float | None = None,
    flush_interval_s: float | None = None,
    lag_budget_s: float = 1.0,
    shard_ranks: int = DEFAULT_SHARD_RANKS,
    on_submit: Callable[[list[Envelope]], None] | None = None,
    on_outcome: DeliveryHook | None = None,
    settle_s: float = 0.0,
) -> SimulationResult:
    """Run `scenario` in real time (times `speed`) until it finishes or `max_seconds` of
    wall clock pass. With a `secret` (the master command-signing secret), an actuator
    executes signed commands from the commands topic; without one, no command is read.
    `kept_real_time` is True when no event reached the shipper more than
    `lag_budget_s` after its simulated moment. A run over `shard_ranks` ranks is shipped
    in shards (schemas/sharding.py). `on_submit` sees each tick's events as they are
    handed to the shipper; `on_outcome` is told, by event, what the shipper did with each
    (delivered, dropped, failed: a soak's record of what was acknowledged, for the oracle).

    `settle_s`: a run that is stalled when `max_seconds` pass (a crash or a hang struck
    near the end) goes on up to this long, until the stall ends (its abort landed, or the
    launcher's own timeout tore the attempt down), so that the abort of a fault that struck
    in time is measured rather than cut off with the run."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    wall_start = time.time()
    start_ts = wall_start if start_ts is None else start_ts
    cluster = SimulatedCluster(scenario, start_ts, run_id=run_id)
    flush = flush_interval_s or max(0.05, min(1.0, scenario.step_time_s / speed))
    config = ShipperConfig(
        bootstrap,
        topics.telemetry,
        flush_interval_s=flush,
        max_queued_events=max(100_000, 8 * scenario.world_size),
        producer={"message.max.bytes": 8 * 1024 * 1024},
        shard_ranks=shard_ranks,
    )
    shipper = TelemetryShipper(
        config, cluster.run_id, scenario.world_size, name="simulator", on_outcome=on_outcome
    )
    inbox = CommandInbox()
    actuator: Actuator | None = None
    if secret is not None:
        from ..rank.actuator import Actuator

        actuator = Actuator(
            bootstrap,
            topics.commands,
            topics.acks,
            cluster.run_id,
            attempt=0,
            local_ranks=range(scenario.world_size),
            key=auth.run_key(secret, cluster.run_id),
            node="simulator",
            instance=f"sim-{cluster.run_id}",
        )
        for kind in COMMAND_KINDS:
            actuator.register(kind, inbox.handler)
        actuator.start()
        if not actuator.wait_ready(30.0):
            log.warning("actuator not assigned the commands topic after 30 s; commands may be missed")

    cpu0 = _cpu_s()
    mono0 = time.monotonic()
    tick = _tick_s(scenario, speed)
    generated = executed = refused = 0
    max_lag = lag_sum = 0.0
    lag_ticks = 0
    executed_at: dict[str, float] = {}
    attempt = 0
    next_tick = next_report = mono0
    try:
        while True:
            now_m = time.monotonic()
            sim_now = start_ts + (now_m - mono0) * speed
            events: list[Envelope] = cluster.advance(sim_now)
            for command, future in inbox.drain():
                try:
                    result = cluster.apply(command)
                except CommandRefused as exc:
                    refused += 1
                    future.set_exception(exc)
                    continue
                executed += 1
                executed_at[command.command_id] = time.time()
                events += result.events
                future.set_result(result.detail)
            for event in events:
                shipper.submit(event)
            if on_submit is not None and events:
                on_submit(events)
            generated += len(events)
            if events:
                lag = (time.monotonic() - mono0) - (events[0].ts - start_ts) / speed
                max_lag = max(max_lag, lag)
                lag_sum += lag
                lag_ticks += 1
            if actuator is not None and cluster.attempt != attempt and cluster.attempt >= 0:
                attempt = cluster.attempt
                actuator.set_attempt(attempt)
            elapsed = time.monotonic() - mono0
            grace = settle_s if cluster.phase is Phase.STALLED else 0.0  # for its abort to land
            limit = None if max_seconds is None else max_seconds + grace
            finished = cluster.done or (limit is not None and elapsed >= limit)
            if progress is not None and (finished or time.monotonic() >= next_report):
                next_report += 1.0
                state = (cluster.last_completed, cluster.attempt, cluster.phase)
                progress(Progress(elapsed, sim_now, *state, generated, max_lag))
            if finished:
                break
            next_tick += tick
            delay = next_tick - time.monotonic()
            if delay < 0:
                next_tick = time.monotonic()  # behind: carry on without a burst of catch-up ticks
            elif inbox.wake.wait(delay):
                inbox.wake.clear()
    finally:
        wall_s = time.monotonic() - mono0
        ended_ts = time.time()
        inbox.close()
        told = ""
        if actuator is not None:
            told = _actuator_summary(actuator)
            actuator.stop(timeout_s=10.0)
        stats = shipper.close(timeout_s=30.0)
        cpu_s = _cpu_s() - cpu0
    mean_lag = lag_sum / lag_ticks if lag_ticks else 0.0
    return SimulationResult(
        run_id=cluster.run_id,
        scenario=scenario.name,
        world_size=scenario.world_size,
        finished=cluster.phase is Phase.FINISHED,
        steps_completed=cluster.steps_completed,
        last_step=cluster.last_completed,
        high_water_step=cluster.high_water_step,
        attempts=cluster.attempt + 1,
        events_generated=generated,
        shipper=stats,
        commands_received=inbox.received,
        commands_executed=executed,
        commands_refused=refused,
        wall_s=wall_s,
        sim_s=cluster.now - start_ts,
        cpu_s=cpu_s,
        max_lag_s=max_lag,
        mean_lag_s=mean_lag,
        kept_real_time=max_lag <= lag_budget_s,
        gave_up=cluster.phase is Phase.FAILED,
        paused=cluster.paused,
        skipped_updates=list(cluster.skipped_updates),
        self_checks_run=cluster.self_checks_run,
        cross_rank_checks_run=cluster.cross_rank_checks_run,
        ring_checks_run=cluster.ring_checks_run,
        fired=list(cluster.fired),
        truth=scenario.truth(),
        notes=list(cluster.notes),
        validated_checkpoints=sorted(cluster.validated),
        command_times={i: (t, executed_at.get(i)) for i, t in inbox.arrived.items()},
        ended_ts=ended_ts,
        actuator=told,
        actuator_group=actuator.group_id if actuator is not None else "",
    )


def _actuator_summary(actuator: Actuator) -> str:
    """The actuator's counters in a line: what a command that never reached the cluster met."""
    stats, gate = actuator.stats, actuator.counters
    refused = ", ".join(f"{reason} {n}" for reason, n in gate.refused.items()) or "0"
    state = "running" if actuator.running else f"stopped ({actuator.error!r})"
    return (
        f"{state}; read {stats.records} records: executed {gate.executed} (rank, command), "
        f"duplicate {gate.duplicate}, other run {gate.other_run}, untargeted {gate.untargeted}, "
        f"other role {gate.other_role}, refused {refused}; {stats.acks_delivered} acks, "
        f"{stats.ack_retries} ack retries, {stats.commit_errors} commit errors"
    )


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (the shipper's and librdkafka's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
