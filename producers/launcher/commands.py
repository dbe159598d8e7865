"""The launcher role's command handlers (producers/command_roles.py: EXECUTED_BY).

They run on the actuator thread and only set what the main loop reads (:mod:`.run_state`);
each journals its command under the lock, keyed by command_id, BEFORE applying the effect
and before the ack: a launcher killed after the record has executed it (its successor
applies the record), one killed before has not (its successor runs it once). A refused
command (a bad step, an unknown node) is journaled as refused, so it is also answered,
never executed, once.

- Abort: the ranks dump their stacks and exit themselves (their own actuators); the
  launcher waits ``grace_s`` for the group to end, then SIGTERM, then SIGKILL; restart.
- QuarantineNode: the node leaves the pool; takes effect at the next restart.
- EvictRank: quarantines the rank's node and restarts at the next checkpoint boundary:
  as soon as a checkpoint newer than the newest one at the command is VALIDATED.
- DrainNode: quarantines the node at once and takes it out at the running attempt's next
  checkpoint boundary, the cadence's or one within the command's ``within_s``: in process
  the ranks agree on the step, checkpoint there and leave (no step lost), and its ranks go
  to warm spares or a smaller world; under full restarts the eviction path (drain.py).
  Refused for a node not in the pool (across hosts: not in the running world) and for one
  already out (quarantined, or draining); a pool node that holds no rank is quarantined.
- Rollback / ResumeFrom: stop the group now and restart from the named checkpoint step
  (it must carry a VALIDATED marker; :mod:`.resume`).
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
- SkipUpdate (the policy's alternative to PauseRun, ``paging.on_repeat_step: skip``): the
  step's batch is skipped by every later attempt (TRAINGUARD_SKIP_BATCHES, read by the
  Supervisor's ``steps()``); the running ranks skip that step's update themselves.
- SetCheckpointInterval: the running ranks follow it themselves; the launcher journals it
  and every later attempt starts with it (TRAINGUARD_CHECKPOINT_INTERVAL_S, read by the
  Supervisor), so a restart never falls back to an older interval: the command carries
  the attempt it was sent to, and a later attempt's ranks refuse it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...schemas import (
    Abort,
    Command,
    DrainNode,
    EvictRank,
    InterruptionDecided,
    PauseRun,
    QuarantineNode,
    ReleaseNode,
    ResumeFrom,
    Rollback,
    RunNodeSelfTest,
    SetCheckpointInterval,
    SkipUpdate,
)
from ..chaos import kill_at
from .config import LauncherConfig
from .node_selftest import SELF_TESTS
from .plan import NodePool, quarantine_effect
from .records import RestartCause
from .resume import ResumeChoice
from .run_state import DrainRequest, LauncherState, StopRequest
from .shared_quarantine import SharedQuarantine
from .spares import SpareAdmission

Handler = Callable[[Any, int], str]


class LauncherCommands:
    def __init__(
        self,
        config: LauncherConfig,
        pool: NodePool,
        state: LauncherState,
        resume: ResumeChoice,
        spares: SpareAdmission,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.pool = pool
        self.state = state
        self.resume = resume
        self.spares = spares
        self.clock = clock
        #: Across hosts, the run's quarantine list on shared storage (shared_quarantine.py).
        self.shared = SharedQuarantine(config.shared_dir) if config.rendezvous is not None else None

    def table(self) -> dict[type[Command], Handler]:
        """Every handler, journaled so that a relaunched launcher neither repeats nor loses one."""
        return {
            Abort: self._journaled(self.abort),
            QuarantineNode: self._journaled(self.quarantine_node),
            EvictRank: self._journaled(self.evict),
            DrainNode: self._journaled(self.drain),
            Rollback: self._journaled(self.resume_from),
            ResumeFrom: self._journaled(self.resume_from),
            PauseRun: self._journaled(self.pause),
            ReleaseNode: self._journaled(self.release),
            SkipUpdate: self._journaled(self.skip),
            RunNodeSelfTest: self._journaled(self.self_test),
            SetCheckpointInterval: self._journaled(self.interval),
            InterruptionDecided: self._journaled(self.decided),
        }

    def unexecuted(self, claimed: Iterable[str]) -> list[str]:
        """Of the command ids an actuator journaled as claimed (its journal is written
        before the handler runs), those this launcher never recorded: it died in between,
        so they were not executed and may be, once (see wiring.make_actuator)."""
        return [cid for cid in claimed if cid not in self.state.commands]

    def _journaled(self, handler: Handler) -> Handler:
        state = self.state

        def run(command: Any, rank: int) -> str:
            kill_at(self.config.fault, "before-command", command.KIND)
            done = state.commands.get(command.command_id)
            if done is not None:  # recorded before a relaunch: answer it, do not repeat it
                if not done.get("ok"):
                    raise ValueError(str(done.get("detail", "")))
                return str(done.get("detail", ""))
            try:
                return handler(command, rank)
            except Exception as exc:  # refused (bad step, unknown node): also executed once
                with state.lock:
                    if command.command_id not in state.commands:
                        state.record(command, f"{type(exc).__name__}: {exc}", ok=False)
                raise

        return run

    # ------------------------------------------------------------------ handlers
    def abort(self, command: Abort, rank: int) -> str:
        state = self.state
        with state.lock:
            if state.request is not None:
                detail = f"attempt {state.attempt} is already stopping ({state.request.cause})"
                state.record(command, detail)
                return detail
            request = StopRequest(
                RestartCause.ABORT, command.command_id, command.issued_ts, self.clock(), command.reason.text
            )
            grace = f"{self.config.grace_s:g}s"
            detail = f"attempt {state.attempt}: ranks get {grace} to exit, then the group restarts"
            state.record(command, detail, request=request)
            state.request = request
        return detail

    def quarantine_node(self, command: QuarantineNode, rank: int) -> str:
        return self.quarantine(command.node, command)

    def quarantine(self, node: str, command: QuarantineNode | None = None) -> str:
        """`node` leaves the pool from the next restart on (a command's, or an operator's)."""
        self._known(node)
        state = self.state
        back = self.shared.readmitted() if self.shared is not None and command is not None else {}
        since = back.get(node)
        if command is not None and since is not None and command.attempt <= since:
            # elastic training: a lost host, self-tested and back since (world.py's readmission)
            detail = (
                f"{node} is back in the run since attempt {since}: "
                f"this quarantine for attempt {command.attempt} is spent"
            )
            with state.lock:
                state.record(command, detail)
            return detail
        with state.lock:
            detail = self._effect(node)
            state.record(command, detail, quarantine=node)
            state.quarantined.add(node)
        if self.shared is not None:
            why = command.reason.text if command is not None else "operator"
            self.shared.add(node, why, by=self.config.node)
        self.spares.prestart()
        return detail

    def evict(self, command: EvictRank, rank: int) -> str:
        state = self.state
        placement = state.placement
        if placement is None or not 0 <= command.rank < self.config.nproc:
            raise ValueError(f"rank {command.rank} is not part of the job")
        node = placement.node_of(command.rank)
        newest = self.resume.newest()
        with state.lock:
            detail = (
                f"rank {command.rank}: {self._effect(node)}; "
                f"restart once a checkpoint after step {newest} is validated"
            )
            # One record for both effects: a relaunch restarts anyway, so only the
            # quarantine needs to survive one.
            state.record(command, detail, quarantine=node)
            state.quarantined.add(node)
            state.evict = StopRequest(
                RestartCause.EVICTION,
                command.command_id,
                command.issued_ts,
                self.clock(),
                f"evict rank {command.rank} ({node})",
                evict_after_step=newest,
            )
        self.spares.prestart()
        return detail

    def drain(self, command: DrainNode, rank: int) -> str:
        """Take `command.node` out at the next checkpoint boundary (module docstring, drain.py)."""
        node = command.node
        self._known(node)
        in_process = self.config.restart == "in-process"
        newest = -1 if in_process else self.resume.newest()
        state = self.state
        with state.lock:
            placement, attempt = state.placement, state.attempt
            if node in state.quarantined:
                drain = state.drain
                if drain is not None and node in drain.nodes:
                    raise ValueError(f"{node} is already draining: it leaves at attempt {attempt}'s boundary")
                raise ValueError(f"{node} is already out of the run (quarantined)")
            running = placement is not None and node in placement.nodes
            if not running and self.shared is not None:
                raise ValueError(f"host {node} is not in attempt {attempt}'s world")
            if not running:  # an idle pool node: nothing runs there to drain
                detail = f"{node} holds no rank of attempt {attempt}: it leaves the pool (nothing to drain)"
                state.record(command, detail, quarantine=node)
                state.quarantined.add(node)
            else:
                detail = self._drain(command, node, newest)
        self.spares.prestart()
        return detail

    def _drain(self, command: DrainNode, node: str, newest: int) -> str:
        """Under the lock: the drain of `node`, which runs ranks of the attempt, in force."""
        state = self.state
        placement, attempt = state.placement, state.attempt
        assert placement is not None
        ranks = ", ".join(map(str, placement.ranks_of(node)))
        boundary = f"the cadence's, or one within {command.within_s:g} s"
        if self.config.restart != "in-process":
            boundary = f"full restarts: the first checkpoint validated after step {newest}"
        detail = (
            f"{node} (ranks {ranks}) drains at attempt {attempt}'s next checkpoint boundary "
            f"({boundary}): {self._effect(node)}"
        )
        # One record: a relaunch restarts anyway, so only the quarantine must survive one.
        state.record(command, detail, quarantine=node)
        state.quarantined.add(node)
        now = self.clock()
        deadline = now + command.within_s
        drain = state.drain
        if drain is None or drain.attempt != attempt:
            state.drain = DrainRequest(
                attempt, [node], [command.command_id], command.issued_ts, now, deadline,
                command.reason.text[:500], after_step=newest,
            )  # fmt: skip
        else:  # another node at the same boundary, at the earlier of the two deadlines
            drain.nodes.append(node)
            drain.command_ids.append(command.command_id)
            drain.deadline_ts = min(drain.deadline_ts, deadline)
        return detail

    def published(self) -> None:
        """Across hosts, once the attempt ended at the drain's boundary: the drained hosts
        on the run's shared list (not before: a --spare agent would join at once and, without
        elastic training, the world would re-form for it then, losing steps)."""
        if self.shared is None:
            return
        with self.state.lock:
            drain = self.state.drain
            nodes, why = (list(drain.nodes), drain.why) if drain is not None else ([], "")
        for node in nodes:
            self.shared.add(node, f"drained before a predicted failure: {why}"[:500], by=self.config.node)

    def resume_from(self, command: Rollback | ResumeFrom, rank: int) -> str:
        step = command.checkpoint_step
        if step not in self.resume.eligible(ignore_rollbacks=True):
            raise ValueError(f"no validated checkpoint at step {step} in {self.config.checkpoint_dir}")
        cause = RestartCause.ROLLBACK if isinstance(command, Rollback) else RestartCause.RESUME
        state = self.state
        with state.lock:
            request = StopRequest(
                cause, command.command_id, command.issued_ts, self.clock(), command.reason.text, step
            )
            detail = f"stopping attempt {state.attempt}; restarting from checkpoint {step}"
            state.record(command, detail, request=request)
            state.request = request
        return detail

    def pause(self, command: PauseRun, rank: int) -> str:
        state = self.state
        with state.lock:
            running = state.placement is not None and state.pause is None
            detail = (
                f"run paused at step {command.step}: "
                + (f"attempt {state.attempt} stops and " if running else "")
                + f"nothing restarts until a human relaunches ({command.reason.text[:300]})"
            )
            state.record(command, detail, pause={"step": command.step, "reason": command.reason.text})
            state.pause = state.commands[command.command_id]
        return detail

    def skip(self, command: SkipUpdate, rank: int) -> str:
        state = self.state
        with state.lock:
            detail = f"the batch of step {command.step} is skipped from the next attempt on"
            state.record(command, detail, skip=command.step)
            state.skip_batches.add(command.step)
        return detail

    def decided(self, command: InterruptionDecided, rank: int) -> str:
        """The processor is done with attempt `command.attempt`'s interruption: the
        decision wait ends (launcher.py)."""
        state = self.state
        with state.lock:
            detail = f"attempt {command.attempt}'s interruption decided: the restart goes on"
            capacity = getattr(command, "capacity", None)
            if capacity is not None:
                state.capacity[command.attempt] = str(capacity)
                detail += f"; lost capacity: {capacity}"
            state.record(command, detail)
            state.decided.add(command.attempt)
        return detail

    def release(self, command: ReleaseNode, rank: int) -> str:
        node = command.node
        self._known(node)
        failed = self.spares.tester.failed.get(node)
        if failed is not None:
            raise ValueError(f"{node} stays out of the pool: it failed its self-test ({failed[:500]})")
        state = self.state
        with state.lock:
            if node not in state.quarantined:
                detail = f"{node} is not quarantined: nothing to release"
            else:
                detail = f"{node} is back in the pool from the next restart on"
            state.record(command, detail, release=node)
            state.quarantined.discard(node)
        if self.shared is not None:
            self.shared.release(node, by=self.config.node)
        return detail

    def self_test(self, command: RunNodeSelfTest, rank: int) -> str:
        node = command.node
        self._known(node)
        unknown = [t for t in command.tests if t not in SELF_TESTS]
        if unknown:
            raise ValueError(f"no {', '.join(unknown)} self-test here (known: {', '.join(SELF_TESTS)})")
        free, settled = self.spares.free, self.spares.settled

        def ready() -> bool:  # its devices to itself, and not while a restart is under way
            return free(node) and settled.is_set()

        with self.state.lock:
            when = "now" if ready() else "once its ranks have left it and the restart is done"
            detail = f"{node}: {', '.join(command.tests)} self-test {when}; its result: node_self_test_result"
            self.state.record(command, detail)
        self.spares.tester.start(node, command.tests, "quarantine", command.command_id, ready=ready)
        return detail

    def interval(self, command: SetCheckpointInterval, rank: int) -> str:
        state = self.state
        with state.lock:
            detail = f"checkpoint every {command.interval_s:g}s from the next attempt on too"
            state.record(command, detail, interval_s=command.interval_s)
            state.checkpoint_interval_s = command.interval_s
        return detail

    def _known(self, node: str) -> None:
        # Across hosts a node is a host: any host may join, there is no modelled pool.
        if self.shared is None and node not in self.pool.nodes:
            raise ValueError(f"node {node} is not in the pool")

    def _effect(self, node: str) -> str:
        """Under the lock: what quarantining `node` does at the next restart."""
        state = self.state
        if self.shared is not None:  # across hosts: the rendezvous, not a pool, finds the replacement
            return (
                f"{node} leaves the run at the next restart and does not rejoin; a spare host takes its ranks"
            )
        return quarantine_effect(self.pool, state.quarantined, node, self.config.nproc, state.placement)
