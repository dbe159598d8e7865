"""A simulated synchronous training job and its launcher, as a deterministic state machine.

The cluster never reads a clock: the driver calls :meth:`SimulatedCluster.advance`
with the current time and gets back every event whose timestamp has come, in time
order, each stamped with the simulated moment it happened (not the moment it was
asked for). So the same scenario, seed and command arrival times give the same events
however often the driver ticks, and tests run hours of training in milliseconds.

What it models (seed §7): one step is compute (different on every rank; a slow rank
only slows its own compute, measured before the collective) followed by an all-reduce
that every rank leaves together, when the slowest rank arrives. A crashed rank never
arrives, and a hung one never finishes computing, so no rank completes another step;
survivors stay alive in the collective and keep heartbeating. Nothing in the job
notices: an ``Abort`` command (from the processors) tears the attempt down, collecting
stack signatures when asked, and the simulated launcher restarts from the newest
validated checkpoint after ``restart_delay_s``. If no command comes, the launcher's
collective timeout (``orphan_restart_after_s``) kills the stalled attempt instead
(SIGABRT, like NCCL's watchdog) and restarts it; after ``max_restarts`` restarts it
gives up (phase FAILED).

Elastic training (issue 45, capacity.py): when a quarantined node's replacement takes
``replacement_s`` to arrive, the launcher waits for it or goes on with the survivors in a
smaller world, as the processor's InterruptionDecided says; a smaller world renumbers its
ranks over the nodes left (a rank fault strikes the rank so numbered in the attempt it
strikes in), each step W/W' as long (the same global batch), and grows back at the first
checkpoint after the replacement arrives.

SDC checks are commanded (seed R3): ``RunSelfCheck`` makes a rank recompute its own
microbatch at the first step >= the commanded one and report two digests (equal, unless
a bit flip or an SDC fault strikes it; a deterministically wrong GPU passes), and
``RunCrossRankCheck`` makes two or three ranks compute the same microbatch and report
their values (good ranks agree to ``cross_rank_noise``; a wrong GPU's is biased; its
``batch_rank`` changes nothing here, a simulated value derives from the microbatch id).
``RunRingCheck`` makes every live rank compute its own microbatch and recompute that of
rank (r + offset) mod W, and report both (RingCheck): a wrong GPU biases both of its
values, so it fails both comparisons it takes part in. A transient bit flip strikes the
self-check only (once), as before. A scenario's ``sdc_check_every`` adds a rotating
self-check of the simulator's own.

The verification watermark (R6): every validated checkpoint carries
``last_verified_step``, the newest step whose self-check passed in the checkpoint's
lineage; a failing check freezes it for the rest of the attempt. A run in which no
self-check was ever run (no command yet, ``sdc_check_every`` 0) keeps the old
behaviour: a checkpoint claims its own step.

Why one file of ~1,000 lines: the job and its launcher are one state machine whose
parts (the attempt, the live ranks, the step in flight, pending checkpoints, faults,
spares) every handler reads and writes; cut along the command handlers or the SDC
checks, each piece would be a mixin reaching into some forty of the same attributes.
Its sections (public API, scheduling, attempts, steps, faults and health, timed items,
exits, commands) are marked below.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import logging
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ...schemas import (
    NO_STEP,
    Abort,
    CheckpointFailed,
    CheckpointNow,
    CheckpointValidated,
    CheckpointWritten,
    Command,
    CrossRankCheck,
    DrainNode,
    Envelope,
    EvictRank,
    GpuHealth,
    Heartbeat,
    InterruptionDecided,
    NodeSelfTestResult,
    PauseRun,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    ReleaseNode,
    ResumeFrom,
    RingCheck,
    Rollback,
    RunCrossRankCheck,
    RunNodeSelfTest,
    RunRingCheck,
    RunSelfCheck,
    RunStarted,
    SdcSelfCheck,
    SetCheckpointInterval,
    SkipUpdate,
    StepStats,
    StepTiming,
)
from ..command_roles import OUTLIVE_THEIR_ATTEMPT
from .capacity import Capacity, World
from .factory import EventFactory
from .periodic import PhaseWheel
from .scenario import (
    COLLECTIVE_STACK,
    BitFlipFault,
    CrashFault,
    GradSpikeFault,
    HangFault,
    NanFault,
    PhantomRanksFault,
    Scenario,
    SdcFault,
    SlowFault,
    WrongGpuFault,
)
from .workload import (
    Slowdown,
    apply_noise,
    collective_s,
    compute_median_s,
    cross_rank_value,
    digest,
    gpu_reading,
    grad_norm_curve,
    loss_curve,
    rank_medians,
    step_rng,
)

log = logging.getLogger(__name__)

SIGABRT, SIGKILL, SIGTERM = 6, 9, 15
#: Where in its compute a crashing rank dies (fraction of its compute time).
_CRASH_POINT = 0.5
#: Bytes per checkpoint shard the simulated checkpoints claim (1 GiB: seed R1).
_SHARD_BYTES = 1 << 30
#: Relative error of an SDC-faulty (nondeterministically wrong) GPU's cross-rank value.
_SDC_CROSS_RANK_ERROR = 1e-3
#: The node self-tests a simulated node can run (RunNodeSelfTest.tests).
_SELF_TESTS = ("gemm", "collective")


class Phase(StrEnum):
    WAITING = "waiting"  # no process of the attempt is alive: before a (re)start
    TRAINING = "training"
    STALLED = "stalled"  # alive ranks, but no step can complete (a crash or a hang)
    FINISHED = "finished"
    FAILED = "failed"  # the launcher gave up after max_restarts restarts
    PAUSED = "paused"  # a PauseRun command: the launcher restarts nothing until a human acts


class CommandRefused(ValueError):
    """A command the simulated job cannot execute (the actuator acks it FAILED with this text)."""


@dataclass(frozen=True, slots=True)
class FiredFault:
    """A fault as it actually struck (a planned fault may strike never, once, or repeatedly)."""

    kind: str
    rank: int
    node: str
    step: int
    attempt: int
    ts: float


@dataclass(frozen=True, slots=True)
class CommandResult:
    detail: str
    events: list[Envelope]


@dataclass(frozen=True, slots=True)
class LauncherNote:
    """Something the simulated launcher did on its own (no command asked for it)."""

    ts: float
    text: str


_Item = tuple[float, int, str, tuple[Any, ...]]


class SimulatedCluster:
    """The whole simulated job: ranks, launcher and checkpoint validator.

    `start_ts` is when attempt 0 launches. `id_prefix` makes event ids unique across
    simulator instances (random by default; pass one for bit-identical reruns).
    `validate` builds every event through pydantic validation (slow; for tests)."""

    def __init__(
        self,
        scenario: Scenario,
        start_ts: float,
        run_id: str | None = None,
        id_prefix: str | None = None,
        validate: bool = False,
    ) -> None:
        self.scenario = sc = scenario
        self.run_id = run_id or sc.run_id or f"sim-{sc.name}-{uuid.uuid4().hex[:8]}"
        self._make = EventFactory(self.run_id, id_prefix or uuid.uuid4().hex[:12], validate).make
        self._rng = random.Random(f"trainguard-sim-timing:{sc.seed}")
        self._health_rng = random.Random(f"trainguard-sim-health:{sc.seed}")
        layout_rng = random.Random(f"trainguard-sim-layout:{sc.seed}")
        self._heartbeats = PhaseWheel(sc.world_size, sc.heartbeat_interval_s, layout_rng)
        self._health = (
            PhaseWheel(sc.world_size, sc.gpu_health_interval_s, layout_rng)
            if sc.gpu_health_interval_s > 0
            else None
        )
        self._base_temp = [62.0 + 6.0 * layout_rng.random() for _ in range(sc.world_size)]
        self._compute_median = compute_median_s(sc)
        self._rank_medians = rank_medians(sc)
        self._collective = collective_s(sc)
        self.config_digest = hashlib.sha256(sc.model_dump_json().encode()).hexdigest()[:16]

        # Hardware: node names per node index (quarantine swaps in spares, same rack).
        self._original_nodes = sc.node_names()
        # Faults by what they act on, so the per-step paths scan only their own.
        faults = list(enumerate(sc.faults))
        self._stall_faults = [(i, f) for i, f in faults if isinstance(f, CrashFault | HangFault)]
        self._data_faults = [(i, f) for i, f in faults if isinstance(f, NanFault | GradSpikeFault)]
        gpu_kinds = SdcFault | BitFlipFault | WrongGpuFault
        self._gpu_faults = [(i, f) for i, f in faults if isinstance(f, gpu_kinds)]
        self._phantoms = [(i, f) for i, f in faults if isinstance(f, PhantomRanksFault)]
        #: Records the simulator emitted for ranks outside the world size.
        self.phantom_records = 0
        self._nodes = list(self._original_nodes)
        self._rack_of = sc.racks()
        self._rank_node: list[str] = []
        self._spares = itertools.count()
        self._replace: set[int] = set()
        #: Nodes a ReleaseNode returned to the pool after they were replaced: the next
        #: replacements take them before a new spare.
        self._released: list[str] = []
        #: Why the run was paused (PauseRun), when it was.
        self.paused: str | None = None
        #: Replacements that take time, the processor's capacity decisions (issue 45).
        self.capacity = Capacity(sc)
        self._restart_token = 0

        # Run-level state.
        self.now = start_ts
        self.phase = Phase.WAITING
        self.attempt = -1
        self.checkpoint_every = sc.checkpoint_every
        self.last_validated_step = -1
        self.validated: dict[int, str] = {}
        self.fired: list[FiredFault] = []
        self.notes: list[LauncherNote] = []
        self.commands_applied = 0
        #: Steps whose update a SkipUpdate command skipped (the anomaly counter, seed §7).
        self.skipped_updates: list[int] = []
        #: Self-checks and cross-rank checks the ranks ran.
        self.self_checks_run = 0
        self.cross_rank_checks_run = 0
        self.ring_checks_run = 0
        #: Node self-tests run: (node, passed).
        self.node_self_tests: list[tuple[str, bool]] = []
        #: Step completions, repeats after restarts included; and the furthest step reached.
        self.steps_completed = 0
        self.high_water_step = -1
        self._struck: set[int] = set()  # indices of non-repeating faults that struck
        self._bursts: dict[int, int] = {}  # NaN fault index -> attempt its burst runs in
        self._checks_ever = False  # a self-check ran at some point of the run (R6)
        self._verified_of: dict[int, int] = {}  # validated checkpoint step -> last_verified_step
        self._heap: list[_Item] = []
        self._seq = itertools.count()

        # Attempt-level state (reset by _on_restart).
        #: The attempt's world: its size and the node indices its ranks run on (elastic).
        self._world = self.capacity.full()
        self._world_nodes = list(self._nodes)
        self.last_completed = -1
        self.resumed_from_step = -1
        self._live = bytearray(sc.world_size)
        self._live_count = 0
        self._step = 0
        self._step_end: float | None = None
        self._compute: list[float] = []
        self._total = 0.0
        self._block_next = 0.0
        self._hang: tuple[int, str, str] | None = None  # (rank, stack, phase)
        self._compute_t0 = start_ts  # when the running step's compute began (heartbeat phases)
        self._stall_token = 0
        self._pending_writes: set[int] = set()
        self._checkpoint_requested = False
        self._stop_after_checkpoint = False
        #: A DrainNode in force: the next checkpoint is its boundary (the ranks stop there).
        self._drain_pending = False
        #: The drain's boundary step: only its checkpoint's write stops the job.
        self._leave_at: int | None = None
        self._restart_from: int | None = None
        self._self_check_due: list[tuple[int, int]] = []  # (first step it may run at, rank)
        self._cross_due: list[tuple[int, str, tuple[int, ...]]] = []  # (step, microbatch, ranks)
        self._ring_due: list[tuple[int, str, int]] = []  # (step, check id, offset)
        self._watermark = -1
        self._watermark_frozen = False
        self._slow_cache: dict[tuple[int, tuple[int, ...]], dict[int, Slowdown]] = {}

        self._schedule(start_ts, "restart", ())

    # ================================================================== public API
    @property
    def done(self) -> bool:
        """The job finished (or the launcher gave up) and no checkpoint is still being
        written or validated."""
        return self.phase in (Phase.FINISHED, Phase.FAILED, Phase.PAUSED) and not any(
            kind in ("written", "validated") for _, _, kind, _ in self._heap
        )

    @property
    def live_ranks(self) -> int:
        return self._live_count

    @property
    def world_size(self) -> int:
        """The ranks of the current attempt (smaller than the scenario's while shrunk)."""
        return self._world.size

    def node_of(self, rank: int) -> str:
        """The node rank runs on in the current attempt."""
        return self._world_nodes[rank // self.scenario.ranks_per_node]

    def advance(self, now: float) -> list[Envelope]:
        """Every event with a timestamp up to `now`, in time order."""
        if now < self.now:
            now = self.now  # a clock that steps back never un-happens events
        out: list[Envelope] = []
        while True:
            t_next = self._next_discrete()
            if t_next > now:
                self._periodic(now, True, out)
                break
            self._periodic(t_next, False, out)
            self._fire_next(out)
        self.now = now
        return out

    def command_handlers(self) -> dict[type[Command], Callable[[Command, list[Envelope]], str]]:
        """The simulator role's handlers (producers/command_roles.py: EXECUTED_BY): each
        returns its ack's detail and appends the events the command makes the job emit."""
        return {kind: functools.partial(handler, self) for kind, handler in self._COMMANDS.items()}

    def apply(self, command: Command) -> CommandResult:
        """Execute a command at the current time (call :meth:`advance` first). Raises
        CommandRefused when the job cannot execute it."""
        handler = self._COMMANDS.get(type(command))
        if handler is None:
            raise CommandRefused(f"the simulator does not implement {command.KIND}")
        # A node's quarantine or release outlives the attempt that decided it, as at a real
        # launcher's gate (command_roles.OUTLIVE_THEIR_ATTEMPT): one that lands after the
        # restart still takes the node out at the next one. (The simulated restart does not
        # wait for the go-ahead either: it comes after it.)
        lasting = command.attempt < self.attempt and type(command) in OUTLIVE_THEIR_ATTEMPT
        if command.attempt != self.attempt and not lasting and not isinstance(command, InterruptionDecided):
            raise CommandRefused(f"command is for attempt {command.attempt}, the job is at {self.attempt}")
        out: list[Envelope] = []
        detail = handler(self, command, out)
        self.commands_applied += 1
        return CommandResult(detail, out)

    # ================================================================== scheduling
    def _schedule(self, ts: float, kind: str, args: tuple[Any, ...]) -> None:
        heapq.heappush(self._heap, (ts, next(self._seq), kind, args))

    def _event(self, cls: type[Envelope], rank: int, step: int, ts: float, **payload: Any) -> Envelope:
        """An event of the current attempt from `rank` (-1: run-level, no node)."""
        node = self._rank_node[rank] if rank >= 0 else ""
        return self._make(cls, self.attempt, rank, node, step, ts, **payload)

    def _next_discrete(self) -> float:
        t_heap = self._heap[0][0] if self._heap else math.inf
        t_step = self._step_end if self._step_end is not None else math.inf
        return min(t_heap, t_step)

    def _fire_next(self, out: list[Envelope]) -> None:
        t_heap = self._heap[0][0] if self._heap else math.inf
        if self._step_end is not None and self._step_end <= t_heap:
            self._complete_step(self._step_end, out)
            return
        ts, _, kind, args = heapq.heappop(self._heap)
        getattr(self, f"_on_{kind}")(ts, out, *args)

    def _periodic(self, limit: float, inclusive: bool, out: list[Envelope]) -> None:
        """Heartbeats and GPU health due up to `limit`, from live ranks. Discrete events
        at time t come before periodic ones at t, whichever way the caller steps."""
        if not self._live_count:
            return
        make, live, node_of = self._make, self._live, self._rank_node
        a, step, running = self.attempt, self.last_completed, self._step
        beats = self._heartbeats.take(limit, inclusive)
        health = self._health.take(limit, inclusive) if self._health is not None else []
        phase = self._phase_of
        if not health:
            for ts, rank in beats:
                if live[rank]:
                    out.append(make(Heartbeat, a, rank, node_of[rank], step, ts, phase=phase(rank, ts)))
            return
        slow = self._slow_map(self._step, limit)
        merged = heapq.merge(((ts, 0, r) for ts, r in beats), ((ts, 1, r) for ts, r in health))
        for ts, kind, rank in merged:
            if not live[rank]:
                continue
            if kind == 0:
                out.append(make(Heartbeat, a, rank, node_of[rank], step, ts, phase=phase(rank, ts)))
            else:
                reading = gpu_reading(self._health_rng, self._base_temp[rank], slow.get(rank), running)
                out.append(make(GpuHealth, a, rank, node_of[rank], step, ts, **reading.fields()))

    def _phase_of(self, rank: int, ts: float) -> str:
        """What the rank's training loop is doing at `ts` (Heartbeat.phase): a hung rank is
        stuck in its fault's phase; everyone else of a stalled step waits in the all-reduce;
        in a running step a rank computes until its compute time is spent, then waits."""
        hang = self._hang
        if hang is not None and hang[0] == rank:
            return hang[2]
        if self.phase is Phase.TRAINING and ts < self._compute_t0 + self._compute[rank]:
            return "forward"
        return "allreduce"

    # ================================================================== attempts
    def _on_restart(self, ts: float, out: list[Envelope], token: int | None = None) -> None:
        sc = self.scenario
        if token is not None and token != self._restart_token:
            return  # superseded (a decision came before the wait for it ran out)
        if self.phase is Phase.PAUSED:
            return  # paused: nothing restarts until a human relaunches
        if sc.max_restarts is not None and self.attempt >= sc.max_restarts:
            text = f"giving up after {self.attempt} restarts (max_restarts {sc.max_restarts})"
            log.warning("simulated launcher: %s", text)
            self.notes.append(LauncherNote(ts, text))
            self.phase = Phase.FAILED
            return
        world = self._next_world(ts)
        if world is None:
            return  # rescheduled: waiting for a replacement or for the decision
        for index in sorted(self._replace):
            if not self.capacity.arrived(index, ts):
                continue  # still missing: the smaller world runs without it
            spare = self._released.pop(0) if self._released else f"spare-{next(self._spares):04d}"
            self._rack_of[spare] = self._rack_of[self._nodes[index]]  # replaced in the same rack
            self.notes.append(LauncherNote(ts, f"{self._nodes[index]} replaced by {spare}"))
            self._nodes[index] = spare
        self._replace = {i for i in self._replace if not self.capacity.arrived(i, ts)}
        self.attempt += 1
        resume = self._restart_from if self._restart_from is not None else self.last_validated_step
        self._restart_from = None
        self.resumed_from_step = self.last_completed = resume
        if world.size != self._world.size:
            text = f"attempt {self.attempt} trains at {world.size} of {sc.world_size} ranks"
            self.notes.append(LauncherNote(ts, text))
        self._world = world
        self._world_nodes = [self._nodes[i] for i in world.slots]
        per = sc.ranks_per_node
        self._rank_node = [self._world_nodes[r // per] for r in range(world.size)]
        self._live = bytearray(sc.world_size)
        self._live[: world.size] = b"\x01" * world.size
        self._live_count = world.size
        self._hang = None
        self._pending_writes = set()
        self._checkpoint_requested = self._stop_after_checkpoint = self._drain_pending = False
        self._leave_at = None
        self._block_next = 0.0
        # The resumed state was verified as far as its checkpoint says (R6).
        self._watermark = self._verified_of.get(resume, resume)
        self._watermark_frozen = False
        self._self_check_due = []
        self._cross_due = []
        self._ring_due = []
        self._heartbeats.reset(ts)
        if self._health is not None:
            self._health.reset(ts)
        out.append(
            self._event(
                RunStarted,
                -1,
                resume,
                ts,
                world_size=world.size,
                ranks_per_node=sc.ranks_per_node,
                nodes=list(self._world_nodes),
                racks={node: self._rack_of[node] for node in self._world_nodes},
                resumed_from_step=resume,
                config_digest=self.config_digest,
                spares=self.capacity.spares(),
            )
        )
        if resume + 1 >= sc.steps:
            self._finish(ts, out)
        else:
            self._start_step(resume + 1, ts)

    def _next_world(self, ts: float) -> World | None:
        """The world of the attempt starting now: the full one, unless a quarantined node's
        replacement is not in yet (capacity.py): then a smaller one (shrink), or None with
        the restart moved to the replacement's arrival (wait) or to the decision's."""
        missing = self.capacity.missing(self._replace, ts)
        if not missing:
            return self.capacity.full()
        planned = self.capacity.plan(self.attempt, missing, ts)
        if isinstance(planned, World):
            return planned
        self._restart_token += 1
        if planned is None:  # no decision yet: until it comes, or the wait for it runs out
            until = self.capacity.awaiting or ts
            self._schedule(until + self.scenario.decision_wait_s, "restart", (self._restart_token,))
            return None
        text = f"no spare: waiting for the replacement ({planned - ts:,.0f} s), then a restart"
        self.notes.append(LauncherNote(ts, text))
        self._schedule(planned + self.scenario.restart_delay_s, "restart", (self._restart_token,))
        return None

    def _teardown(self, ts: float, out: list[Envelope], restart_at: float | None = None) -> None:
        """Every rank of the attempt has exited: the launcher restarts it."""
        self.phase = Phase.WAITING
        self._step_end = None
        self._fail_pending_writes(ts, out, "the job was torn down before the write completed")
        self._schedule(
            restart_at if restart_at is not None else ts + self.scenario.restart_delay_s, "restart", ()
        )

    def _finish(self, ts: float, out: list[Envelope]) -> None:
        self._exit_all(ts, out, exit_code=0)
        self.phase = Phase.FINISHED
        self._step_end = None

    # ================================================================== steps
    def _start_step(self, step: int, t0: float) -> None:
        sc = self.scenario
        self._step = step
        g, sigma, median = self._rng.gauss, sc.jitter, self._compute_median
        if self._rank_medians is None:
            compute = [median * math.exp(sigma * g(0.0, 1.0)) for _ in range(sc.world_size)]
        else:
            compute = [m * math.exp(sigma * g(0.0, 1.0)) for m in self._rank_medians]
        for rank, (_, factor, _) in self._slow_map(step, t0).items():
            compute[rank] *= factor
        if sc.noise.active:
            apply_noise(compute, sc.noise, self._rng)
        scale = 1.0
        if self._world.size < sc.world_size:  # the same global batch over fewer ranks: the
            scale = sc.world_size / self._world.size  # step W/W' as long, as goodput counts it
            compute = [c * scale for c in compute[: self._world.size]]
        self._compute = compute
        stalled = False
        for index, fault in self._stall_faults:
            if fault.at_step != step:
                continue
            if not self._live[fault.rank] or (index in self._struck and not fault.repeat):
                continue
            if index in self._struck and step in self.skipped_updates:
                continue  # a data fault's batch that a SkipUpdate skipped: it is not read again
            self._struck.add(index)
            stalled = True
            self._record(fault.kind, fault.rank, step, t0)
            if isinstance(fault, CrashFault):
                self._schedule(
                    t0 + _CRASH_POINT * compute[fault.rank], "crash", (self.attempt, fault.rank, index)
                )
            else:
                self._hang = (fault.rank, fault.stack, fault.phase)
        if stalled or self._live_count < self._world.size:
            self._stall(t0)
            return
        comm = self._collective * math.exp(sigma * 0.3 * g(0.0, 1.0)) * scale
        self._compute_t0 = t0 + self._block_next
        self._total = self._block_next + max(compute) + comm
        self._block_next = 0.0
        self._step_end = t0 + self._total
        self.phase = Phase.TRAINING

    def _stall(self, since: float) -> None:
        self.phase = Phase.STALLED
        self._step_end = None
        self._stall_token += 1
        self._schedule(
            since + self.scenario.orphan_restart_after_s, "orphan", (self.attempt, self._stall_token)
        )

    def _complete_step(self, ts: float, out: list[Envelope]) -> None:
        sc = self.scenario
        step, a, make, live = self._step, self.attempt, self._make, self._live
        rng = step_rng(sc.seed, step)
        grad = grad_norm_curve(step, sc.steps) * math.exp(0.1 * rng.gauss(0.0, 1.0))
        mean_loss = loss_curve(step, sc.steps)
        nan_ranks: set[int] = set()
        nan_all = False
        for index, fault in self._data_faults:
            if fault.at_step == step and live[fault.rank]:
                if index in self._struck and not fault.repeat:
                    continue
                self._struck.add(index)
                self._record(fault.kind, fault.rank, step, ts)
                if isinstance(fault, GradSpikeFault):
                    grad *= fault.factor
                    continue
                self._bursts[index] = a
            elif not (
                isinstance(fault, NanFault)
                and fault.at_step < step < fault.at_step + fault.steps
                and self._bursts.get(index) == a
            ):
                continue
            assert isinstance(fault, NanFault)
            nan_ranks.add(fault.rank)
            nan_all = nan_all or fault.all_ranks
        grad_finite = not nan_ranks  # a NaN anywhere poisons the all-reduced gradient
        if nan_ranks:
            grad = math.nan
        total, compute, node_of, g = self._total, self._compute, self._rank_node, rng.gauss
        every_rank, rpn = sc.stats_every_rank, max(1, sc.ranks_per_node)
        for rank in range(self._world.size):
            loss = mean_loss * (1.0 + 0.02 * g(0.0, 1.0))
            if not live[rank]:
                continue
            node = node_of[rank]
            out.append(make(StepTiming, a, rank, node, step, ts, compute_s=compute[rank], total_s=total))
            if nan_all or rank in nan_ranks:
                loss = math.nan
            if not (every_rank or rank % rpn == 0 or math.isnan(loss) or not grad_finite):
                continue  # finite stats: one rank per node reports them (Scenario.stats_every_rank)
            out.append(
                make(
                    StepStats,
                    a,
                    rank,
                    node,
                    step,
                    ts,
                    loss=loss,
                    grad_norm=grad,
                    finite=grad_finite,
                )
            )
        if self._phantoms:
            self._phantom_records(step, ts, out)
        self.last_completed = step
        self.steps_completed += 1
        self.high_water_step = max(self.high_water_step, step)
        self._self_checks(step, ts, out)
        if (step > 0 and step % self.checkpoint_every == 0) or self._checkpoint_requested:
            self._checkpoint_requested = False
            self._block_next = sc.checkpoint_blocking_s
            self._pending_writes.add(step)
            verified = self._watermark if sc.sdc_check_every or self._checks_ever else step
            self._schedule(ts + sc.checkpoint_write_s, "written", (a, step, verified))
            if self._drain_pending and step + 1 < sc.steps:  # the drain's boundary: the ranks
                self._drain_pending, self._stop_after_checkpoint = False, True  # stop here and
                self._leave_at, self._step_end = step, None  # leave once it is written
                return
        if step + 1 >= sc.steps:
            self._finish(ts, out)
        else:
            self._start_step(step + 1, ts)

    # ================================================================== faults and health
    def _phantom_records(self, step: int, ts: float, out: list[Envelope]) -> None:
        """Well-formed telemetry from ranks that do not exist (PhantomRanksFault)."""
        a, make, median = self.attempt, self._make, self._compute_median
        for index, fault in self._phantoms:
            if not fault.active(step):
                continue
            compute = median * fault.slowdown
            for rank in fault.ranks:
                out.append(
                    make(StepTiming, a, rank, fault.node, step, ts, compute_s=compute, total_s=self._total)
                )
                out.append(make(Heartbeat, a, rank, fault.node, step, ts))
                self.phantom_records += 2
            if index not in self._struck:
                self._struck.add(index)
                self.fired.append(FiredFault("phantom_ranks", fault.ranks[0], fault.node, step, a, ts))

    def _record(self, kind: str, rank: int, step: int, ts: float) -> None:
        self.fired.append(FiredFault(kind, rank, self._rank_node[rank], step, self.attempt, ts))

    def _on_original_node(self, rank: int) -> bool:
        """A hardware fault belongs to the rank's original node: a spare is healthy."""
        index = self._world.slots[rank // self.scenario.ranks_per_node]
        return self._nodes[index] == self._original_nodes[index]

    def _slow_map(self, step: int, ts: float) -> dict[int, Slowdown]:
        """rank -> (cause, factor, onset) for the slow faults active at `step` on current hardware."""
        sc = self.scenario
        active = tuple(i for i, f in enumerate(sc.faults) if isinstance(f, SlowFault) and f.active(step))
        key = (self.attempt, active)
        cached = self._slow_cache.get(key)
        if cached is not None:
            return cached
        slow: dict[int, Slowdown] = {}
        rpn = sc.ranks_per_node
        for index in active:
            fault = sc.faults[index]
            assert isinstance(fault, SlowFault)
            world = self._world.size
            if fault.rank is not None:
                ranks = [fault.rank] if fault.rank < world and self._on_original_node(fault.rank) else []
            else:
                node_ids = [
                    i
                    for i, name in enumerate(self._world_nodes)
                    if name == fault.node or (fault.rack is not None and self._rack_of[name] == fault.rack)
                ]
                ranks = [r for i in node_ids for r in range(i * rpn, min((i + 1) * rpn, world))]
            for rank in ranks:
                cause, factor, onset = slow.get(rank, (fault.cause, 1.0, fault.from_step))
                slow[rank] = (cause, factor * fault.factor, onset)
            if ranks and index not in self._struck:
                self._struck.add(index)
                self.fired.append(
                    FiredFault("slow", ranks[0], self._rank_node[ranks[0]], step, self.attempt, ts)
                )
        self._slow_cache[key] = slow
        return slow

    def _self_checks(self, step: int, ts: float, out: list[Envelope]) -> None:
        """The self-checks and cross-rank checks due at `step`, run after it completes."""
        sc = self.scenario
        ranks: set[int] = set()
        if sc.sdc_check_every and step % sc.sdc_check_every == 0:
            ranks.add((step // sc.sdc_check_every) % sc.world_size)
        if self._self_check_due:
            ranks.update(rank for first, rank in self._self_check_due if first <= step)
            self._self_check_due = [item for item in self._self_check_due if item[0] > step]
        if ranks:
            self._run_self_checks(sorted(ranks), step, ts, out)
        if self._cross_due:
            waiting = []
            for item in self._cross_due:
                if item[0] <= step:
                    self._run_cross_rank_check(item[1], item[2], step, ts, out)
                else:
                    waiting.append(item)
            self._cross_due = waiting
        if self._ring_due:
            for first, check_id, offset in self._ring_due:
                if first <= step:
                    self._run_ring_check(check_id, offset, step, ts, out)
            self._ring_due = [item for item in self._ring_due if item[0] > step]

    def _run_self_checks(self, ranks: list[int], step: int, ts: float, out: list[Envelope]) -> None:
        sc = self.scenario
        passed_all, ran = True, False
        for rank in ranks:
            if not self._live[rank]:
                continue
            ran = True
            corrupt = self._corrupt(rank, step, ts)
            first, second = digest(sc.seed, step, rank), digest(sc.seed, step, rank, corrupt)
            batch = f"mb-{step:06d}-r{rank}"
            out.append(
                self._event(
                    SdcSelfCheck,
                    rank,
                    step,
                    ts,
                    microbatch_id=batch,
                    digest_first=first,
                    digest_second=second,
                )
            )
            self.self_checks_run += 1
            passed_all = passed_all and not corrupt
        if not ran:
            return
        self._checks_ever = True
        if not passed_all:
            self._watermark_frozen = True
        elif not self._watermark_frozen:
            self._watermark = step

    def _corrupt(self, rank: int, step: int, ts: float) -> bool:
        """Whether the rank's self-check at `step` sees two different digests: an SDC fault
        from its at_step on, or a bit flip's first check at or after its at_step (once).
        Both are the GPU's: a rank moved to a spare node is clean. A wrong GPU passes."""
        for index, fault in self._gpu_faults:
            if fault.rank != rank or fault.at_step > step or isinstance(fault, WrongGpuFault):
                continue
            if not self._on_original_node(rank):
                continue
            if isinstance(fault, BitFlipFault):
                if index in self._struck:
                    continue
                self._struck.add(index)
                self._record("bitflip", rank, step, ts)
                return True
            if index not in self._struck:
                self._struck.add(index)
                self._record("sdc", rank, step, ts)
            return True
        return False

    def _run_cross_rank_check(
        self, microbatch: str, ranks: tuple[int, ...], step: int, ts: float, out: list[Envelope]
    ) -> None:
        """The ranks compute the same microbatch; each reports its value (R3, seed §7b)."""
        sc = self.scenario
        if not all(self._live[rank] for rank in ranks):
            return
        values = []
        for rank in ranks:
            bias = self._cross_rank_bias(rank, step, ts)
            values.append(cross_rank_value(sc.seed, step, microbatch, rank, sc.cross_rank_noise, bias))
        out.append(
            self._event(
                CrossRankCheck, ranks[0], step, ts, microbatch_id=microbatch, ranks=list(ranks), values=values
            )
        )
        self.cross_rank_checks_run += 1

    def _run_ring_check(self, check_id: str, offset: int, step: int, ts: float, out: list[Envelope]) -> None:
        """Every live rank computes its own microbatch and recomputes its ring neighbour's
        with the same weights (one extra microbatch each); a rank that is not alive sends
        nothing."""
        sc = self.scenario
        n = self._world.size
        for rank in range(n):
            if not self._live[rank]:
                continue
            peer = (rank + offset) % n
            bias = self._cross_rank_bias(rank, step, ts)
            own = cross_rank_value(sc.seed, step, f"{check_id}/r{rank}", rank, sc.cross_rank_noise, bias)
            theirs = cross_rank_value(sc.seed, step, f"{check_id}/r{peer}", rank, sc.cross_rank_noise, bias)
            out.append(
                self._event(
                    RingCheck,
                    rank,
                    step,
                    ts,
                    check_id=check_id,
                    own_value=own,
                    peer_rank=peer,
                    peer_value=theirs,
                )
            )
        self.ring_checks_run += 1

    def _cross_rank_bias(self, rank: int, step: int, ts: float) -> float:
        """Relative error of the rank's cross-rank value: a wrong GPU's bias, or an SDC
        fault's random error; 0 on good hardware (and on a spare)."""
        bias = 0.0
        for index, fault in self._gpu_faults:
            if fault.rank != rank or fault.at_step > step or isinstance(fault, BitFlipFault):
                continue
            if not self._on_original_node(rank):
                continue
            if isinstance(fault, WrongGpuFault):
                if index not in self._struck:
                    self._struck.add(index)
                    self._record("wrong_gpu", rank, step, ts)
                bias += fault.bias
            else:
                wobble = random.Random(f"trainguard-sim-sdc:{self.scenario.seed}:{step}:{rank}").gauss(0, 1)
                bias += _SDC_CROSS_RANK_ERROR * (1.0 + abs(wobble))
        return bias

    # ================================================================== timed items
    def _on_crash(self, ts: float, out: list[Envelope], attempt: int, rank: int, index: int) -> None:
        if attempt != self.attempt or not self._live[rank]:
            return
        fault = self.scenario.faults[index]
        assert isinstance(fault, CrashFault)
        self._exit(rank, ts, out, exit_code=fault.effective_exit_code, signal=fault.signal)
        self._fail_pending_writes(ts, out, f"rank {rank} died before its shard was durable")
        if not self._live_count:
            self._teardown(ts, out)

    def _on_orphan(self, ts: float, out: list[Envelope], attempt: int, token: int) -> None:
        if attempt != self.attempt or token != self._stall_token or self.phase is not Phase.STALLED:
            return
        text = (
            f"attempt {attempt} made no progress for {self.scenario.orphan_restart_after_s:g}s and no "
            f"command came: collective timeout, {self._live_count} ranks killed, restarting"
        )
        log.warning("simulated launcher: %s", text)
        self.notes.append(LauncherNote(ts, text))
        self._exit_all(ts, out, exit_code=-SIGABRT, signal=SIGABRT)
        self._teardown(ts, out)

    def _on_arrival(self, ts: float, out: list[Envelope], index: int) -> None:
        """A quarantined node's replacement is in: a smaller world grows back at the next
        checkpoint once nothing is missing (a waiting restart was scheduled for it)."""
        self.notes.append(LauncherNote(ts, f"the replacement for {self._nodes[index]} arrived"))
        shrunk = self._world.size < self.scenario.world_size
        if shrunk and self.phase is Phase.TRAINING and not self.capacity.missing(self._replace, ts):
            self._stop_after_checkpoint = True
            self.notes.append(LauncherNote(ts, "every replacement is in: grow back at the next checkpoint"))

    def _on_written(self, ts: float, out: list[Envelope], attempt: int, step: int, verified: int) -> None:
        if attempt != self.attempt or step not in self._pending_writes:
            return  # failed (and reported) when its attempt was torn down
        self._pending_writes.discard(step)
        sc = self.scenario
        uri = self._uri(step)
        out.append(
            self._event(
                CheckpointWritten,
                0,
                step,
                ts,
                checkpoint_step=step,
                uri=uri,
                shards=self._world.size,
                digest=hashlib.sha256(f"{self.run_id}:{step}".encode()).hexdigest()[:32],
                bytes=self._world.size * _SHARD_BYTES,
                blocking_s=sc.checkpoint_blocking_s,
                write_s=sc.checkpoint_write_s,
            )
        )
        self._schedule(ts + sc.checkpoint_validate_s, "validated", (attempt, step, uri, verified))
        if self._stop_after_checkpoint and self._leave_at in (None, step):
            self._stop_after_checkpoint, self._leave_at = False, None
            self.notes.append(LauncherNote(ts, f"planned stop at checkpoint {step} to replace nodes"))
            self._exit_all(ts, out, exit_code=-SIGTERM, signal=SIGTERM, requested=True)
            self._restart_from = step
            self._teardown(ts, out, restart_at=ts + sc.checkpoint_validate_s + sc.restart_delay_s)

    def _on_validated(
        self, ts: float, out: list[Envelope], attempt: int, step: int, uri: str, verified: int
    ) -> None:
        """The validator runs outside the job, so validation completes even after a teardown."""
        self.validated[step] = uri
        self._verified_of[step] = verified
        self.last_validated_step = max(self.last_validated_step, step)
        fields = {"checkpoint_step": step, "uri": uri, "last_verified_step": verified}
        out.append(self._make(CheckpointValidated, attempt, -1, "", step, ts, **fields))

    def _fail_pending_writes(self, ts: float, out: list[Envelope], error: str) -> None:
        for step in sorted(self._pending_writes):
            fields = {"checkpoint_step": step, "uri": self._uri(step), "error": error}
            out.append(self._event(CheckpointFailed, -1, step, ts, **fields))
        self._pending_writes.clear()

    def _uri(self, step: int) -> str:
        return f"sim://{self.run_id}/step-{step:06d}"

    # ================================================================== exits
    def _exit(self, rank: int, ts: float, out: list[Envelope], **fields: Any) -> None:
        self._live[rank] = 0
        self._live_count -= 1
        out.append(self._event(RankExit, rank, self.last_completed, ts, **fields))

    def _exit_all(self, ts: float, out: list[Envelope], **fields: Any) -> None:
        for rank in range(self.scenario.world_size):
            if self._live[rank]:
                self._exit(rank, ts, out, **fields)

    # ================================================================== commands
    def _abort(self, command: Abort, out: list[Envelope]) -> str:
        if self.phase in (Phase.WAITING, Phase.FINISHED, Phase.FAILED):
            return f"nothing to abort: attempt {self.attempt} is {self.phase}"
        ts, targets = (
            self.now,
            [r for r in range(self.scenario.world_size) if self._live[r] and command.targets(r)],
        )
        for rank in targets:
            stack = ref = ""
            if command.stack_dump:
                stack = (
                    self._hang[1] if self._hang is not None and self._hang[0] == rank else COLLECTIVE_STACK
                )
                ref = f"sim://{self.run_id}/attempt-{self.attempt}/stacks/rank-{rank:05d}.txt"
            self._exit(
                rank,
                ts,
                out,
                exit_code=-SIGTERM,
                signal=SIGTERM,
                requested=True,
                stack_dump_ref=ref,
                stack_signature=stack,
            )
        if not self._live_count:
            self._teardown(ts, out)
            resume = self._restart_from if self._restart_from is not None else self.last_validated_step
            delay = self.scenario.restart_delay_s
            return f"aborted {len(targets)} ranks; restarting in {delay:g}s from step {resume}"
        if self.phase is Phase.TRAINING and targets:
            self._stall(ts)
        return f"aborted {len(targets)} ranks; {self._live_count} still alive"

    def _checkpoint_now(self, command: CheckpointNow, out: list[Envelope]) -> str:
        self._checkpoint_requested = True
        return f"checkpoint after step {self._step}"

    def _set_interval(self, command: SetCheckpointInterval, out: list[Envelope]) -> str:
        self.checkpoint_every = max(1, round(command.interval_s / self.scenario.step_time_s))
        return f"checkpoint every {self.checkpoint_every} steps"

    def _quarantine(self, command: QuarantineNode, out: list[Envelope]) -> str:
        if command.node not in self._nodes:
            raise CommandRefused(f"node {command.node} is not part of the job")
        index = self._nodes.index(command.node)
        self._replace.add(index)
        arrival = self.capacity.lost(index, self.now)
        if arrival is None:
            return f"{command.node} leaves the pool at the next restart"
        self._schedule(arrival, "arrival", (index,))
        return f"{command.node} leaves the pool; no spare: a replacement in {arrival - self.now:,.0f} s"

    def _evict(self, command: EvictRank, out: list[Envelope]) -> str:
        if not 0 <= command.rank < self._world.size:
            raise CommandRefused(f"rank {command.rank} is outside world size {self._world.size}")
        self._replace.add(self._world.slots[command.rank // self.scenario.ranks_per_node])
        self._stop_after_checkpoint = True
        return f"rank {command.rank} ({self.node_of(command.rank)}) replaced at the next checkpoint"

    def _drain(self, command: DrainNode, out: list[Envelope]) -> str:
        """Take a node out before it fails (issue 46) at the next checkpoint boundary: the
        checkpoint the cadence makes due, or one taken at the first step `within_s` after
        the command, whichever comes first. The ranks stop at that step and leave once its
        checkpoint is written (as real ranks wait for its validation); the node is replaced
        as a quarantined one is (a spare at hand, or the replacement's arrival and the
        capacity decision: capacity.py), and the next attempt resumes from exactly that
        step: no step lost. Refused for a node the job never had, or one already out."""
        node = command.node
        if node not in self._rack_of:
            raise CommandRefused(f"node {node} is not part of the job")
        index = self._nodes.index(node) if node in self._nodes else -1
        if node not in self._world_nodes or index in self._replace:
            raise CommandRefused(f"node {node} is already out of the job")
        self._replace.add(index)
        arrival = self.capacity.lost(index, self.now)
        if arrival is not None:
            self._schedule(arrival, "arrival", (index,))
        if self.phase is not Phase.TRAINING:
            return f"{node} leaves the job at the next restart (attempt {self.attempt} is {self.phase})"
        self._drain_pending = True
        self._schedule(self.now + command.within_s, "drain_due", (self.attempt,))
        within = f"{command.within_s:g}s"
        return f"{node} drains at the next checkpoint boundary (the cadence's, or one within {within})"

    def _on_drain_due(self, ts: float, out: list[Envelope], attempt: int) -> None:
        """The drain's `within_s` passed before the cadence's checkpoint: one at the next step."""
        if attempt == self.attempt and self._drain_pending:
            self._checkpoint_requested = True

    def _resume(self, command: ResumeFrom | Rollback, out: list[Envelope]) -> str:
        if command.checkpoint_step not in self.validated:
            raise CommandRefused(f"no validated checkpoint at step {command.checkpoint_step}")
        self._restart_from = command.checkpoint_step
        if self._live_count:
            self._exit_all(self.now, out, exit_code=-SIGTERM, signal=SIGTERM, requested=True)
            self._teardown(self.now, out)
        elif self.phase in (Phase.FINISHED, Phase.FAILED):
            self._teardown(self.now, out)
        return f"restarting from checkpoint {command.checkpoint_step}"

    def _self_check(self, command: RunSelfCheck, out: list[Envelope]) -> str:
        self._training_or_refuse(command)
        n = self._world.size
        ranks = range(n) if command.ranks is None else sorted(set(command.ranks))
        if any(not 0 <= rank < n for rank in ranks):
            raise CommandRefused(f"self-check ranks {list(ranks)} are outside world size {n}")
        first = max(command.step, self.last_completed + 1)
        self._self_check_due += [(first, rank) for rank in ranks]
        return f"{len(ranks)} ranks self-check at the first step >= {first}"

    def _cross_rank_check(self, command: RunCrossRankCheck, out: list[Envelope]) -> str:
        self._training_or_refuse(command)
        n = self._world.size
        ranks = command.ranks
        if ranks is None or not 2 <= len(ranks) <= 3 or len(set(ranks)) != len(ranks):
            raise CommandRefused(f"a cross-rank check needs 2 or 3 distinct ranks, got {ranks}")
        if any(not 0 <= rank < n for rank in ranks):
            raise CommandRefused(f"cross-rank check ranks {ranks} are outside world size {n}")
        first = max(command.step, self.last_completed + 1)
        self._cross_due.append((first, command.microbatch_id, tuple(ranks)))
        return f"ranks {ranks} cross-check {command.microbatch_id} at the first step >= {first}"

    def _ring_check(self, command: RunRingCheck, out: list[Envelope]) -> str:
        self._training_or_refuse(command)
        n = self._world.size
        if n < 2 or command.offset % n == 0:
            raise CommandRefused(f"a ring check needs 2+ ranks and an offset not a multiple of {n}")
        first = max(command.step, self.last_completed + 1)
        self._ring_due.append((first, command.check_id, command.offset))
        return f"every rank recomputes rank (r + {command.offset}) mod {n}'s microbatch at step >= {first}"

    def _training_or_refuse(self, command: Command) -> None:
        if self.phase is not Phase.TRAINING:
            raise CommandRefused(f"no step will run: attempt {self.attempt} is {self.phase}")

    def _node_self_test(self, command: RunNodeSelfTest, out: list[Envelope]) -> str:
        """A short test with known answers on the node's GPUs (seed §SDC (c)). GEMM fails on
        a GPU the scenario made compute wrong answers (an SDC fault or a deterministically
        wrong GPU, once the run has reached its at_step); the collective passes (the
        simulator corrupts no reduction). Healthy hardware passes, and so do a GPU whose bit
        flip was transient and a node whose trouble was in the data (NaN, grad spike). The
        node may already have left the pool (quarantined, replaced): that is when the test
        runs. A node the run never had is refused."""
        unknown = [test for test in command.tests if test not in _SELF_TESTS]
        if unknown:
            raise CommandRefused(f"no {', '.join(unknown)} self-test here (known: {', '.join(_SELF_TESTS)})")
        node = command.node
        if node not in self._rack_of:  # every node the run ever had: originals and spares
            raise CommandRefused(f"node {node} is not part of the job")
        reached = max(self.high_water_step, self._step)
        rpn = self.scenario.ranks_per_node
        wrong = sorted(
            fault.rank
            for _, fault in self._gpu_faults
            if isinstance(fault, SdcFault | WrongGpuFault)
            and fault.at_step <= reached
            and self._original_nodes[fault.rank // rpn] == node
        )
        failed = ["gemm"] if wrong and "gemm" in command.tests else []
        passed = [test for test in command.tests if test not in failed]
        self.node_self_tests.append((node, not failed))
        if not failed:
            detail = f"node {node} passed {', '.join(passed)} self-test{'s' if len(passed) > 1 else ''}"
        else:
            ranks = ", ".join(map(str, wrong))
            rest = f"; {', '.join(passed)} passed" if passed else ""
            detail = f"node {node} failed gemm self-test: wrong answer on rank {ranks}{rest}"
        # The same result record the launcher reports on real hardware (the core reads it).
        code = ReasonCode.NODE_SELF_TEST_FAILED if failed else ReasonCode.NODE_SELF_TEST_PASSED
        result = dict(
            passed=not failed,
            tests=list(command.tests),
            failed_tests=failed,
            purpose="quarantine",
            command_id=command.command_id,
            devices=self.scenario.ranks_per_node,
            wall_s=0.0,
            reason=Reason(code=code, text=detail),
        )
        out.append(self._make(NodeSelfTestResult, self.attempt, -1, node, NO_STEP, self.now, **result))
        return detail

    def _pause(self, command: PauseRun, out: list[Envelope]) -> str:
        """Stop restarting (a step that fails on every node): the ranks still alive exit,
        nothing restarts, and the run ends paused with the command's reason."""
        if self.phase in (Phase.FINISHED, Phase.FAILED, Phase.PAUSED):
            return f"nothing to pause: the run is {self.phase}"
        ended = self._live_count
        if ended:
            self._exit_all(self.now, out, exit_code=-SIGTERM, signal=SIGTERM, requested=True)
        self._fail_pending_writes(self.now, out, "the run was paused before the write completed")
        self.phase, self._step_end, self.paused = Phase.PAUSED, None, command.reason.text
        text = f"paused at step {command.step}: {command.reason.text}"
        self.notes.append(LauncherNote(self.now, text))
        stopped = f"run paused after attempt {self.attempt} ({ended} ranks stopped)"
        return f"{stopped}; no restart: {command.reason.text}"

    def _release(self, command: ReleaseNode, out: list[Envelope]) -> str:
        """A quarantined node returns to the pool: a quarantine not yet carried out is
        undone (the node stays in the job); one already carried out makes the node the
        next replacement's, before any new spare."""
        node = command.node
        if node not in self._rack_of:
            raise CommandRefused(f"node {node} is not part of the job")
        if node in self._nodes:
            index = self._nodes.index(node)
            if index not in self._replace:
                return f"{node} is in the job and not quarantined: nothing to release"
            self._replace.discard(index)
            return f"{node} stays in the job: its quarantine is lifted before the restart"
        if node not in self._released:
            self._released.append(node)
        return f"{node} is back in the pool (the next replacement takes it)"

    def _skip(self, command: SkipUpdate, out: list[Envelope]) -> str:
        self.skipped_updates.append(command.step)
        n = len(self.skipped_updates)
        return f"update of step {command.step} skipped ({n} skipped so far; no effect on telemetry)"

    def _decided(self, command: InterruptionDecided, out: list[Envelope]) -> str:
        """The go-ahead; with a capacity decision, what the restart does if a replacement is
        missing: a restart waiting for it runs now (capacity.py)."""
        if command.capacity is None:
            return f"interruption {command.interruption_id} decided (the simulated restart does not wait)"
        self.capacity.decisions[command.attempt] = (command.capacity, command.world_size)
        if self.capacity.awaiting is not None and command.attempt == self.attempt:
            self._restart_token += 1
            self._schedule(self.now, "restart", (self._restart_token,))
        world = f" at {command.world_size} ranks" if command.world_size else ""
        return f"interruption {command.interruption_id} decided: {command.capacity}{world} if one is missing"

    _COMMANDS: dict[type[Command], Callable[[SimulatedCluster, Any, list[Envelope]], str]] = {
        Abort: _abort,
        CheckpointNow: _checkpoint_now,
        SetCheckpointInterval: _set_interval,
        QuarantineNode: _quarantine,
        EvictRank: _evict,
        DrainNode: _drain,
        ResumeFrom: _resume,
        Rollback: _resume,
        RunSelfCheck: _self_check,
        RunCrossRankCheck: _cross_rank_check,
        RunRingCheck: _ring_check,
        RunNodeSelfTest: _node_self_test,
        SkipUpdate: _skip,
        PauseRun: _pause,
        ReleaseNode: _release,
        InterruptionDecided: _decided,
    }
