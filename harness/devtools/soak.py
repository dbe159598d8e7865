"""The chaos soak (issue 7 scenario 6): the whole pipeline under load while its own
parts are SIGKILLed at random, then the nothing-lost oracle over every run.

W processor workers and the archive writer run as processes of their own on a fresh
topic set; R simulated runs (each a process of its own, with its shipper and its
actuator, which executes and acks the commands) stream telemetry with hangs,
stragglers and crashes. At the planned moments (harness/devtools/soak_plan.py) a worker or
the archive writer is SIGKILLed and restarted after a short delay, and ranks crash.
At the end the load stops, the workers catch up and leave, the archive writer catches
up and leaves, and harness/scoring/oracle.py checks each run against the log, its acks and the
archive.
"""

from __future__ import annotations

import multiprocessing
import random
import secrets
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from trainguard.kafka.lag import wait_caught_up
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, partition_count, topic_names
from trainguard.processors.core.policy import load_policy
from trainguard.producers.command_roles import OUTLIVE_THEIR_ATTEMPT
from trainguard.producers.rank.shipper import DeliveryOutcome
from trainguard.producers.simulator.driver import SimulationResult, run_simulation
from trainguard.producers.simulator.scenario import Scenario, SlowFault
from trainguard.replay.log import read_recording, read_topic
from trainguard.replay.replay import decision_id, decisions_of
from trainguard.schemas import (
    Abort,
    Ack,
    AckStatus,
    Command,
    Derived,
    Envelope,
    Interruption,
    InterruptionCause,
    QuarantineNode,
    ReasonCode,
    decode,
    decode_batch,
)
from trainguard.schemas.codec import ACKS
from trainguard.schemas.sharding import telemetry_partition
from trainguard.sinks.archive import archive_group

from ..scoring.oracle import (
    ARCHIVE,
    EXECUTED_ONCE,
    NOTHING_LOST,
    ONE_DECISION,
    RANK_ORDER,
    REPLAY,
    OracleReport,
    OracleVerdict,
    check,
)
from .soak_plan import Kill, SoakConfig, Victim, plan_kills, run_scenario
from .soak_procs import Slot, archive_launcher, worker_launcher
from .soak_timeline import AbortTimeline, WorkerEvent, abort_timelines, worker_events
from .stack import PROCESSOR_GROUP, builtin_policy

Note = Callable[[str], None]
#: A crash or hang that struck this close to the end may still be recovering.
RECOVERY_GRACE_S = 45.0
#: A run stalled when the load ends goes on this long at most for the stall's abort to land
#: (a hang struck 2 s before the end times out after it: its abort would reach no rank).
SETTLE_S = 30.0


@dataclass
class RunLoad:
    """One simulated run in its own process, and what its shipper did with each event, by id."""

    scenario: Scenario
    run_id: str
    outcomes: dict[DeliveryOutcome, set[str]] = field(
        default_factory=lambda: {o: set() for o in DeliveryOutcome}
    )
    start_ts: float = 0.0
    result: SimulationResult | None = None
    error: str = ""

    def told(self, outcome: DeliveryOutcome, events: Sequence[Envelope]) -> None:
        self.outcomes[outcome].update(e.event_id for e in events)


@dataclass(frozen=True)
class HangOutcome:
    """One hang of a run (issue 14: the culprit named from its stack, the abort acked
    within seconds of the timeout)."""

    rank: int  # the rank that hung
    named: int  # the rank the hang's interruption named (-1: none, or no interruption)
    code: str  # the interruption's reason code ("" without one)
    #: Wall seconds from the hang timeout to the first ack of its stack-dump abort (None: never).
    ack_s: float | None
    #: Seconds into the load the hang struck (its step began and never ended).
    at_s: float = 0.0

    @property
    def from_stack(self) -> bool:
        return self.named == self.rank and self.code == ReasonCode.ODD_STACK


@dataclass
class RunOutcome:
    run_id: str
    scenario: str
    oracle: OracleReport
    result: SimulationResult | None
    #: Fault kinds that struck, with their counts (slow: the straggler window was reached).
    faults: dict[str, int]
    recovered: int
    stalls: int
    survived: bool
    events: int
    lost: int
    #: Redelivered copies of decisions (derived events and commands) on their topics.
    duplicates: int
    decisions: int
    executions: int
    #: Wall seconds from each abort's decision (its event time: the crash, or the hang's
    #: timeout) to its first ack, sorted: how long a stalled job waited for its abort, which
    #: is what a worker's kill costs (its partitions wait for a new owner).
    abort_latencies: list[float] = field(default_factory=list)
    #: Each hang that struck: whom the verdict named, how, and how soon its abort was acked.
    hangs: list[HangOutcome] = field(default_factory=list)
    #: Nodes quarantined although no fault struck them.
    innocent_quarantines: list[str] = field(default_factory=list)
    #: Each abort's stages from its cause to its first ack (soak_timeline.py).
    timelines: list[AbortTimeline] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.oracle.ok and self.result is not None


@dataclass
class SoakReport:
    config: SoakConfig
    prefix: str
    archive: Path
    plan: list[Kill]
    kills: Counter[str]
    restarts: Counter[str]
    skipped: int
    downtimes: dict[str, list[float]]
    #: The workers' counters over all their incarnations (soak_procs.COLLECTED).
    worker_metrics: dict[str, float]
    failures: list[str]
    runs: list[RunOutcome]
    load_s: float
    drain_s: float
    total_s: float

    @property
    def ok(self) -> bool:
        return not self.failures and all(r.ok for r in self.runs)

    @property
    def events_per_s(self) -> float:
        return sum(r.events for r in self.runs) / self.load_s if self.load_s > 0 else 0.0


def spread_run_ids(count: int, partitions: int) -> list[str]:
    """Run ids spread evenly over the telemetry partitions (run i on partition
    i * partitions / count), so that every worker holds runs under either of the
    group's assignors (ranges of partitions, or every n-th one)."""
    ids: list[str] = []
    while len(ids) < count:
        run_id = f"soak-{uuid.uuid4().hex[:8]}"
        if telemetry_partition(run_id, 0, 1, partitions) == len(ids) * partitions // count % partitions:
            ids.append(run_id)
    return ids


def run_soak(
    config: SoakConfig,
    bootstrap: str,
    workdir: Path,
    note: Note = lambda _: None,
    keep_topics: bool = False,
) -> SoakReport:
    """The whole soak on `bootstrap` under `workdir` (logs, the archive)."""
    started = time.monotonic()
    rng = random.Random(config.seed)
    plan = plan_kills(config, rng)
    scenarios = [run_scenario(config, i, plan, rng) for i in range(config.runs)]
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    prefix = f"soak{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    policy = builtin_policy("demo")
    secret = secrets.token_hex(32)
    db = workdir / "archive"
    slots = _slots(config, bootstrap, prefix, policy, secret, workdir, db)
    try:
        _start_all(slots)
        note(f"{config.workers} workers and the archive writer up on {prefix}* "
             f"({time.monotonic() - started:.0f} s)")  # fmt: skip
        partitions = partition_count(bootstrap, names.telemetry)
        run_ids = spread_run_ids(config.runs, partitions)
        loads = [RunLoad(s, r) for s, r in zip(scenarios, run_ids, strict=True)]
        t0 = time.monotonic()
        threads = [_start_load(load, config, bootstrap, names, secret.encode()) for load in loads]
        skipped = _chaos(plan, slots, t0, note)
        for thread in threads:
            thread.join()
        load_s = time.monotonic() - t0
        note(f"load stopped after {load_s:.0f} s; waiting for the restarts and the catch-up")
        drain_start = time.monotonic()
        failures = _drain(slots, bootstrap, names, prefix, note)
        drain_s = time.monotonic() - drain_start
        note(f"caught up in {drain_s:.0f} s; running the oracle")
        acks = _acks(bootstrap, names)
        workers = worker_events(workdir, {s.name: s.killed_at for s in slots if s.victim is Victim.WORKER})
        runs = [
            _judge(
                load, config, bootstrap, names, policy, db, acks.get(load.run_id, []), (partitions, workers)
            )
            for load in loads
        ]
    finally:
        for slot in slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()
        if not keep_topics:
            delete_topics(bootstrap, list(names.all()))
    kills = Counter(
        {v.value: sum(s.kills for s in slots if s.victim is v) for v in (Victim.WORKER, Victim.ARCHIVE)}
    )
    kills[Victim.RANK.value] = sum(r.faults.get("crash", 0) for r in runs)
    failures += [f for s in slots for f in s.failures] + [load.error for load in loads if load.error]
    return SoakReport(
        config=config,
        prefix=prefix,
        archive=db,
        plan=plan,
        kills=kills,
        restarts=Counter({v.value: sum(s.restarts for s in slots if s.victim is v) for v in Victim}),
        skipped=skipped,
        downtimes={s.name: s.downtimes for s in slots},
        worker_metrics=_sum_metrics([s.metrics for s in slots if s.victim is Victim.WORKER]),
        failures=failures,
        runs=runs,
        load_s=load_s,
        drain_s=drain_s,
        total_s=time.monotonic() - started,
    )


def _sum_metrics(each: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for metrics in each:
        for name, value in metrics.items():
            out[name] = out.get(name, 0.0) + value
    return out


def _slots(
    config: SoakConfig, bootstrap: str, prefix: str, policy: Path, secret: str, workdir: Path, db: Path
) -> list[Slot]:
    slots = []
    for i in range(config.workers):
        # Each worker's faust directory apart: two workers of one app id must not share it.
        env = {"TRAINGUARD_SECRET": secret, "TRAINGUARD_HOME": str(workdir / f"worker-{i}")}
        # A static member, as deployed (docker-compose.yml, a StatefulSet's pod name): a
        # restarted worker takes its partitions straight back, without a rebalance that
        # would wait for the killed incarnation's session to expire.
        extra = ("--snapshot-interval", str(config.snapshot_interval_s), "--instance-id", f"worker-{i}")
        launch = worker_launcher(bootstrap, prefix, policy, env, extra)
        slots.append(Slot(f"worker-{i}", Victim.WORKER, launch, workdir))
    slots.append(Slot("archive", Victim.ARCHIVE, archive_launcher(bootstrap, prefix, db, {}), workdir))
    return slots


def _start_all(slots: list[Slot]) -> None:
    """Start every slot at once (a worker takes seconds to answer on its metrics port)."""
    errors: list[BaseException] = []

    def start(slot: Slot) -> None:
        try:
            slot.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(slot,), daemon=True) for slot in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


#: Simulations start in fresh interpreters: this process has broker clients and threads
#: that a fork would copy half-way.
_SPAWN = multiprocessing.get_context("spawn")


def _start_load(
    load: RunLoad, config: SoakConfig, bootstrap: str, names: TopicNames, secret: bytes
) -> threading.Thread:
    """The run's simulation in a process of its own (its result and its shipper's outcomes
    come back when it ends), watched by a thread of this one. Each run of thousands of ranks
    keeps a core busy: as threads of one process, two runs shared one interpreter and fell
    tens of seconds behind their clocks, which a crash's abort then carried as latency."""

    def body() -> None:
        ours, theirs = _SPAWN.Pipe(duplex=False)
        child = _SPAWN.Process(
            target=_simulate, args=(theirs, load, config, bootstrap, names, secret),
            name=f"load-{load.run_id}", daemon=True,
        )  # fmt: skip
        child.start()
        theirs.close()
        try:
            done: RunLoad = ours.recv()
        except EOFError:
            load.error = f"{load.run_id}: the simulation's process died (exit code {child.exitcode})"
        else:
            load.start_ts, load.result, load.outcomes, load.error = (
                done.start_ts, done.result, done.outcomes, done.error,
            )  # fmt: skip
        child.join()

    thread = threading.Thread(target=body, name=f"load-{load.run_id}", daemon=True)
    thread.start()
    return thread


def _simulate(
    conn: Connection, load: RunLoad, config: SoakConfig, bootstrap: str, names: TopicNames, secret: bytes
) -> None:
    """A load's process: the simulation, then `load` with its result sent back."""
    load.start_ts = time.time()
    try:
        load.result = run_simulation(
            load.scenario, bootstrap, names, secret, speed=config.speed, max_seconds=config.duration_s,
            run_id=load.run_id, start_ts=load.start_ts, on_outcome=load.told, settle_s=SETTLE_S,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the report names it, and the run fails
        load.error = f"{load.run_id}: the simulation failed: {exc!r}"
    conn.send(load)
    conn.close()


def _chaos(plan: list[Kill], slots: list[Slot], t0: float, note: Note) -> int:
    """Carry out the plan's process kills on time; returns how many found no live victim."""
    skipped = 0
    for kill in plan:
        if (wait := t0 + kill.at_s - time.monotonic()) > 0:
            time.sleep(wait)
        if kill.victim is Victim.RANK:
            note(
                f"{kill.at_s:6.1f} s  rank {kill.rank} of run {kill.target} crashes about now (its scenario)"
            )
            continue
        slot = _victim(kill, slots)
        if slot is None:
            skipped += 1
            note(f"{kill.at_s:6.1f} s  no live {kill.victim.value} to kill: skipped")
            continue
        slot.kill_and_restart(kill.restart_after_s)
        note(f"{kill.at_s:6.1f} s  SIGKILL {slot.name} (restart in {kill.restart_after_s:.1f} s)")
    return skipped


def _victim(kill: Kill, slots: list[Slot], wait_s: float = 30.0) -> Slot | None:
    """The planned slot if it is up, else another of its kind that is; waits (bounded)
    while all of them are being restarted."""
    kind = [s for s in slots if s.victim is kill.victim]
    preferred = kind[kill.target % len(kind)]
    deadline = time.monotonic() + wait_s
    while True:
        if preferred.alive():
            return preferred
        if up := [s for s in kind if s.alive()]:
            return up[0]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def _drain(slots: list[Slot], bootstrap: str, names: TopicNames, prefix: str, note: Note) -> list[str]:
    """Every killed slot back, the workers caught up and stopped (they commit), then the
    archive writer caught up and stopped: the log and the archive are final."""
    failures: list[str] = []
    for slot in slots:
        slot.wait_restarted()
    workers = [s for s in slots if s.victim is Victim.WORKER]
    if not wait_caught_up(bootstrap, prefix + PROCESSOR_GROUP, [names.telemetry], 300):
        failures.append("the workers did not catch up with the telemetry within 300 s")
    for slot in workers:
        slot.terminate()
    for slot in workers:
        slot.reap()
    note("workers caught up and stopped")
    archived = [names.telemetry, names.events, names.commands, names.acks, names.deadletter]
    if not wait_caught_up(bootstrap, archive_group(names), archived, 300):
        failures.append("the archive writer did not catch up within 300 s")
    for slot in slots:
        if slot.victim is Victim.ARCHIVE:
            slot.terminate()
            slot.reap()
    return failures


def _acks(bootstrap: str, names: TopicNames) -> dict[str, list[Ack]]:
    out: dict[str, list[Ack]] = {}
    for _, _, value in read_topic(bootstrap, names.acks):
        ack = decode(value, ACKS)
        if isinstance(ack, Ack):
            out.setdefault(ack.run_id, []).append(ack)
    return out


def _judge(
    load: RunLoad,
    config: SoakConfig,
    bootstrap: str,
    names: TopicNames,
    policy: Path,
    db: Path,
    acks: list[Ack],
    workers: tuple[int, list[WorkerEvent]] = (1, []),
) -> RunOutcome:
    """The oracle over one run, and the run's figures for the report (`workers`: the
    telemetry topic's partition count, and what the workers did, for the abort timelines)."""
    recording = read_recording(bootstrap, names, load.run_id)
    result = load.result
    stats = result.shipper if result is not None else None
    # The shipper tells each event's outcome by id: "nothing lost" covers every acknowledged
    # event even when others were dropped (a full buffer drops by design, and counts it).
    acknowledged = load.outcomes[DeliveryOutcome.DELIVERED]
    told = {o.value: len(ids) for o, ids in load.outcomes.items()}
    counted = {o.value: getattr(stats, o.value) for o in DeliveryOutcome} if stats is not None else {}
    accounted = stats is not None and told == counted and stats.in_flight == 0
    detail = (
        f"{stats.delivered} of {stats.submitted} submitted events acknowledged, "
        f"{stats.dropped} dropped, {stats.failed} failed; by id: {told}" if stats is not None else load.error
    )  # fmt: skip
    expect = {NOTHING_LOST, RANK_ORDER}
    if result is not None and result.fired:
        expect |= {ONE_DECISION, REPLAY, ARCHIVE}  # a fault makes decisions
    if recording.commands:
        expect.add(EXECUTED_ONCE)  # the ranks run the commands
    report = check(
        recording, load_policy(str(policy)), acknowledged=acknowledged, acks=acks, archive=db, expect=expect
    )
    report.verdicts.insert(
        0, OracleVerdict("shipper accounting", accounted, detail, stats.submitted if stats else 0)
    )
    report.verdicts.append(lasting_commands(acks))
    logged = {e.event_id for _, _, value in recording.records for e in decode_batch(value).events}
    ids = [decision_id(d) for d in decisions_of(recording)]
    faults: Counter[str] = Counter(f.kind for f in result.fired) if result is not None else Counter()
    reached = result.high_water_step if result is not None else -1
    faults["slow"] = sum(isinstance(f, SlowFault) and f.from_step <= reached for f in load.scenario.faults)
    stalls = [f for f in (result.fired if result is not None else []) if f.kind in ("crash", "hang")]
    attempts = result.attempts if result is not None else 0
    recovered = [f for f in stalls if f.attempt < attempts - 1]
    aborts = [c for c in recording.commands if isinstance(c, Abort)]
    timelines = abort_timelines(
        load.run_id, aborts, recording.derived, acks, result.command_times if result is not None else {},
        load.start_ts, config.speed, bootstrap, (names.telemetry, names.commands),
        telemetry_partition(load.run_id, 0, 1, workers[0]), workers[1],
        actuator_group=result.actuator_group if result is not None else "",
        ended=result.ended_ts if result is not None else None,
    )  # fmt: skip
    late = config.duration_s - RECOVERY_GRACE_S
    pending_ok = all((f.ts - load.start_ts) / config.speed > late for f in stalls if f not in recovered)
    return RunOutcome(
        run_id=load.run_id,
        scenario=load.scenario.name,
        oracle=report,
        result=result,
        faults=dict(+faults),
        recovered=len(recovered),
        stalls=len(stalls),
        survived=result is not None and not result.gave_up and pending_ok,
        events=stats.delivered if stats is not None else 0,
        lost=len(acknowledged - logged),
        duplicates=len(ids) - len(set(ids)),
        decisions=len(set(ids)),
        executions=sum(a.status is AckStatus.EXECUTED for a in acks),
        abort_latencies=_ack_latencies(aborts, acks, load.start_ts, config.speed),
        hangs=_hangs(result, recording.derived, recording.commands, acks, load.start_ts, config.speed),
        innocent_quarantines=sorted(
            {c.node for c in recording.commands if isinstance(c, QuarantineNode)}
            - {f.node for f in (result.fired if result is not None else [])}
        ),
        timelines=timelines,
    )


#: The check that a node's quarantine or release (and the processor's go-ahead) decided in
#: one attempt is executed when it lands after the restart (command_roles.OUTLIVE_THEIR_ATTEMPT).
LASTING = "lasting commands executed"


def lasting_commands(acks: list[Ack]) -> OracleVerdict:
    """No command that outlives its attempt refused as stale (issue 49: a late
    quarantine_node refused by all 2,048 simulated ranks, "command is for attempt 1")."""
    kinds = {kind.KIND for kind in OUTLIVE_THEIR_ATTEMPT}
    lasting = [a for a in acks if a.command_kind in kinds]
    stale = [
        a for a in lasting
        if a.status in (AckStatus.REFUSED, AckStatus.FAILED) and "command is for attempt" in a.detail
    ]  # fmt: skip
    ids = {a.command_id for a in lasting}
    detail = f"{len(ids)} lasting commands acked, {len({a.command_id for a in stale})} refused as stale"
    if stale:
        detail += f" (e.g. {stale[0].command_kind} {stale[0].command_id}: {stale[0].detail})"
    return OracleVerdict(LASTING, not stale, detail, len(ids))


def _hangs(
    result: SimulationResult | None,
    derived: list[Derived],
    commands: list[Command],
    acks: list[Ack],
    start_ts: float,
    speed: float,
) -> list[HangOutcome]:
    """Each hang that struck, with the verdict of its attempt and its abort's ack latency."""
    out = []
    for fault in (f for f in (result.fired if result is not None else []) if f.kind == "hang"):
        verdict = next(
            (
                d
                for d in derived
                if isinstance(d, Interruption)
                and d.cause == InterruptionCause.HANG
                and d.attempt == fault.attempt
            ),
            None,
        )
        aborts: list[Command] = [
            c for c in commands if isinstance(c, Abort) and c.stack_dump and c.attempt == fault.attempt
        ]
        latency = _ack_latencies(aborts[:1], acks, start_ts, speed)
        out.append(
            HangOutcome(
                fault.rank,
                verdict.rank if verdict is not None else -1,
                verdict.reason.code.value if verdict is not None else "",
                latency[0] if latency else None,
                (fault.ts - start_ts) / speed,
            )
        )
    return out


def _ack_latencies(
    commands: Sequence[Command], acks: list[Ack], start_ts: float, speed: float
) -> list[float]:
    first: dict[str, float] = {}
    for ack in acks:
        first[ack.command_id] = min(ack.ts, first.get(ack.command_id, ack.ts))
    decided = {c.command_id: start_ts + (c.issued_ts - start_ts) / speed for c in commands}  # sim -> wall
    return sorted(first[i] - t for i, t in decided.items() if i in first)
