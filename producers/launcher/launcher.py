"""`trainguard launch`: starts N rank processes, supervises them, executes restart and
quarantine decisions, and measures every restart phase by phase.

Built on torch elastic where it fits
------------------------------------
The rank processes are started, watched and torn down by torch elastic's process layer
(``start_processes``, the ``PContext`` that ``LocalElasticAgent`` and therefore
``torchrun`` use; :mod:`.attempt`). The ranks see torchrun's environment contract (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT; :mod:`.rank_env`), so a script written
for torchrun runs unchanged.

The restart loop is ours, not the elastic agent's. ``elastic_launch`` /
``LocalElasticAgent`` restart a failed worker group ``max_restarts`` times with the same
spec on the same host, and their rendezvous assigns ranks by arrival. Here every restart
is a decision with inputs the agent does not have: the placement changes (a quarantined
node's ranks move to a spare), the environment changes (TRAINGUARD_NODE, the attempt,
TRAINGUARD_RESUME_STEP chosen from the VALIDATED checkpoints or named by a Rollback),
and signed commands arriving on another thread (Abort, EvictRank, Rollback...) must stop
the group; ``elastic_launch`` blocks its caller and handles signals only in the main
thread. So: one ``start_processes`` group per attempt, and this module decides, between
attempts, placement, environment and resume step. With ``--restart in-process`` the
survivors stay in their processes and warm spares take the failed ranks (:mod:`.hot`,
docs/inprocess.md), on one host or across hosts.

Stages
------
Each restart passes the same stages, one module each, composed here:

- the decision that ends an attempt: a crash seen by the watch (:mod:`.attempt`), or a
  command executed on the actuator thread (:mod:`.commands`) into the shared
  :mod:`.run_state`;
- teardown and the interruption's record (:mod:`.attempt`, :mod:`.restarts`);
- after a crash, ``decision_wait_s`` for the processor's decisions about it (a
  QuarantineNode decided from our RankExit must arrive while the actuator still accepts
  that attempt's commands); then the launcher restarts on its own, without waiting for an
  Abort, so the run keeps going when the processor is down;
- placement (:mod:`.plan`), with every spare it brings in self-tested first
  (:mod:`.spares`), and the resume step (:mod:`.resume`);
- spawn and watch (:mod:`.attempt`), while the restart's phases are measured
  (:mod:`.restarts`) and every event goes out with an id a relaunch repeats
  (:mod:`.events`).

``max_restarts`` bounds the restarts of a run (any cause, torchrun's meaning); the same
error before the first step on two attempts ends the run "paused" sooner, by the
launcher's own decision (:mod:`.startup`: code, not hardware). Every
action is journaled before it takes effect (:mod:`.journal`), so a launcher started again
on the run dir of a killed one finishes what it was doing (:mod:`.recovery`).

Lost work is exact: every rank's Supervisor rewrites ``attempt-N/rank-R.progress`` (its
newest completed step, path in TRAINGUARD_PROGRESS_FILE) after each step, and each
RankExit carries the rank's own step and ``job_step``, the newest step any rank of the
attempt had completed when the exit was seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...schemas import (
    Abort,
    Command,
    DrainNode,
    EvictRank,
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
from ..rank.agent import EventSink  # a TelemetryShipper satisfies EventSink
from .attempt import AttemptRunner
from .commands import LauncherCommands
from .config import LauncherConfig
from .context import LaunchContext
from .elastic import next_size
from .events import LauncherEvents
from .journal import JOURNAL_NAME, ActionJournal, AttemptRecord
from .lemons import LemonGate
from .plan import NodePool, Placement, make_pool
from .records import LaunchResult, RestartCause, RestartPhases
from .recovery import Recovery
from .rendezvous import HostRendezvous
from .restarts import RestartRecorder
from .resume import ResumeChoice
from .run_state import LauncherState
from .spare_selftest import Runner
from .spares import SpareAdmission
from .startup import StartupFailures
from .story import Story, headline
from .world import HostWorld, LocalWorld, NoWorld, SpareCall, World, WorldFormation

log = logging.getLogger(__name__)


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
        self._config = config
        self.pool = pool or make_pool(
            config.nproc, config.ranks_per_node, config.spares, config.nodes_per_rack
        )
        self.clock = clock
        self.run_dir = config.resolved_run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        #: What this launcher did, and what a predecessor killed mid-action left (module docs
        #: of journal.py): the quarantines and rollbacks of the run survive a relaunch.
        self.journal = ActionJournal(self.run_dir / JOURNAL_NAME)
        self.state = state = LauncherState(self.journal, self.run_dir, config.fault)
        self.on_attempt: Callable[[int], None] | None = None  # e.g. actuator.set_attempt
        self.events = LauncherEvents(
            sink, config.run_id, self.journal.nonce, self.run_dir, config.nproc, lambda: state.attempt, clock
        )
        self.resume = ResumeChoice(config, state, clock)
        self.restarts = RestartRecorder(config, self.run_dir, self.journal, self.events, state.replayed)
        self.spares = SpareAdmission(config, self.pool, state, self.events, self_test)
        self.spares.settled = self.restarts.settled  # a quarantined node's test waits for the restart
        self.tester = self.spares.tester
        self.commands = LauncherCommands(config, self.pool, state, self.resume, self.spares, clock)
        self.context = LaunchContext(
            config, self.run_dir, self.pool, state, self.resume, self.restarts, self.events, clock
        )
        self.attempts = AttemptRunner(self.context)
        self.spares.forks = self.attempts.forks  # a spare's self-test forks its workers there too
        #: Across hosts the other agents' start-up failures are read from their run dirs.
        hosts = self.run_dir.parent if config.rendezvous is not None and config.run_dir is None else None
        self.startup = StartupFailures(self.run_dir, hosts)
        self.recovery = Recovery(self.context)
        #: Where each attempt runs: on this host's modelled nodes, or across hosts.
        self.world: WorldFormation
        if config.rendezvous is not None:
            rendezvous = HostRendezvous(config.rendezvous, config.ranks_per_node, config.elastic)
            self.world = HostWorld(config, config.node, state, self.resume, rendezvous, self.tester)
            if (hot := self.attempts.hot) is not None:  # the attempt's store: the first host's agent's
                self.world.port_for = hot.stores.reserve
                self.world.warm = lambda: hot.wait_ready(config.ranks_per_node, config.restart_wait_s)
        else:
            self.world = LocalWorld(config, self.pool, state, self.resume, self.spares)
        #: Across hosts, one line per event on this agent's console (story.py).
        self.story = self.events.story = Story(config.node, enabled=config.rendezvous is not None)
        #: Lemon nodes out of the run before its first attempt (lemons.py).
        self.lemons = LemonGate(config, self.pool, state, self.events, self.story, clock)

    # ------------------------------------------------------------------ the run's state
    @property
    def config(self) -> LauncherConfig:
        return self._config

    @config.setter
    def config(self, config: LauncherConfig) -> None:
        """A new configuration for the stages (tests change one setting before run())."""
        self._config = config
        self.state.fault = config.fault
        self.context.config = config
        stages = (
            self.resume,
            self.restarts,
            self.spares,
            self.commands,
            self.attempts,
            self.recovery,
            self.world,
            self.lemons,
        )
        for stage in stages:
            stage.config = config

    @property
    def attempt(self) -> int:
        return self.state.attempt

    @property
    def quarantined(self) -> set[str]:
        return self.state.quarantined

    @property
    def placement(self) -> Placement | None:
        return self.state.placement

    @property
    def skip_batches(self) -> set[int]:
        return self.state.skip_batches

    @property
    def checkpoint_interval_s(self) -> float | None:
        return self.state.checkpoint_interval_s

    @property
    def _pause(self) -> dict[str, Any] | None:
        return self.state.pause

    @property
    def _busy(self) -> frozenset[str]:
        return self.state.busy

    @property
    def _ended(self) -> threading.Event:
        return self.state.ended

    # ------------------------------------------------------------------ control (any thread)
    def stop(self) -> None:
        """Tear the group down (exits reported requested) and end with status "stopped"."""
        self.state.stop.set()

    def quarantine(self, node: str, command: QuarantineNode | None = None) -> str:
        """An operator's (or a command's) quarantine of `node`, from the next restart on."""
        return self.commands.quarantine(node, command)

    def command_handlers(self) -> dict[type[Command], Callable[[Any, int], str]]:
        """The launcher role's handlers (producers/command_roles.py: EXECUTED_BY), each
        journaled so that a relaunched launcher neither repeats nor loses one."""
        return self.commands.table()

    def register(self, actuator: Any) -> None:
        """Register the handlers on an Actuator (local_ranks=[-1]) and keep its attempt in step."""
        for kind, handler in self.command_handlers().items():
            actuator.register(kind, handler)
        self.on_attempt = actuator.set_attempt

    def unexecuted(self, claimed: Iterable[str]) -> list[str]:
        return self.commands.unexecuted(claimed)

    # The handlers themselves, unjournaled (callers in-process: tests, the CLI's operator
    # paths); the actuator runs the journaled ones from command_handlers().
    def handle_abort(self, command: Abort, rank: int) -> str:
        return self.commands.abort(command, rank)

    def handle_quarantine(self, command: QuarantineNode, rank: int) -> str:
        return self.commands.quarantine_node(command, rank)

    def handle_evict(self, command: EvictRank, rank: int) -> str:
        return self.commands.evict(command, rank)

    def handle_drain(self, command: DrainNode, rank: int) -> str:
        return self.commands.drain(command, rank)

    def handle_resume(self, command: Rollback | ResumeFrom, rank: int) -> str:
        return self.commands.resume_from(command, rank)

    def handle_pause(self, command: PauseRun, rank: int) -> str:
        return self.commands.pause(command, rank)

    def handle_skip(self, command: SkipUpdate, rank: int) -> str:
        return self.commands.skip(command, rank)

    def handle_release(self, command: ReleaseNode, rank: int) -> str:
        return self.commands.release(command, rank)

    def handle_self_test(self, command: RunNodeSelfTest, rank: int) -> str:
        return self.commands.self_test(command, rank)

    def handle_interval(self, command: SetCheckpointInterval, rank: int) -> str:
        return self.commands.interval(command, rank)

    # ------------------------------------------------------------------ main loop
    def run(self) -> LaunchResult:
        result = LaunchResult("failed", "", 0)
        state = self.state
        try:
            # The fork server first: a spare's self-test forks its workers from it.
            self.attempts.prewarm(self.config.ranks_per_node if self.config.rendezvous else self.config.nproc)
            # A restart onto a proven spare waits for nothing. Across hosts the spares are
            # agents of their own (--spare), each proving its host while it waits (world.py).
            if self.config.self_test_spares == "ahead" and self.config.rendezvous is None:
                threading.Thread(target=self.spares.pretest, name="selftest-spares", daemon=True).start()
            self._run(result)
        finally:
            state.ended.set()  # a node still waiting for its self-test is free now
            self.attempts.close()
            self.world.close(clean=result.status == "ok")
            # A suspect node's verdict is worth waiting for; not after a stop.
            self.tester.close(0.0 if state.stop.is_set() else self.config.self_test_timeout_s)
        # A clean end: a later launcher on this run dir starts a new session (and budget).
        self.journal.append("session", status=result.status, reason=result.reason[:500])
        return result

    def _run(self, result: LaunchResult) -> None:
        state, cfg = self.state, self.config
        pending: RestartPhases | None = None
        restarts = 0
        reuse: AttemptRecord | None = None
        try:
            self.lemons.keep_out()  # a relaunch too: the journaled ones, and any new
        except NoWorld as no:
            result.status, result.reason = no.status, no.reason
            return
        self.restarts.record_unrecorded(state.replayed, result)
        if state.resuming:
            recovered = self.recovery.recover(result)
            if recovered is None:
                return
            pending, restarts, reuse = recovered
        first = True
        while True:
            if self._paused(result, pending):
                break
            self.world.size = self._size(pending)
            try:
                world = self.world.form(first, reuse)
            except NoWorld as no:
                if no.after_interruption:
                    if pending is not None:
                        self.restarts.finish(pending, result)
                    log.info("%s", no.reason)  # the CLI's last line says it, once
                result.status, result.reason = no.status, no.reason
                break
            first, reuse = False, None
            if pending is None and world.called is not None:  # a spare: its share of the interruption
                pending = self._called(world.called)
            if pending is not None:
                pending.world_size = world.placement.world_size
                self._resized_across_hosts(pending, world)
            if pending is not None and world.left:
                pending.hosts_lost = sorted(world.left)
                pending.replaced_by = {
                    old: new for old, new in world.placement.moved.values() if old in world.left
                }
                pending.detail = headline(pending)[:500]
            self.story.world(world, pending, self.run_dir, self.attempts.reports)
            self.journal.append(
                "attempt",
                attempt=world.attempt,
                resume=world.resume,
                nodes=list(world.placement.nodes),
                world_size=world.placement.world_size,
                ranks=list(world.local_ranks),
                interruption=pending.interruption if pending is not None else None,
            )
            kill_at(cfg.fault, "before-spawn", state.attempt)
            if self.on_attempt is not None:
                self.on_attempt(state.attempt)
            result.attempts += 1
            end, interruption = self.attempts.run(world, pending, result)
            same_startup = self.startup.after_attempt(
                world, interruption, result.exits, self.attempts.reports
            )
            self.journal.append(
                "ended",
                attempt=state.attempt,
                end=end,
                exits=[
                    [e.rank, e.returncode, e.requested] for e in result.exits if e.attempt == state.attempt
                ],
            )
            if end == "restart":
                kill_at(cfg.fault, "after-teardown", state.attempt)
            if interruption is not None and interruption.cause is RestartCause.DRAIN:
                self.commands.published()  # across hosts: the drained host on the shared list
            if pending is not None:
                self.restarts.finish(pending, result)
                pending = None
            if end == "ok":
                result.status, result.reason = "ok", f"all {world.placement.world_size} ranks exited 0"
                break
            if end == "stopped":
                result.status, result.reason = "stopped", "the launcher was stopped"
                if interruption is not None:
                    self.restarts.finish(interruption, result)
                break
            assert interruption is not None
            if self._paused(result, interruption):
                break
            if same_startup is not None:  # before max_restarts: the more useful reason
                self.restarts.pause(interruption, same_startup, result)
                break
            if restarts >= cfg.max_restarts:
                self.restarts.give_up(interruption, restarts, result)
                break
            restarts += 1
            if self._survivors_go_on(interruption):
                pass  # elastic, across hosts: a host was lost and the others go on at once
            elif self._waits_for_decisions(interruption) and self._await_decisions(interruption):
                self.restarts.finish(interruption, result)
                result.status, result.reason = "stopped", "the launcher was stopped"
                break
            pending = interruption

    def _size(self, pending: RestartPhases | None) -> int | None:
        """Elastic training (elastic.py): the next world's size after an in-process
        interruption, the decision in its record when the world changes size."""
        hot = self.attempts.hot
        last = self.state.placement
        if pending is None or pending.path != "in-process" or hot is None or not self.config.elastic:
            return None
        if self.config.rendezvous is not None:  # across hosts the hosts that go on size it
            return None
        with self.state.lock:
            capacity = self.state.capacity.get(pending.from_attempt)
            out = set(self.state.quarantined)
        # a survivor on a node taken out (a drained node's ranks, alive) goes on nowhere
        survivors = [r for r in hot.survivors() if last is None or last.node_of(r) not in out]
        unanswered = "no decision from the processor"
        if pending.cause is RestartCause.DRAIN:  # planned: the core decides no capacity for it
            unanswered = f"{pending.node} drained and too few warm spares ready for its ranks"
        sizing = next_size(self.config, len(survivors), hot.ready(), capacity, unanswered)
        before = last.world_size if last is not None else self.config.nproc
        if sizing.size != before:
            pending.decision = "shrink" if sizing.size < before else "grow"
            pending.decision_reason = sizing.reason[:500]
            log.warning("trainguard: %s -> %s", before, sizing.text)
        return sizing.size

    def _survivors_go_on(self, interruption: RestartPhases) -> bool:
        """Elastic training across hosts: after this host's ranks lost a peer (they wait in
        their processes), the survivors' roll call (roll_call.py). True: some host did not
        answer and the others go on at once in a smaller world, without a rendezvous round
        or the decision wait (the processor names a lost host only once the next world
        starts). False: the restart goes on as before (a round, after the decision wait)."""
        world, cfg = self.world, self.config
        if not (isinstance(world, HostWorld) and cfg.elastic and interruption.path == "in-process"):
            return False
        if interruption.cause is not RestartCause.CRASH:
            return False
        with self.state.lock:
            wait = self.state.capacity.get(interruption.from_attempt) == "wait"
        return world.roll_call(interruption.from_attempt, wait)

    def _resized_across_hosts(self, pending: RestartPhases, world: World) -> None:
        """Elastic training across hosts: a world of another size than the last one says
        so in the restart's record (one host: _size)."""
        before = world.before
        if not self.config.elastic or world.nodes_waiting is None or before is None:
            return
        size, was = world.placement.world_size, before.world_size
        if size == was:
            return
        spec = self.config.rendezvous
        assert spec is not None
        hosts = f"{len(world.placement.nodes)} of {spec.max_nodes} hosts"
        if size < was:
            lost = ", ".join(h for h in before.nodes if h not in world.placement.nodes)
            pending.decision = "shrink"
            pending.decision_reason = (
                f"{lost} lost and no host ready to take its place: {hosts} go on in their processes "
                f"({size} of {self.config.nproc} ranks); the world grows back when a host joins"
            )[:500]
        else:
            pending.decision = "grow"
            pending.decision_reason = f"a host joined: {hosts}, {size} ranks"[:500]
        log.warning("trainguard: world %d -> %d: %s", was, size, pending.decision_reason)

    def _called(self, called: SpareCall) -> RestartPhases:
        """A spare agent joins in a lost host's place: the interruption its ranks restart
        after, from that host's last beat (its R is measured and recorded as a survivor's)."""
        lost = sorted(called.lost)
        detail = "; ".join(called.lost[host].removeprefix("host lost: ") for host in lost)
        return self.restarts.interruption(
            RestartCause.HOST_LOST, detail, called.attempt, called.fault_ts, called.detected_ts, node=lost[0]
        )

    def _waits_for_decisions(self, interruption: RestartPhases) -> bool:
        """After a crash, the processor's decisions about it get decision_wait_s before the
        restart. Across hosts after any interruption but a host joining: the world re-forms
        at once when every host is back in the round, so a host that the processor
        quarantines for this attempt (a hang's culprit) must know it before it rejoins."""
        if interruption.cause in (RestartCause.RESIZE, RestartCause.DRAIN):  # planned: nothing to decide
            return False
        if self.config.rendezvous is not None:
            return interruption.cause is not RestartCause.MEMBERSHIP
        if interruption.path == "in-process":  # a hang's culprit is quarantined before the placement
            return interruption.cause in (RestartCause.CRASH, RestartCause.ABORT)
        return interruption.cause is RestartCause.CRASH

    def _await_decisions(self, interruption: RestartPhases) -> bool:
        """Until the processor's InterruptionDecided for the interrupted attempt arrives, or
        decision_wait_s for a processor that does not answer. True: stopped meanwhile."""
        state = self.state
        deadline = time.monotonic() + self.config.decision_wait_s
        while time.monotonic() < deadline:
            with state.lock:
                if interruption.from_attempt in state.decided:
                    return False
            if state.stop.wait(0.01):
                return True
        return state.stop.is_set()

    def _paused(self, result: LaunchResult, interruption: RestartPhases | None) -> bool:
        """A PauseRun is in force: end the run "paused" with its reason (the interruption
        that ended the last attempt is recorded, with no attempt after it)."""
        with self.state.lock:
            pause = self.state.pause
        if pause is None:
            return False
        if interruption is not None:
            self.restarts.finish(interruption, result)
        info = pause.get("pause") or {}
        result.status = "paused"
        result.reason = (
            f"paused at step {info.get('step', -1)} by {pause.get('key', '?')}: {info.get('reason', '')}"
        )
        return True
