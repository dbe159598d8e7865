"""`trainguard launch`: starts N rank processes, supervises them, executes restart and
quarantine decisions, and measures every restart phase by phase.

Built on torch elastic where it fits
------------------------------------
The rank processes are started, watched and torn down by torch elastic's process layer,
:func:`torch.distributed.elastic.multiprocessing.start_processes` (the ``PContext`` that
``LocalElasticAgent`` and therefore ``torchrun`` use): one process per rank in its own
session, per-rank environments, ``close(SIGTERM)`` that escalates to SIGKILL for
stragglers and gives up on an unkillable (D-state) process instead of wedging. The
ranks see torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID,
TORCHELASTIC_RESTART_COUNT), so a script written for torchrun runs unchanged.

The restart loop is ours, not the elastic agent's. ``elastic_launch`` /
``LocalElasticAgent`` restart a failed worker group ``max_restarts`` times with the same
spec on the same host, and their rendezvous assigns ranks by arrival. Here every restart
is a decision with inputs the agent does not have: the placement changes (a quarantined
node's ranks move to a spare), the environment changes (TRAINGUARD_NODE, the attempt,
TRAINGUARD_RESUME_STEP chosen from the VALIDATED checkpoints or named by a Rollback),
and signed commands arriving on another thread (Abort, EvictRank, Rollback...) must stop
the group; ``elastic_launch`` blocks its caller and handles signals only in the main
thread. So: one ``start_processes`` group per attempt, and this module decides, between
attempts, placement, environment and resume step. (Not done: replacing one rank in
place without tearing down the world, seed §6 (3).)

Crash policy
------------
A rank that ends on its own with a non-zero status (SIGKILL, an exception) ends the
attempt: a synchronous job cannot continue, so the launcher tears the group down at
once. It then waits ``decision_wait_s`` for the processor's decisions about the crashed
attempt (a QuarantineNode decided from our RankExit must arrive while the actuator
still accepts that attempt's commands) and restarts on its own, from the newest
validated checkpoint, without waiting for an Abort. So the run keeps going when the
processor is down, and the processor's quarantine still shapes the next placement when
it is up. ``max_restarts`` bounds the restarts of a run (any cause, torchrun's meaning).

Resume selection never loops (issue 15). The resume step is the newest checkpoint with a
VALIDATED marker and no REJECTED one. The ranks verify the named checkpoint before they
load it (producers/checkpoint/manager.py); one that fails is marked REJECTED and the attempt
resumes from the newest validated one older than it, so the next attempt's choice, read
from the same markers, never names it again. When every checkpoint was rejected the run
stops with status "failed" and a message that says so, unless ``restart_from_scratch``.

Lost work is exact: every rank's Supervisor rewrites ``attempt-N/rank-R.progress`` (its
newest completed step, path in TRAINGUARD_PROGRESS_FILE) after each step, and each
RankExit carries the rank's own step and ``job_step``, the newest step any rank of the
attempt had completed when the exit was seen.

Commands (executed on the actuator thread; they only set requests the loop reads):

- Abort: the ranks dump their stacks and exit themselves (their own actuators); the
  launcher waits ``grace_s`` for the group to end, then SIGTERM, then SIGKILL; restart.
- QuarantineNode: the node leaves the pool; takes effect at the next restart.
- EvictRank: quarantines the rank's node and restarts at the next checkpoint boundary:
  as soon as a checkpoint newer than the newest one at the command is VALIDATED.
- Rollback / ResumeFrom: stop the group now and restart from the named checkpoint step
  (it must carry a VALIDATED marker). After a rollback to S, the checkpoints newer than S
  validated before the rollback (the suspect lineage) are never chosen again.
- PauseRun: the run fails at one step on every node (data or code): stop the group if one
  is running, restart nothing, and end with status "paused" and the command's reason
  (`trainguard launch` exits 75, EX_TEMPFAIL: fix the data or code, then relaunch; a
  relaunch on the same run dir after a clean paused end starts again).
- ReleaseNode: a quarantined node returns to the pool (its failure was the run's, not
  the node's); the next placement may use it again. Refused for a node that failed its
  self-test: it stays out for the run.
- RunNodeSelfTest: the node's known-answer self-test (:mod:`.node_selftest`) runs once the
  node's ranks have left it (:mod:`.spare_selftest`), in the background; its result
  goes out as NodeSelfTestResult; a node that fails is quarantined and stays out.
  Spares are tested the same way before they join (``self_test_spares``): on demand,
  from the moment a quarantine makes a spare the next placement's (overlapping the rest
  of the attempt, its teardown and the decision wait), or ahead of need, one at a time
  from the start of the run; a restart that needs a spare not yet tested waits for its
  test; a spare that fails is quarantined and the placement made again.
- SkipUpdate (the policy's alternative to PauseRun, ``paging.on_repeat_step: skip``): the
  step's batch is skipped by every later attempt (TRAINGUARD_SKIP_BATCHES, read by the
  Supervisor's ``steps()``); the running ranks skip that step's update themselves.
- SetCheckpointInterval: the running ranks follow it themselves; the launcher journals it
  and every later attempt starts with it (TRAINGUARD_CHECKPOINT_INTERVAL_S, read by the
  Supervisor), so a restart never falls back to an older interval: the command carries
  the attempt it was sent to, and a later attempt's ranks refuse it.

Every exit after an Abort, or during the launcher's own teardown, is reported
``requested=True``.

Relaunch after a kill (issue 7, scenario 5)
-------------------------------------------
Every action is journaled, fsynced, before it takes effect, in
``<run_dir>/launcher.actions.jsonl`` (:mod:`.journal`): each executed command
under its command_id (before its ack), each interruption under its key (the command id,
else ``<cause>:<attempt>``) before the teardown, each attempt's intent, its pids once
spawned, its end. ``trainguard launch`` started again on the same run dir after a
SIGKILL reads it back and finishes the action in flight instead of repeating it: it
ends the ranks the dead launcher left running (journaled pids, and any process whose
environment names this run dir), keeps its quarantines and rollback barriers, gives the
interrupted attempt's unacked commands ``decision_wait_s`` to be redelivered, completes
the journaled interruption (or acts once on an Abort/Rollback the dead one had accepted,
or records its death as an interruption of cause ``launcher`` when its ranks were running),
spawns an attempt that was journaled but never spawned under its own number, and writes
each interruption to restarts.jsonl once. A command its actuator claimed but that the
launcher never recorded (death in between) was not executed and runs once when
redelivered (:func:`make_actuator`). The restart budget counts across relaunches until a
clean end. ``TRAINGUARD_LAUNCHER_FAULT`` (:data:`FAULT_POINTS`) kills the launcher at a
named point, for the tests (``tests/producers/launcher/test_launcher_restart.py``).

Restart phases
--------------
Per interruption (see :class:`RestartPhases`): detect (fault to the launcher noticing:
the last poll that saw the rank alive to the poll that saw it gone, for a crash; the
command's issued_ts to its arrival, for a command), reschedule (noticing to the new
processes being spawned: teardown, decision wait, placement), and from the per-rank
file ``<run_dir>/attempt-N/rank-R.phases.json`` written by the rank-side Supervisor
(path in TRAINGUARD_PHASES_FILE): process start (spawn to the slowest rank's
``start_ts``), checkpoint load and process-group init (slowest rank's
``checkpoint_load_s`` / ``pg_init_s``), first step (the slowest rank's
``first_step_ts − start_ts − load − init``) and ``restart_s`` (fault to the last rank's
first step: the R of seed §6). Records go to ``<run_dir>/restarts.jsonl`` and
:attr:`LaunchResult.restarts`. The same file may carry ``last_step``,
``stack_dump_ref`` and ``stack_signature``, which the launcher copies into RankExit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ...schemas import (
    NO_STEP,
    RUN_LEVEL_RANK,
    Abort,
    Command,
    Envelope,
    EvictRank,
    NodeSelfTestResult,
    PauseRun,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    ReleaseNode,
    ResumeFrom,
    Rollback,
    RunNodeSelfTest,
    RunStarted,
    SetCheckpointInterval,
    SkipUpdate,
)
from ...schemas import RestartPhases as RestartPhasesEvent
from ..rank.agent import EventSink  # a TelemetryShipper satisfies EventSink
from .checkpoints import rejected_steps, validated_steps
from .config import LauncherConfig, free_port
from .journal import (
    JOURNAL_NAME,
    ActionJournal,
    AttemptRecord,
    JournalState,
    last_interval,
    rank_processes,
    replay,
)
from .journal import terminate as terminate_orphans
from .node_selftest import SELF_TESTS, NodeSelfTestReport, run_node_self_test
from .plan import NodePool, Placement, PoolExhausted, make_pool, plan
from .rank_env import rank_env
from .records import (
    LaunchResult,
    RankEnd,
    RestartCause,
    RestartPhases,
    collect_phases,
    phases_path,
    progress_path,
    read_json,
    read_progress,
    restart_indices,
)
from .spare_selftest import NodeTester, Runner

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- launcher


@dataclass
class _Request:
    cause: RestartCause
    command_id: str
    issued_ts: float
    received_ts: float
    detail: str
    resume_step: int | None = None
    evict_after_step: int | None = None


def _request_of(data: dict[str, Any]) -> _Request:
    """A journaled request back (journal.py's ``command`` record)."""
    known = {f.name for f in dataclasses.fields(_Request)}
    fields = {k: v for k, v in data.items() if k in known}
    return _Request(**{**fields, "cause": RestartCause(fields["cause"])})


class Launcher:
    """Runs one training run: attempts of `config.nproc` rank processes until the run
    ends (all ranks exit 0), fails (max_restarts, pool exhausted) or is stopped."""

    def __init__(
        self,
        config: LauncherConfig,
        sink: EventSink,
        pool: NodePool | None = None,
        clock: Callable[[], float] = time.time,
        self_test: Runner | None = None,
    ) -> None:
        if config.nproc < 1 or config.ranks_per_node < 1 or not config.command:
            raise ValueError("nproc >= 1, ranks_per_node >= 1 and a command are required")
        self.config = config
        self.sink = sink
        self.pool = pool or make_pool(
            config.nproc, config.ranks_per_node, config.spares, config.nodes_per_rack
        )
        self.clock = clock
        self.run_dir = config.resolved_run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        #: What this launcher did, and what a predecessor killed mid-action left (module docs
        #: of journal.py): the quarantines and rollbacks of the run survive a relaunch.
        self.journal = ActionJournal(self.run_dir / JOURNAL_NAME)
        self._state: JournalState = replay(self.journal.records)
        state = self._state
        self.quarantined: set[str] = set(state.quarantined)
        self.placement: Placement | None = None
        #: Executed commands by command_id (the journal's records): never executed twice.
        self._commands: dict[str, dict[str, Any]] = dict(state.commands)
        self._taken: set[str] = set(state.taken)
        last = state.last
        #: The predecessor died with `last` in flight, or between it and the next attempt.
        self._resuming = last is not None and not state.clean and last.ended in (None, "restart", "lost")
        # A relaunched launcher continues the attempt numbering (attempt dirs are kept). While
        # it recovers, the interrupted attempt's commands are still the ones accepted.
        dirs = [int(p.name[8:]) for p in self.run_dir.glob("attempt-*") if p.name[8:].isdigit()]
        if last is not None and self._resuming:
            self.attempt = last.attempt
        else:
            self.attempt = 1 + max([*dirs, *state.attempts], default=-1)
        self.on_attempt: Callable[[int], None] | None = None  # e.g. actuator.set_attempt
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._request: _Request | None = None
        self._evict: _Request | None = None
        self._forced_resume: int | None = None
        #: Steps whose batch every later attempt skips (SkipUpdate, journaled).
        self.skip_batches: set[int] = set(state.skip_batches)
        #: The last checkpoint interval the run was sent (SetCheckpointInterval, journaled).
        self.checkpoint_interval_s: float | None = last_interval(state.commands.values())
        #: A PauseRun in force (its journal record): no attempt starts while it is set.
        self._pause: dict[str, Any] | None = state.paused
        #: (step S, ts): checkpoints newer than S validated before ts are excluded (rollbacks).
        self._rollbacks: list[tuple[int, float]] = list(state.rollbacks)
        # Event ids are deterministic per run dir (attempt, rank, interruption), so that a
        # successor's re-report of the same exit or restart is a duplicate consumers drop.
        self._id_prefix = hashlib.sha256(self.journal.nonce.encode()).hexdigest()[:16]
        self._restarts_file = self.run_dir / "restarts.jsonl"
        self._recorded = restart_indices(self._restarts_file)  # interruptions in restarts.jsonl
        self._published: set[int] = set()
        self._interruptions = max(
            max(state.interruptions, default=-1) + 1, max(self._recorded, default=-1) + 1
        )
        self._ended = threading.Event()  # the run is over: every node is free for its self-test
        #: Nodes with live ranks of the running attempt (none between attempts).
        self._busy: frozenset[str] = frozenset()
        self.tester = NodeTester(
            self_test or self._run_self_test,
            config.ranks_per_node,
            self._report_self_test,
            self._failed_self_test,
        )

    # ------------------------------------------------------------------ control (any thread)
    def stop(self) -> None:
        """Tear the group down (exits reported requested) and end with status "stopped"."""
        self._stop.set()

    # Each handler journals its command (keyed by command_id) under the lock BEFORE applying
    # the effect and before the ack: a launcher killed after the record has executed it (its
    # successor applies the record), one killed before has not (its successor runs it).
    def handle_abort(self, command: Abort, rank: int) -> str:
        with self._lock:
            if self._request is not None:
                detail = f"attempt {self.attempt} is already stopping ({self._request.cause})"
                self._record(command, detail)
                return detail
            request = _Request(
                RestartCause.ABORT, command.command_id, command.issued_ts, self.clock(), command.reason.text
            )
            detail = (
                f"attempt {self.attempt}: ranks get {self.config.grace_s:g}s to exit, then the group restarts"
            )
            self._record(command, detail, request=request)
            self._request = request
        return detail

    def handle_quarantine(self, command: QuarantineNode, rank: int) -> str:
        return self.quarantine(command.node, command)

    def quarantine(self, node: str, command: QuarantineNode | None = None) -> str:
        if node not in self.pool.nodes:
            raise ValueError(f"node {node} is not in the pool")
        with self._lock:
            detail = self._quarantine_detail(node)
            self._record(command, detail, quarantine=node)
            self.quarantined.add(node)
        self._prestart_spares()
        return detail

    def _quarantine_detail(self, node: str) -> str:
        """Under the lock: what taking `node` out of the pool will do at the next restart."""
        try:
            nxt = plan(self.pool, self.quarantined | {node}, self.config.nproc, self.placement)
        except PoolExhausted as exc:
            return f"{node} left the pool; the next restart will fail: {exc}"
        moved = ", ".join(f"{old}->{new}" for old, new in nxt.moved.values()) or "no rank moves"
        return f"{node} leaves the pool at the next restart ({moved})"

    def handle_evict(self, command: EvictRank, rank: int) -> str:
        placement = self.placement
        if placement is None or not 0 <= command.rank < self.config.nproc:
            raise ValueError(f"rank {command.rank} is not part of the job")
        node = placement.node_of(command.rank)
        newest = max(self._eligible(), default=-1)
        with self._lock:
            detail = (
                f"rank {command.rank}: {self._quarantine_detail(node)}; "
                f"restart once a checkpoint after step {newest} is validated"
            )
            # One record for both effects: a relaunch restarts anyway, so only the
            # quarantine needs to survive one.
            self._record(command, detail, quarantine=node)
            self.quarantined.add(node)
            self._evict = _Request(
                RestartCause.EVICTION,
                command.command_id,
                command.issued_ts,
                self.clock(),
                f"evict rank {command.rank} ({node})",
                evict_after_step=newest,
            )
        self._prestart_spares()
        return detail

    def handle_resume(self, command: Rollback | ResumeFrom, rank: int) -> str:
        step = command.checkpoint_step
        if step not in self._eligible(ignore_rollbacks=True):
            raise ValueError(f"no validated checkpoint at step {step} in {self.config.checkpoint_dir}")
        cause = RestartCause.ROLLBACK if isinstance(command, Rollback) else RestartCause.RESUME
        with self._lock:
            request = _Request(
                cause, command.command_id, command.issued_ts, self.clock(), command.reason.text, step
            )
            detail = f"stopping attempt {self.attempt}; restarting from checkpoint {step}"
            self._record(command, detail, request=request)
            self._request = request
        return detail

    def handle_pause(self, command: PauseRun, rank: int) -> str:
        with self._lock:
            running = self.placement is not None and self._pause is None
            detail = (
                f"run paused at step {command.step}: "
                + (f"attempt {self.attempt} stops and " if running else "")
                + f"nothing restarts until a human relaunches ({command.reason.text[:300]})"
            )
            self._record(command, detail, pause={"step": command.step, "reason": command.reason.text})
            self._pause = self._commands[command.command_id]
        return detail

    def handle_skip(self, command: SkipUpdate, rank: int) -> str:
        with self._lock:
            detail = f"the batch of step {command.step} is skipped from the next attempt on"
            self._record(command, detail, skip=command.step)
            self.skip_batches.add(command.step)
        return detail

    def handle_release(self, command: ReleaseNode, rank: int) -> str:
        node = command.node
        if node not in self.pool.nodes:
            raise ValueError(f"node {node} is not in the pool")
        failed = self.tester.failed.get(node)
        if failed is not None:
            raise ValueError(f"{node} stays out of the pool: it failed its self-test ({failed[:500]})")
        with self._lock:
            if node not in self.quarantined:
                detail = f"{node} is not quarantined: nothing to release"
            else:
                detail = f"{node} is back in the pool from the next restart on"
            self._record(command, detail, release=node)
            self.quarantined.discard(node)
        return detail

    def handle_self_test(self, command: RunNodeSelfTest, rank: int) -> str:
        node = command.node
        if node not in self.pool.nodes:
            raise ValueError(f"node {node} is not in the pool")
        unknown = [t for t in command.tests if t not in SELF_TESTS]
        if unknown:
            raise ValueError(f"no {', '.join(unknown)} self-test here (known: {', '.join(SELF_TESTS)})")
        with self._lock:
            when = "now" if self._free(node) else "once its ranks have left it"
            detail = f"{node}: {', '.join(command.tests)} self-test {when}; its result: node_self_test_result"
            self._record(command, detail)
        self.tester.start(
            node, command.tests, "quarantine", command.command_id, ready=lambda: self._free(node)
        )
        return detail

    def handle_interval(self, command: SetCheckpointInterval, rank: int) -> str:
        with self._lock:
            detail = f"checkpoint every {command.interval_s:g}s from the next attempt on too"
            self._record(command, detail, interval_s=command.interval_s)
            self.checkpoint_interval_s = command.interval_s
        return detail

    def command_handlers(self) -> dict[type[Command], Callable[[Any, int], str]]:
        """The launcher role's handlers (producers/command_roles.py: EXECUTED_BY), each
        journaled so that a relaunched launcher neither repeats nor loses one."""
        return {
            Abort: self._journaled(self.handle_abort),
            QuarantineNode: self._journaled(self.handle_quarantine),
            EvictRank: self._journaled(self.handle_evict),
            Rollback: self._journaled(self.handle_resume),
            ResumeFrom: self._journaled(self.handle_resume),
            PauseRun: self._journaled(self.handle_pause),
            ReleaseNode: self._journaled(self.handle_release),
            SkipUpdate: self._journaled(self.handle_skip),
            RunNodeSelfTest: self._journaled(self.handle_self_test),
            SetCheckpointInterval: self._journaled(self.handle_interval),
        }

    def register(self, actuator: Any) -> None:
        """Register the handlers on an Actuator (local_ranks=[-1]) and keep its attempt in step."""
        for kind, handler in self.command_handlers().items():
            actuator.register(kind, handler)
        self.on_attempt = actuator.set_attempt

    def unexecuted(self, claimed: Iterable[str]) -> list[str]:
        """Of the command ids an actuator journaled as claimed (its journal is written
        before the handler runs), those this launcher never recorded: it died in between,
        so they were not executed and may be, once (see make_actuator)."""
        return [cid for cid in claimed if cid not in self._commands]

    def _journaled(self, handler: Callable[[Any, int], str]) -> Callable[[Any, int], str]:
        def run(command: Any, rank: int) -> str:
            self._fault("before-command", command.KIND)
            done = self._commands.get(command.command_id)
            if done is not None:  # recorded before a relaunch: answer it, do not repeat it
                if not done.get("ok"):
                    raise ValueError(str(done.get("detail", "")))
                return str(done.get("detail", ""))
            try:
                return handler(command, rank)
            except Exception as exc:  # refused (bad step, unknown node): also executed once
                with self._lock:
                    if command.command_id not in self._commands:
                        self._record(command, f"{type(exc).__name__}: {exc}", ok=False)
                raise

        return run

    def _record(
        self,
        command: Any | None,
        detail: str,
        ok: bool = True,
        request: _Request | None = None,
        quarantine: str | None = None,
        release: str | None = None,
        pause: dict[str, Any] | None = None,
        skip: int | None = None,
        interval_s: float | None = None,
    ) -> None:
        """Under the lock: journal an executed command (or an operator's quarantine)."""
        key = command.command_id if command is not None else f"operator-quarantine:{quarantine}"
        kind = command.KIND if command is not None else "quarantine_node"
        self._commands[key] = self.journal.append(
            "command",
            key=key,
            kind=kind,
            attempt=self.attempt,
            ok=ok,
            detail=detail[:2000],
            quarantine=quarantine,
            request=dataclasses.asdict(request) if request is not None else None,
            **({"release": release} if release is not None else {}),
            **({"pause": pause} if pause is not None else {}),
            **({"skip": skip} if skip is not None else {}),
            **({"interval_s": interval_s} if interval_s is not None else {}),
        )
        self._fault("after-command", kind)

    # ------------------------------------------------------------------ main loop
    def run(self) -> LaunchResult:
        result = LaunchResult("failed", "", 0)
        if self.config.self_test_spares == "ahead":  # a restart onto a tested spare waits for nothing
            threading.Thread(target=self._pretest_spares, name="selftest-spares", daemon=True).start()
        try:
            self._run(result)
        finally:
            self._ended.set()  # a node still waiting for its self-test is free now
            # A suspect node's verdict is worth waiting for; not after a stop.
            self.tester.close(0.0 if self._stop.is_set() else self.config.self_test_timeout_s)
        # A clean end: a later launcher on this run dir starts a new session (and budget).
        self.journal.append("session", status=result.status, reason=result.reason[:500])
        return result

    def _run(self, result: LaunchResult) -> None:
        pending: RestartPhases | None = None
        restarts = 0
        reuse: AttemptRecord | None = None
        self._record_unrecorded(result)
        if self._resuming:
            recovered = self._recover(result)
            if recovered is None:
                return
            pending, restarts, reuse = recovered
        first = True
        while True:
            if self._paused(result, pending):
                break
            if not first:
                self.attempt += 1
            first = False
            self._admit_spares()
            with self._lock:
                try:
                    self.placement = plan(self.pool, self.quarantined, self.config.nproc, self.placement)
                    self._busy = frozenset(self.placement.nodes)  # until the attempt's ranks are gone
                except PoolExhausted as exc:
                    result.status, result.reason = "failed", str(exc)
                    break
                late = self._request  # a Rollback/ResumeFrom that came between attempts
                if late is not None and late.resume_step is not None:
                    self._take_resume(late)
                self._request, self._evict = None, None
                if self._forced_resume is not None:
                    resume = self._forced_resume
                elif reuse is not None:  # the attempt a predecessor journaled but never spawned
                    resume = reuse.resume
                else:
                    resume = self._newest()
                self._forced_resume = None
                left = self._none_left(resume)
            if left:
                if pending is not None:
                    self._finish(pending, result)
                result.status, result.reason = "failed", left
                log.error("%s", left)
                break
            reuse = None
            self.journal.append(
                "attempt",
                attempt=self.attempt,
                resume=resume,
                nodes=list(self.placement.nodes),
                interruption=pending.interruption if pending is not None else None,
            )
            self._fault("before-spawn", self.attempt)
            if self.on_attempt is not None:
                self.on_attempt(self.attempt)
            result.attempts += 1
            end, interruption = self._run_attempt(self.placement, resume, pending, result)
            self.journal.append(
                "ended",
                attempt=self.attempt,
                end=end,
                exits=[
                    [e.rank, e.returncode, e.requested] for e in result.exits if e.attempt == self.attempt
                ],
            )
            if end == "restart":
                self._fault("after-teardown", self.attempt)
            if pending is not None:
                self._finish(pending, result)
                pending = None
            if end == "ok":
                result.status, result.reason = "ok", f"all {self.config.nproc} ranks exited 0"
                break
            if end == "stopped":
                result.status, result.reason = "stopped", "the launcher was stopped"
                if interruption is not None:
                    self._finish(interruption, result)
                break
            assert interruption is not None
            if self._paused(result, interruption):
                break
            if restarts >= self.config.max_restarts:
                self._fail(interruption, restarts, result)
                break
            restarts += 1
            if interruption.cause is RestartCause.CRASH and self._stop.wait(self.config.decision_wait_s):
                self._finish(interruption, result)
                result.status, result.reason = "stopped", "the launcher was stopped"
                break
            pending = interruption

    def _paused(self, result: LaunchResult, interruption: RestartPhases | None) -> bool:
        """A PauseRun is in force: end the run "paused" with its reason (the interruption
        that ended the last attempt is recorded, with no attempt after it)."""
        with self._lock:
            pause = self._pause
        if pause is None:
            return False
        if interruption is not None:
            self._finish(interruption, result)
        info = pause.get("pause") or {}
        result.status = "paused"
        result.reason = (
            f"paused at step {info.get('step', -1)} by {pause.get('key', '?')}: {info.get('reason', '')}"
        )
        return True

    def _fail(self, interruption: RestartPhases, restarts: int, result: LaunchResult) -> None:
        self._finish(interruption, result)
        result.status = "failed"
        result.reason = (
            f"{interruption.cause} after {restarts} restarts (max_restarts): {interruption.detail}"
        )

    # ------------------------------------------------------------------ recovery
    def _recover(self, result: LaunchResult) -> tuple[RestartPhases | None, int, AttemptRecord | None] | None:
        """The predecessor died with its last attempt in flight or between two attempts:
        end its ranks, then finish the restart it was in (the interruption it journaled,
        else one for the Abort/Rollback it had accepted, else one for its own death),
        without repeating anything journaled. Returns (the interruption the next attempt
        restarts after, restarts of this session so far, the journaled attempt to spawn
        again) or None when the run ended here (stopped, max_restarts)."""
        state = self._state
        last = state.last
        assert last is not None
        cfg = self.config
        restarts = len(state.session_restarts)
        if len(last.nodes) == self.pool.slots(cfg.nproc):  # slot-stable placement across the relaunch
            self.placement = Placement(tuple(last.nodes), cfg.ranks_per_node, cfg.nproc, {})
        orphans = self._end_orphans(state)
        ran = last.spawned or last.attempt in orphans.values()
        if last.ended is None and not ran:
            # Journaled, never spawned: nothing of it ran, so it starts again under its number,
            # for the interruption it was journaled for (already counted as a restart).
            log.warning("recovery: attempt %d was never spawned; spawning it", last.attempt)
            pending = self._rebuilt(last.interruption) if last.interruption is not None else None
            return pending, restarts, last
        self._report_exits(last, result, lost=last.ended is None)
        if last.interruption is not None and last.interruption not in self._recorded:
            self._finish(self._rebuilt(last.interruption), result)  # the restart into `last`
        # The interrupted attempt's commands may still come (redelivered: not acked before
        # the death): give them the time a crash gives the processor's decisions.
        if self._stop.wait(cfg.decision_wait_s):
            result.status, result.reason = "stopped", "the launcher was stopped"
            return None
        found = state.interruption_of(last.attempt)
        if found is not None:
            interruption = self._rebuilt(int(found["index"]))
        else:
            with self._lock:
                accepted = self._pending_command(last.attempt)
            now = self.clock()
            if accepted is not None:  # executed before the death, never acted upon: act on it once
                req = accepted["request"]
                cause, detail = RestartCause(req["cause"]), str(req["detail"])
                fault_ts, detected_ts, key = (
                    float(req["issued_ts"]),
                    float(req["received_ts"]),
                    accepted["key"],
                )
            else:
                cause, key = RestartCause.LAUNCHER, ""
                detail = (
                    f"the launcher died with attempt {last.attempt} running ({len(orphans)} orphans ended)"
                )
                fault_ts = detected_ts = now
            interruption = self._interruption(
                cause, detail, last.attempt, fault_ts, detected_ts, command_id=key
            )
        if last.ended is None:
            self.journal.append("ended", attempt=last.attempt, end="lost", exits=[])
        with self._lock:  # a Rollback/ResumeFrom accepted but not taken: the next attempt resumes there
            untaken = self._untaken_resume()
            if untaken is not None:
                self._take_resume(_request_of(untaken["request"]))
        self.attempt = last.attempt + 1
        if restarts >= cfg.max_restarts:
            self._fail(interruption, restarts, result)
            return None
        return interruption, restarts + 1, None

    def _record_unrecorded(self, result: LaunchResult) -> None:
        """Write the restarts.jsonl line of every journaled interruption whose next attempt
        was spawned but that a predecessor died before recording (its phases are in that
        attempt's files); the ones recorded already are not written again."""
        for index in sorted(self._state.interruptions):
            spawned = any(a.interruption == index and a.spawned for a in self._state.attempts.values())
            if spawned and index not in self._recorded:
                self._finish(self._rebuilt(index), result)

    def _end_orphans(self, state: JournalState) -> dict[int, int]:
        """pid -> attempt of the predecessor's ranks that were still running, now ended."""
        candidates = {
            pid: a.attempt for a in state.attempts.values() if a.ended is None for pid in a.pids.values()
        }
        found = rank_processes(self.run_dir, candidates)
        if found:
            log.warning("recovery: ending %d ranks a dead launcher left running: %s", len(found), found)
            left = terminate_orphans(sorted(found), max(1.0, self.config.term_timeout_s))
            self.journal.append("orphans", pids={str(p): a for p, a in found.items()}, left=left)
        return found

    def _report_exits(self, att: AttemptRecord, result: LaunchResult, lost: bool) -> None:
        """The attempt's RankExits again (same event ids: duplicates of those the predecessor
        shipped, the ones it could not ship): as journaled, or requested exits of unknown
        status for an attempt whose ranks the successor ended."""
        placement = Placement(tuple(att.nodes), self.config.ranks_per_node, self.config.nproc, {})
        now = self.clock()
        if lost:
            for r in range(self.config.nproc):
                self._exit(result, RankEnd(att.attempt, r, placement.node_of(r), None, now, True))
            return
        ended: dict[str, Any] = next(
            (r for r in reversed(self.journal.records) if r["op"] == "ended" and r["attempt"] == att.attempt),
            {},
        )
        for rank, rc, requested in ended.get("exits", []):
            self._exit(result, RankEnd(att.attempt, rank, placement.node_of(rank), rc, now, bool(requested)))

    def _rebuilt(self, index: int) -> RestartPhases:
        """Interruption `index` from the journal, with the attempt started after it."""
        state = replay(self.journal.records)
        known = {f.name for f in dataclasses.fields(RestartPhases)}
        data = {k: v for k, v in state.interruptions[index]["record"].items() if k in known}
        rec = RestartPhases(**{**data, "cause": RestartCause(data["cause"])})
        nxt = next((a for a in state.attempts.values() if a.interruption == index), None)
        if nxt is not None:
            rec.to_attempt, rec.resumed_from_step = nxt.attempt, nxt.resume
            if nxt.spawn_ts is not None:
                rec.spawn_ts, rec.reschedule_s = nxt.spawn_ts, nxt.spawn_ts - rec.detected_ts
        return rec

    def _pending_command(self, attempt: int) -> dict[str, Any] | None:
        """Under the lock: an Abort/Rollback/ResumeFrom executed in `attempt`, not acted upon."""
        for key, cmd in self._commands.items():
            if (
                cmd.get("ok")
                and cmd.get("request")
                and cmd.get("attempt") == attempt
                and key not in self._taken
            ):
                return cmd
        return None

    def _untaken_resume(self) -> dict[str, Any] | None:
        """Under the lock: the newest executed Rollback/ResumeFrom whose resume was not taken."""
        found = None
        for key, cmd in self._commands.items():
            req = cmd.get("request") or {}
            if cmd.get("ok") and req.get("resume_step") is not None and key not in self._taken:
                found = cmd
        return found

    def _fault(self, point: str, detail: object = "") -> None:
        """Test hook: with config.fault = "point" or "point:detail" (FAULT_POINTS; detail the
        attempt or the command's kind), SIGKILL this process there, as an OOM kill would."""
        name, _, want = self.config.fault.partition(":")
        if name == point and (not want or want == str(detail)):
            log.warning("fault injection: SIGKILL at %s (%s)", point, detail)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ one attempt
    def _run_attempt(
        self, placement: Placement, resume: int, pending: RestartPhases | None, result: LaunchResult
    ) -> tuple[str, RestartPhases | None]:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext

        cfg, attempt, n = self.config, self.attempt, self.config.nproc
        port = free_port(cfg.master_addr)
        (self.run_dir / f"attempt-{attempt}").mkdir(parents=True, exist_ok=True)
        envs = {r: self._env(r, placement, resume, port) for r in range(n)}
        self._emit(
            RunStarted,
            RUN_LEVEL_RANK,
            "",
            resume,
            key=f"run-started-{attempt}",
            world_size=n,
            ranks_per_node=cfg.ranks_per_node,
            nodes=list(placement.nodes),
            racks={node: self.pool.racks.get(node, "") for node in placement.nodes},
            resumed_from_step=resume,
        )
        log.info("attempt %d: %d ranks on %s, resume step %d", attempt, n, placement.nodes, resume)
        spawn_ts = self.clock()
        # PContext.start() installs torch elastic's own SIGINT/SIGTERM handlers (raising
        # SignalException); keep ours (stop(): a clean teardown and status "stopped").
        main = threading.current_thread() is threading.main_thread()
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        ctx = start_processes(
            name=f"trainguard-{cfg.run_id}-{attempt}",
            entrypoint=cfg.command[0],
            args={r: tuple(cfg.command[1:]) for r in range(n)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(self.run_dir / f"attempt-{attempt}" / "logs")),
        )
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        assert isinstance(ctx, SubprocessContext)  # a str entrypoint: one binary per rank
        procs = {r: h.proc for r, h in ctx.subprocess_handlers.items()}
        self._fault("mid-spawn", attempt)
        # The ranks outlive a killed launcher (own sessions): its successor ends them by pid.
        self.journal.append(
            "spawned", attempt=attempt, pids={str(r): p.pid for r, p in procs.items()}, spawn_ts=spawn_ts
        )
        self._fault("after-spawn", attempt)
        if pending is not None:
            pending.to_attempt, pending.spawn_ts, pending.resumed_from_step = attempt, spawn_ts, resume
            pending.reschedule_s = spawn_ts - pending.detected_ts
        live = set(range(n))
        last_poll = spawn_ts
        stopping = False  # exits from now on are requested
        grace_until: float | None = None
        interruption: RestartPhases | None = None
        next_phases = 0.0

        def reap(now: float) -> list[tuple[int, int]]:
            ended = [(r, rc) for r in sorted(live) if (rc := procs[r].poll()) is not None]
            for r, rc in ended:
                live.discard(r)
                self._exit(result, RankEnd(attempt, r, placement.node_of(r), rc, now, stopping))
            return ended

        def teardown() -> None:
            nonlocal stopping
            stopping = True
            ctx.close(signal.SIGTERM, timeout=max(1, int(math.ceil(cfg.term_timeout_s))))
            now = self.clock()
            reap(now)
            for r in sorted(live):  # unkillable (D-state): abandoned by close()
                self._exit(result, RankEnd(attempt, r, placement.node_of(r), None, now, True))
            live.clear()

        try:
            while live:
                now = self.clock()
                crashed = [(r, rc) for r, rc in reap(now) if rc != 0]
                if crashed and not stopping and interruption is None:
                    signaled = [c for c in crashed if c[1] < 0] or crashed  # the killed one is the cause
                    r, rc = signaled[0]
                    interruption = self._interruption(
                        RestartCause.CRASH, f"rank {r} exited {rc}", attempt, last_poll, now,
                        rank=r, node=placement.node_of(r), returncode=rc,
                    )  # fmt: skip
                    teardown()
                    break
                last_poll = now
                if not live:
                    break
                if self._stop.is_set():
                    teardown()
                    break
                with self._lock:
                    request, evict, pause = self._request, self._evict, self._pause
                if pause is not None and interruption is None:
                    interruption = self._interruption(
                        RestartCause.PAUSE, str((pause.get("pause") or {}).get("reason", ""))[:500], attempt,
                        float(pause.get("ts", now)), now, command_id=str(pause.get("key", "")),
                    )  # fmt: skip
                    teardown()
                    break
                if (
                    interruption is None
                    and evict is not None
                    and max(self._eligible(), default=-1)
                    > (evict.evict_after_step if evict.evict_after_step is not None else -1)
                ):
                    request = evict
                    with self._lock:
                        self._request = evict
                if interruption is None and request is not None:
                    interruption = self._interruption(
                        request.cause, request.detail, attempt, request.issued_ts, request.received_ts,
                        command_id=request.command_id,
                    )  # fmt: skip
                    stopping = True
                    if request.resume_step is not None:
                        with self._lock:
                            self._take_resume(request)
                    if request.cause is RestartCause.ABORT:
                        grace_until = now + cfg.grace_s
                    else:
                        teardown()
                        break
                if grace_until is not None and now >= grace_until:
                    teardown()
                    break
                if pending is not None and not pending.complete and now >= next_phases:
                    next_phases = now + 0.5
                    self._collect_phases(pending)
                    if pending.complete:  # every rank completed its first step: publish now
                        self._publish(pending)
                time.sleep(cfg.poll_s)
        except BaseException:
            teardown()
            raise
        finally:
            ctx.close(signal.SIGKILL, timeout=1)  # no-op when all are gone; frees the log files
            self._busy = frozenset()  # a node left by this attempt may be self-tested now
        if self._stop.is_set() and interruption is None:
            return "stopped", None
        if interruption is not None:
            return ("stopped" if self._stop.is_set() else "restart"), interruption
        return "ok", None

    # ------------------------------------------------------------------ helpers
    def _env(self, rank: int, placement: Placement, resume: int, port: int) -> dict[str, str]:
        with self._lock:  # the actuator thread may be adding one
            skips = sorted(self.skip_batches)
            interval = self.checkpoint_interval_s
        return rank_env(
            self.config, self.run_dir, self.attempt, rank, placement, resume, port, skips, interval
        )

    # ------------------------------------------------------------------ node self-tests
    def _run_self_test(self, node: str, devices: int, tests: Any) -> NodeSelfTestReport:
        """The real test: one worker process per device of `node`, with the ranks' extra
        environment (so a fire drill's TRAINGUARD_INJECT_WRONG_DEVICE reaches it)."""
        return run_node_self_test(node, devices, tests, self.config.self_test_timeout_s, self.config.env)

    def _free(self, node: str) -> bool:
        """No live rank is on `node`: between attempts, after the run, or not in the placement."""
        return self._ended.is_set() or node not in self._busy

    def _joining(self) -> list[str]:
        """Spares the next placement would bring in that have not passed a self-test."""
        with self._lock:
            try:
                nxt = plan(self.pool, self.quarantined, self.config.nproc, self.placement)
            except PoolExhausted:
                return []  # the placement itself says so
            before = set(self.placement.nodes) if self.placement is not None else set()
        own = set(self.pool.nodes[: self.pool.slots(self.config.nproc)])
        return [n for n in nxt.nodes if n not in own and n not in before and n not in self.tester.passed]

    def _pretest_spares(self) -> None:
        """Test the pool's spares one at a time (bounded extra load) while the run trains."""
        own = set(self.pool.nodes[: self.pool.slots(self.config.nproc)])
        for node in self.pool.nodes:
            if self._ended.is_set() or self._stop.is_set():
                return
            with self._lock:
                skip = node in own or node in self.quarantined
            if not skip:
                self.tester.start(node, SELF_TESTS, "spare")
                self.tester.wait(node)

    def _prestart_spares(self) -> None:
        if self.config.self_test_spares != "off":
            for node in self._joining():
                self.tester.start(node, SELF_TESTS, "spare")

    def _admit_spares(self) -> None:
        """Before an attempt: every spare its placement brings in has passed the self-test;
        one that fails is quarantined (by the tester) and the placement made again."""
        if self.config.self_test_spares == "off":
            return
        while not self._stop.is_set():
            joining = self._joining()
            if not joining:
                return
            for node in joining:
                self.tester.start(node, SELF_TESTS, "spare")
            for node in joining:
                report = self.tester.wait(node, self.config.self_test_timeout_s + 30)
                if report is None:  # never finished: keep it out rather than trust it
                    self._failed_self_test(node)

    def _failed_self_test(self, node: str) -> None:
        with self._lock:
            if node in self.quarantined:
                return
            detail = f"{node} failed its self-test: {self._quarantine_detail(node)}"
            self._record(None, detail, quarantine=node)
            self.quarantined.add(node)

    def _report_self_test(self, report: NodeSelfTestReport, purpose: str, command_id: str) -> None:
        summary = report.summary()
        code = ReasonCode.NODE_SELF_TEST_PASSED if report.passed else ReasonCode.NODE_SELF_TEST_FAILED
        self._emit(
            NodeSelfTestResult,
            RUN_LEVEL_RANK,
            report.node,
            NO_STEP,
            key=f"selftest-{report.node}-{purpose}-{command_id or self.attempt}",
            passed=report.passed,
            tests=report.tests,
            failed_tests=report.failed_tests,
            purpose=purpose,
            command_id=command_id,
            devices=len({r.local_rank for r in report.results}),
            wall_s=max(0.0, report.wall_s),
            reason=Reason(code=code, text=summary[:2000]),
        )

    def _take_resume(self, request: _Request) -> None:
        """Under the lock: the next attempt resumes from the named step (journaled: a
        successor neither loses the rollback nor takes it twice)."""
        assert request.resume_step is not None
        ts = self.clock()
        rollback = request.cause is RestartCause.ROLLBACK
        self.journal.append(
            "take", key=request.command_id, step=request.resume_step, rollback=rollback, ts=ts
        )
        self._taken.add(request.command_id)
        self._forced_resume = request.resume_step
        if rollback:
            self._rollbacks.append((request.resume_step, ts))
        self._request = None

    def _eligible(self, ignore_rollbacks: bool = False) -> list[int]:
        steps = validated_steps(self.config.checkpoint_dir)
        rules = [] if ignore_rollbacks else list(self._rollbacks)
        return [s for s, mtime in steps.items() if all(s <= bound or mtime >= ts for bound, ts in rules)]

    def _newest(self) -> int:
        return max(self._eligible(), default=-1)

    def _none_left(self, resume: int) -> str:
        """Why the run stops before an attempt from scratch: every checkpoint it had was
        rejected at load ('' when there is nothing to stop for, or the config allows a
        start from step 0)."""
        if resume >= 0 or self.config.restart_from_scratch:
            return ""
        rejected = rejected_steps(self.config.checkpoint_dir)
        if not rejected:
            return ""  # no checkpoint was ever made: step 0 is the run's own start
        why = "; ".join(f"step {step}: {reason}" for step, reason in sorted(rejected.items(), reverse=True))
        return (
            f"no valid checkpoint left in {self.config.checkpoint_dir}: every one was rejected "
            f"({why[:1500]}); not restarting from step 0 (--restart-from-scratch allows it)"
        )

    def _interruption(
        self,
        cause: RestartCause,
        detail: str,
        attempt: int,
        fault_ts: float,
        detected_ts: float,
        rank: int = RUN_LEVEL_RANK,
        node: str = "",
        returncode: int | None = None,
        command_id: str = "",
    ) -> RestartPhases:
        """A new interruption of `attempt`, journaled (before its teardown) under its
        idempotency key: the command's id, else "<cause>:<attempt>"."""
        self._interruptions += 1
        rec = RestartPhases(
            run_id=self.config.run_id,
            interruption=self._interruptions - 1,
            cause=cause,
            detail=detail[:500],
            from_attempt=attempt,
            to_attempt=None,
            rank=rank,
            node=node,
            exit_code=returncode,
            signal=-returncode if returncode is not None and returncode < 0 else None,
            command_id=command_id,
            fault_ts=fault_ts,
            detected_ts=detected_ts,
            detect_s=max(0.0, detected_ts - fault_ts),
        )
        self.journal.append(
            "interruption",
            index=rec.interruption,
            key=command_id or f"{cause}:{attempt}",
            from_attempt=attempt,
            record=rec.to_json(),
        )
        self._fault("after-interruption", attempt)
        return rec

    def _collect_phases(self, rec: RestartPhases) -> None:
        collect_phases(rec, self.run_dir, self.config.nproc)

    def _finish(self, rec: RestartPhases, result: LaunchResult) -> None:
        self._collect_phases(rec)
        self._publish(rec)
        result.restarts.append(rec)
        if rec.interruption in self._recorded:  # a predecessor wrote it before it died
            return
        with self._restarts_file.open("a") as fh:
            fh.write(json.dumps(rec.to_json()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._recorded.add(rec.interruption)

    def _publish(self, rec: RestartPhases) -> None:
        """The restart's phases as a RestartPhases telemetry event (once per interruption;
        only the phases measured), for the archive's `restart_phase` view."""
        if rec.to_attempt is None or rec.interruption in self._published:
            return
        self._published.add(rec.interruption)
        measured = {
            "detect": rec.detect_s,
            "reschedule": rec.reschedule_s,
            "process_start": rec.process_start_s,
            "checkpoint_load": rec.checkpoint_load_s,
            "pg_init": rec.pg_init_s,
            "first_step": rec.first_step_s,
        }
        self._emit(
            RestartPhasesEvent,
            RUN_LEVEL_RANK,
            "",
            rec.resumed_from_step,
            key=f"restart-{rec.interruption}",
            attempt=rec.to_attempt,
            interrupted_attempt=rec.from_attempt,
            cause=str(rec.cause),
            phases={name: max(0.0, s) for name, s in measured.items() if s is not None},
            resumed_from_step=rec.resumed_from_step,
        )

    def _exit(self, result: LaunchResult, end: RankEnd) -> None:
        """The RankExit of one rank: its own newest completed step and the newest any rank
        of the attempt completed, both from the ranks' progress files (exact when the
        survivors' last StepTimings are still in their shippers)."""
        result.exits.append(end)
        info = read_json(phases_path(self.run_dir, end.attempt, end.rank))
        own = read_progress(progress_path(self.run_dir, end.attempt, end.rank))
        if own is None:  # a rank program without the progress file: its first step at most
            first = info.get("last_step")
            own = first if isinstance(first, int) and first >= NO_STEP else NO_STEP
        steps = [read_progress(progress_path(self.run_dir, end.attempt, r)) for r in range(self.config.nproc)]
        job_step = max([own, *(s for s in steps if s is not None)])
        self._emit(
            RankExit,
            end.rank,
            end.node,
            own,
            key=f"exit-{end.attempt}-{end.rank}",
            attempt=end.attempt,
            exit_code=end.returncode,
            signal=end.signal,
            requested=end.requested,
            stack_dump_ref=str(info.get("stack_dump_ref", ""))[:2000],
            stack_signature=str(info.get("stack_signature", ""))[:2000],
            job_step=max(-1, job_step),
        )

    def _emit(
        self,
        cls: type[Envelope],
        rank: int,
        node: str,
        step: int,
        key: str,
        attempt: int | None = None,
        **fields: Any,
    ) -> None:
        try:
            event = cls(
                event_id=f"launcher-{self._id_prefix}-{key}",
                run_id=self.config.run_id,
                attempt=self.attempt if attempt is None else attempt,
                rank=rank,
                node=node,
                step=step,
                ts=self.clock(),
                **fields,
            )
        except ValidationError as exc:  # telemetry must never stop the launcher
            log.warning("launcher: %s not sent (invalid values): %s", cls.KIND, exc)
            return
        self.sink.submit(event)


# --------------------------------------------------------------------------- wiring
