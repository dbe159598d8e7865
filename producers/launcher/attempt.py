"""One attempt: spawn the ranks, watch them until the attempt ends, tear them down.

The rank processes are started, watched and torn down by torch elastic's process layer,
:func:`torch.distributed.elastic.multiprocessing.start_processes` (the ``PContext`` that
``LocalElasticAgent`` and therefore ``torchrun`` use): one process per rank in its own
session, per-rank environments (:mod:`.rank_env`), ``close(SIGTERM)`` that escalates to
SIGKILL for stragglers and gives up on an unkillable (D-state) process instead of
wedging.

What ends an attempt, checked every ``poll_s``:

- every rank exited 0: the run is done ("ok");
- a rank ended on its own with a non-zero status (SIGKILL, an exception): a synchronous
  job cannot continue, so the group is torn down at once (a crash interruption, the
  killed rank named as its cause when several died); when a rank's error comes before
  any rank completed a step, the others get ``startup_settle_s`` to end on their own
  first, so that the same error elsewhere is seen (:mod:`.startup`);
- the launcher was stopped ("stopped": exits reported requested);
- a PauseRun, a Rollback/ResumeFrom (teardown now), an Abort (the ranks get ``grace_s``
  to dump their stacks and leave on their own, then the teardown), or an EvictRank once
  a checkpoint newer than the one at the command is validated;
- a DrainNode (:mod:`.drain`): in process the ranks leave at a checkpoint boundary they
  agree on, in their processes; under full restarts as an EvictRank;
- across hosts, a host waiting to join (the world re-forms with it; under elastic training
  the ranks leave at a checkpoint boundary, in their processes) unless it is a spare come
  for a host of this world that stopped beating (that host's loss, a crash, whether or not
  the ranks here failed yet: :class:`.liveness.LossWatch`), or this host quarantined (it
  leaves the world).

Every exit after the decision to stop is reported ``requested=True``. The ranks' pids are
journaled once spawned. Each rank runs in a session of its own but dies with this
launcher (:mod:`.agent_bound`); a successor still ends by pid or environment whatever a
killed one left (:mod:`.recovery`).

Each rank's stdout and stderr go to its files, ``attempt-N/rank-R/{stdout,stderr}.log``
under the log root, beside torch elastic's error file (TORCHELASTIC_ERROR_FILE): what a
failed rank reported, for :mod:`.startup`; :mod:`.rank_output` copies their lines to the
console, prefixed by rank (torchrun's ``--tee``).

One file (past 600 lines): the watch (``_Watch``) reads and drives the runner's state on
every poll; apart, the two modules would import each other (a cycle, even for types).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ...schemas import RUN_LEVEL_RANK, RunStarted
from ..chaos import kill_at
from ..training.inprocess import RESIZED
from . import drain
from .agent_bound import bound
from .agent_store import AgentStores
from .config import free_port
from .context import LaunchContext
from .elastic import should_grow
from .fork_server import ForkServers, start_context
from .hot import HotRanks
from .import_env import omp_threads
from .journal import ENV_RUN_DIR
from .liveness import LossWatch
from .plan import Placement
from .rank_env import rank_env
from .rank_output import Console, Owner, RankLogsSpecs, RankOutput
from .records import LaunchResult, RankEnd, RestartCause, RestartPhases, closed_cleanly, peer_lost_of
from .startup import Reports, completed_a_step
from .story import ranks
from .world import World

#: While an eviction waits for a newer checkpoint, the location is listed at most this
#: often (the monitor loop runs every poll_s; on an object store each listing is requests).
POLL_LISTING_S = 0.5

log = logging.getLogger(__name__)

#: How the attempt ended: "ok", "restart" (an interruption), "stopped".
End = str


class AttemptRunner:
    def __init__(self, ctx: LaunchContext) -> None:
        self.ctx = ctx
        self.config, self.run_dir, self.pool, self.state = ctx.config, ctx.run_dir, ctx.pool, ctx.state
        self.resume, self.restarts, self.events, self.clock = ctx.resume, ctx.restarts, ctx.events, ctx.clock
        #: The ranks' lines on the console and in their files (--tee, --redirects).
        self.output = RankOutput(Console(self.config.tee, self.config.redirects))
        #: --preload: a Python command's ranks forked from a server that imported torch once
        #: (fork_server.py); without it, or for another command, each rank is a new process.
        self.forks = ForkServers(
            self.config.preload, self.config.command, {**os.environ, ENV_RUN_DIR: str(self.run_dir)}
        )
        #: --restart in-process: the processes that outlive attempts (hot.py).
        in_process = self.config.restart == "in-process"
        self.hot = HotRanks(self.config, self.run_dir, self.output, self.forks) if in_process else None
        self._placement: Placement | None = None  # the last attempt's
        #: The last attempt's ranks' error and stderr files (none under in-process restart).
        self.reports: Reports = {}
        self.stores = AgentStores(self.config.master_addr)  # the full restart's, one host (agent_store.py)

    def run(
        self, world: World, pending: RestartPhases | None, result: LaunchResult
    ) -> tuple[End, RestartPhases | None]:
        """Attempt `world.attempt`: this launcher's ranks of it, from checkpoint
        `world.resume`; `pending` is the interruption it restarts after (its phases are
        measured as the ranks start)."""
        cfg, attempt, placement, resume = self.config, world.attempt, world.placement, world.resume
        agent_store = self.hot is None and world.master_port is None
        if agent_store:  # one host, full restarts: this launcher serves the attempt's store
            port = self.stores.port(attempt)
        elif self.hot is not None and world.master_port is not None:  # across hosts in process: the
            port, agent_store = world.master_port, True  # first host's agent serves the store it proposed
            if not self.hot.stores.keep(attempt, port) and placement.nodes[0] == cfg.node:
                raise RuntimeError(f"attempt {attempt}: this host's store at port {port} is not served")
        else:  # across hosts rank 0 serves it at the agreed port; in process, hot.py's store
            port = world.master_port if world.master_port is not None else free_port(cfg.master_addr)
        (self.run_dir / f"attempt-{attempt}").mkdir(parents=True, exist_ok=True)
        envs = {r: self._env(r, world, port, agent_store) for r in world.local_ranks}
        self.events.emit(
            RunStarted,
            RUN_LEVEL_RANK,
            "",
            resume,
            key=f"run-started-{attempt}",
            shared=world.nodes_waiting is not None,  # across hosts: one event, sent by each
            world_size=placement.world_size,
            ranks_per_node=placement.ranks_per_node,
            nodes=list(placement.nodes),
            racks={node: self.pool.racks.get(node, "") for node in placement.nodes},
            resumed_from_step=resume,
            spares=self._spares(placement),
        )
        self.events.ship_soon()  # ahead of the ranks' first steps: the core's view of the attempt
        log.info("attempt %d: ranks %s of %d on %s, resume step %d", attempt, list(world.local_ranks),
                 placement.world_size, placement.nodes, resume)  # fmt: skip
        spawn_ts = self.clock()
        ctx: Any
        self.reports = {}
        if self.hot is not None:
            ctx = self._hot_start(world, envs, pending)
            procs = ctx.procs
        else:
            ctx = self._spawn(attempt, [envs[r] for r in world.local_ranks])
            # torch elastic numbers a host's processes 0..n-1 (its local ranks): map them back.
            procs = {world.local_ranks[i]: h.proc for i, h in ctx.subprocess_handlers.items()}
            self.reports = {
                world.local_ranks[i]: (_file(ctx.error_files.get(i)), _file(ctx.stderrs.get(i)))
                for i in ctx.subprocess_handlers
            }
        self._placement = placement
        kill_at(cfg.fault, "mid-spawn", attempt)
        self.state.journal.append(
            "spawned", attempt=attempt, pids={str(r): p.pid for r, p in procs.items()}, spawn_ts=spawn_ts
        )
        kill_at(cfg.fault, "after-spawn", attempt)
        if pending is not None:
            self.restarts.spawned(pending, attempt, spawn_ts, resume, world.local_ranks)
            pending.rendezvous_s = world.rendezvous_s
        watch = _Watch(self, ctx, procs, world, result)
        try:
            interruption = watch.until_end(spawn_ts, pending)
        except BaseException:
            watch.teardown()
            raise
        finally:
            if not watch.held:  # in process, the survivors wait for the next attempt
                ctx.close(signal.SIGKILL, timeout=1)  # no-op when all are gone; frees the log files
            if self.hot is None:  # the attempt's last lines on the console before what follows
                self.output.drain(Path(p) for p in (*ctx.stdouts.values(), *ctx.stderrs.values()))
            self.state.busy = frozenset()  # a node left by this attempt may be self-tested now
        stopped = self.state.stop.is_set()
        if interruption is not None:
            return ("stopped" if stopped else "restart"), interruption
        return ("stopped" if stopped else "ok"), None

    def _hot_start(
        self, world: World, envs: dict[int, dict[str, str]], pending: RestartPhases | None
    ) -> _HotGroup:
        """In-process restart: the survivors of `pending` (held by the watch) go on in their
        processes unless their node changed (a quarantine moved them: ended, replaced);
        the others are new or warm spares."""
        assert self.hot is not None
        in_process = pending is not None and pending.path == "in-process"
        last = self._placement
        resized = last is not None and last.world_size != world.placement.world_size
        if in_process and last is not None and resized and self.config.elastic:
            self._renumber(last, world)  # a smaller world, or grown back
        elif in_process and last is not None:  # a survivor keeps its rank only on its node, in a
            moved = [  # world of the same size
                r
                for r in self.hot.survivors()
                if resized or r not in envs or last.node_of(r) != world.placement.node_of(r)
            ]
            self.hot.kill(moved)
        if self.config.elastic and world.nodes_waiting is None:  # one host: the processes to grow
            self.hot.missing = self.config.nproc - world.placement.world_size  # back with start now
        if in_process and not self.hot.survivors():
            assert pending is not None
            pending.path = "full"  # nobody left to go on: every process is new
            in_process = False
        procs = self.hot.start(world.attempt, envs, in_process, world.shared_store)
        if pending is not None and in_process:
            pending.warm_ranks, pending.new_ranks = self.hot.taken["warm"], self.hot.taken["new"]
        return _HotGroup(self.hot, procs)

    def _spares(self, placement: Placement) -> int | None:
        """What RunStarted says of the spares ready (the core decides about lost capacity
        only beyond them): under elastic training on one host, the warm spares ready;
        otherwise on one host the pool's healthy nodes this attempt leaves free; across
        hosts None (not said: each host knows only its own, and the event is the same from
        every host)."""
        if self.config.rendezvous is not None:
            return None
        if self.config.elastic and self.hot is not None:
            return self.hot.ready()
        with self.state.lock:
            out = set(self.state.quarantined)
        return sum(1 for node in self.pool.nodes if node not in out and node not in placement.nodes)

    def _renumber(self, last: Placement, world: World) -> None:
        """Elastic training: the survivors (on nodes still in the pool) take this launcher's
        ranks of the new world (one host: its first ranks; across hosts: this host's) in
        their old order; its other ranks go to warm spares (hot.start)."""
        assert self.hot is not None
        with self.state.lock:
            out = set(self.state.quarantined)
        keep = [r for r in self.hot.survivors() if last.node_of(r) not in out]
        self.hot.renumber(dict(zip(keep, world.local_ranks, strict=False)))

    def prewarm(self, ranks: int) -> None:
        """Start importing now, while the world forms (across hosts: a spare host's wait):
        in-process restart, the first attempt's `ranks` workers and the warm spares; full
        restarts, the fork server."""
        if self.hot is not None:
            self.hot.top_up(ranks)
        else:
            self.forks.get(omp_threads(ranks))

    def close(self) -> None:
        """The run is over: what is left of its processes ends (survivors held for an
        attempt that never came, the warm spares)."""
        if self.hot is not None:
            self.hot.close(signal.SIGTERM, self.config.term_timeout_s)
        self.forks.close()
        self.output.close()

    def _spawn(self, attempt: int, envs: list[dict[str, str]]) -> Any:
        """One process per environment (in local-rank order), each in a session of its own
        and bound to this launcher (agent_bound.py), its streams to its rank's files."""
        from torch.distributed.elastic.multiprocessing import Std
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext

        cfg = self.config
        # PContext.start() installs torch elastic's own SIGINT/SIGTERM handlers (raising
        # SignalException); keep ours (stop(): a clean teardown and status "stopped").
        main = threading.current_thread() is threading.main_thread()
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        program = bound(cfg.command)
        spec: dict[str, Any] = {
            "name": f"trainguard-{cfg.run_id}-{attempt}",
            "entrypoint": program[0],
            "args": {i: tuple(program[1:]) for i in range(len(envs))},
            "envs": dict(enumerate(envs)),
            "logs_specs": RankLogsSpecs(cfg.log_root),  # both streams to files; RankOutput shows them
        }
        try:
            ctx = start_context(self.forks, spec)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        assert isinstance(ctx, SubprocessContext)  # a str entrypoint: one binary per rank
        for i, env in enumerate(envs):
            owner = Owner(f"rank{env['RANK']}", int(env["LOCAL_RANK"]))
            self.output.follow(Path(ctx.stdouts[i]), Std.OUT, owner)
            self.output.follow(Path(ctx.stderrs[i]), Std.ERR, owner)
        return ctx

    def _env(self, rank: int, world: World, port: int, agent_store: bool = False) -> dict[str, str]:
        with self.state.lock:  # the actuator thread may be adding one
            skips = sorted(self.state.skip_batches)
            interval = self.state.checkpoint_interval_s
        return rank_env(
            self.config,
            self.run_dir,
            world.attempt,
            rank,
            world.placement,
            world.resume,
            port,
            skips,
            interval,
            world.master_addr,
            agent_store,
        )


def _file(path: str | None) -> Path | None:
    """A log path of torch elastic's (None: '' for the console, or os.devnull)."""
    return Path(path) if path and path != os.devnull else None


class _HotGroup:
    """An attempt's processes under in-process restart, as the watch drives them."""

    def __init__(self, hot: HotRanks, procs: dict[int, Any]) -> None:
        self.hot, self.procs = hot, procs

    def close(self, sig: signal.Signals, timeout: float) -> None:
        """Tear the attempt down: its rank processes (the spares stay; a rank already ended
        is not in hot.procs any more)."""
        self.hot.end(list(self.procs), sig, timeout)


class _Watch:
    """The live ranks of one attempt, polled until the attempt ends."""

    def __init__(
        self,
        runner: AttemptRunner,
        ctx: Any,
        procs: dict[int, Any],
        world: World,
        result: LaunchResult,
    ) -> None:
        self.runner = runner
        self.ctx = ctx
        self.procs = procs
        self.world = world
        self.placement = world.placement
        self.attempt = world.attempt
        self.result = result
        self.live = set(procs)
        self.stopping = False  # exits from now on are requested
        self.held = False  # in-process restart: the survivors were kept for the next attempt
        self.watch: LossWatch | None = None  # across hosts, while a host waits to join
        self.dying: set[int] = set()  # ranks that noted a lost peer: their ends are their own

    def until_end(self, spawn_ts: float, pending: RestartPhases | None) -> RestartPhases | None:
        """Poll until every rank is gone; the interruption that ended the attempt, if any."""
        runner, state, cfg = self.runner, self.runner.state, self.runner.config
        attempt, placement = self.attempt, self.placement
        last_poll = spawn_ts
        grace_until: float | None = None
        interruption: RestartPhases | None = None
        next_phases = next_membership = 0.0
        grow_asked = False
        while self.live:
            now = runner.clock()
            crashed = [(r, rc) for r, rc in self.reap(now) if rc != 0]
            if crashed and not self.stopping and interruption is None:
                # the killed one is the cause, else one that did not die of a lost peer
                lost = {r: why for r, _ in crashed if (why := peer_lost_of(runner.run_dir, attempt, r))}
                own = [c for c in crashed if c[0] not in lost]
                r, rc = ([c for c in crashed if c[1] < 0] or own or crashed)[0]
                detail = f"rank {r} exited {rc}" + (f" (lost a peer: {lost[r]})" if r in lost else "")
                interruption = runner.restarts.interruption(
                    RestartCause.CRASH, detail, attempt, last_poll, now,
                    rank=r, node=placement.node_of(r), returncode=rc,
                )  # fmt: skip
                if rc > 0 and self.live and runner.hot is None and not state.stop.is_set():
                    self._settle_startup()
                if runner.hot is not None and self.live and not state.stop.is_set():
                    # the survivors' collectives fail: they wait in the store (hot.py)
                    interruption.path = "in-process"
                    self.held = True
                    runner.hot.abort(attempt)  # a survivor waiting on another survivor gives up
                    break
                self.teardown()
                break
            last_poll = now
            if not self.live:
                break
            if runner.hot is not None and interruption is None and not state.stop.is_set():
                interruption = self._left_alive(now)
                if interruption is not None:
                    break
                drain.ask(runner.hot, state, attempt, runner.clock, runner.events.story)
                if not grow_asked and should_grow(cfg, placement.world_size, runner.hot.ready()):
                    grow_asked = True  # the ranks checkpoint at a step they agree on, then leave
                    log.warning("attempt %d: spares ready: the world of %d grows back to %d at a "
                                "checkpoint boundary", attempt, placement.world_size, cfg.nproc)  # fmt: skip
                    runner.hot.resize(attempt)
            if state.stop.is_set():
                self.teardown()
                break
            if runner.hot is None and interruption is None:  # full restarts: the eviction path
                interruption = drain.due_in_full(runner.restarts, runner.resume, state, attempt, now)
                if interruption is not None:
                    self.teardown()
                    break
            with state.lock:
                request, evict, pause = state.request, state.evict, state.pause
            if pause is not None and interruption is None:
                interruption = runner.restarts.interruption(
                    RestartCause.PAUSE, str((pause.get("pause") or {}).get("reason", ""))[:500], attempt,
                    float(pause.get("ts", now)), now, command_id=str(pause.get("key", "")),
                )  # fmt: skip
                self.teardown()
                break
            if (
                interruption is None
                and evict is not None
                and runner.resume.newest(max_age_s=POLL_LISTING_S)
                > (evict.evict_after_step if evict.evict_after_step is not None else -1)
            ):
                request = evict
                with state.lock:
                    state.request = evict
            if interruption is None and request is not None and request.cause is RestartCause.ABORT:
                interruption = self._dying_of_a_lost_peer(now)  # the fault came first
                if interruption is not None:
                    self.teardown()
                    break
            if interruption is None and request is not None:
                interruption = runner.restarts.interruption(
                    request.cause, request.detail, attempt, request.issued_ts, request.received_ts,
                    command_id=request.command_id,
                )  # fmt: skip
                self.stopping = True
                if request.resume_step is not None:
                    with state.lock:
                        runner.resume.take(request)
                if request.cause is RestartCause.ABORT and self._end_culprits(interruption):
                    break  # in process: the stuck ranks are ended, the others wait for the next attempt
                if request.cause is RestartCause.ABORT:
                    grace_until = now + cfg.grace_s
                else:
                    self.teardown()
                    break
            if grace_until is not None and now >= grace_until:
                self.teardown()
                break
            if interruption is None and self.world.nodes_waiting is not None and self._quarantined():
                # a safety net: the decision wait normally lets the quarantine arrive first
                why = f"{cfg.node} is quarantined: it leaves the world"
                interruption = runner.restarts.interruption(RestartCause.QUARANTINED, why, attempt, now, now)
                self.teardown()
                break
            if interruption is None and self.world.nodes_waiting is not None and now >= next_membership:
                next_membership = now + 1.0
                waiting = 0 if grow_asked else self.world.nodes_waiting()
                if waiting > 0 and cfg.elastic and runner.hot is not None:  # the ranks leave at a
                    grow_asked = True  # checkpoint boundary, in their processes (_resized)
                    runner.hot.resize(attempt)
                    if runner.events.story is not None:
                        runner.events.story.say(
                            f"{waiting} host(s) waiting to join: attempt {attempt}'s world of "
                            f"{placement.world_size} ranks grows at its next checkpoint"
                        )
                elif waiting > 0:  # a host joins below MAX (the world re-forms with it), or a
                    # spare came for a host of this world lost: the loss is the cause
                    interruption = self._joined_or_lost(waiting, now)
                    if interruption is not None:
                        self.teardown()
                        break
                else:
                    self.watch = None
            if pending is not None and not pending.complete and now >= next_phases:
                next_phases = now + 0.5
                runner.restarts.progress(pending)
            time.sleep(cfg.poll_s)
        return interruption

    def _joined_or_lost(self, waiting: int, now: float) -> RestartPhases | None:
        """A host waits to join: a membership change once this world's other hosts beat
        through the watch; a crash, the lost host's, when one stopped (the ranks' own crash,
        if first, is taken by the poll). None while watching (liveness.LossWatch)."""
        runner, cfg = self.runner, self.runner.config
        if self.watch is None:
            self.watch = LossWatch(cfg.shared_dir, set(self.placement.nodes) - {cfg.node}, cfg.host_stale_s)
        if (lost := self.watch.lost()) is None:
            return None
        if not lost:
            why = f"{waiting} host(s) waiting to join"
            return runner.restarts.interruption(RestartCause.MEMBERSHIP, why, self.attempt, now, now)
        host, quiet = max(lost.items(), key=lambda item: item[1])
        ended = f"{ranks(sorted(self.live))} ended by the agent" if self.live else "no rank left here"
        why = f"{ended} (lost a peer: {host} stopped beating {quiet:.1f} s ago)"
        return runner.restarts.interruption(
            RestartCause.CRASH, why, self.attempt, now - quiet, now, node=host
        )

    def _dying_of_a_lost_peer(self, now: float) -> RestartPhases | None:
        """Full restarts, an Abort arrives: a rank here noted that it is dying of a lost peer
        (its error, in its phases file: training/exit_hooks.py) and has not exited yet (its
        telemetry's flush at exit, the interpreter's teardown: seconds on a loaded machine).
        The processor saw the stall that the lost peer caused as a hang: the crash came
        first and is the cause (a lost host's survivors say so, not "abort"), and the dying
        ranks' ends are their own (their RankExits: a lost peer's evidence). Not before a
        step: a failed start-up is read as a whole (_settle_startup)."""
        run_dir, attempt = self.runner.run_dir, self.attempt
        if self.runner.hot is not None or not completed_a_step(run_dir, attempt, self.world.local_ranks):
            return None
        noted = {r: why for r in sorted(self.live) if (why := peer_lost_of(run_dir, attempt, r))}
        if not noted or any(self.procs[r].poll() is not None for r in self.live):
            return None  # a rank here ended: the next poll judges whose crash it was
        self.dying = set(noted)
        r = min(noted)
        return self.runner.restarts.interruption(
            RestartCause.CRASH, f"rank {r} is ending (lost a peer: {noted[r]})", attempt, now, now,
            rank=r, node=self.placement.node_of(r),
        )  # fmt: skip

    def _settle_startup(self) -> None:
        """A rank raised before any rank completed a step: every rank runs the same
        start-up, so the others may raise the same error a moment later. They get
        ``startup_settle_s`` to end on their own (their exits not requested, their errors
        read by startup.py) before the teardown ends those still running (one blocked in a
        collective waits for the rank that failed, and is ended as before)."""
        runner = self.runner
        if completed_a_step(runner.run_dir, self.attempt, self.world.local_ranks):
            return
        deadline = time.monotonic() + runner.config.startup_settle_s
        while self.live and time.monotonic() < deadline and not runner.state.stop.is_set():
            time.sleep(runner.config.poll_s)
            self.reap(runner.clock())

    def _end_culprits(self, interruption: RestartPhases) -> bool:
        """In-process restart after an Abort with stack dumps (a hang): end only the ranks
        whose stack is the odd one out; the others' collectives then fail (or give up at
        the abort: inprocess.wait) and they wait for the next attempt. False: no rank
        stands out (or a full restart is configured): the attempt ends as before."""
        runner = self.runner
        if runner.hot is None or not self.live:
            return False
        world = list(range(self.placement.world_size))
        culprits = runner.hot.culprits(self.attempt, sorted(self.live), world, runner.config.grace_s)
        if not culprits or len(culprits) == len(world):
            return False
        mine = [r for r in culprits if r in self.live]  # across hosts, another host's may be it
        runner.hot.end(mine, signal.SIGKILL, runner.config.term_timeout_s)
        self.reap(runner.clock())  # the culprits' exits, requested
        interruption.path = "in-process"
        interruption.rank = culprits[0]
        interruption.node = self.placement.node_of(culprits[0])
        self.held = True
        runner.hot.abort(self.attempt)
        return True

    def _left_alive(self, now: float) -> RestartPhases | None:
        """In-process restart: ranks of this host that left the attempt alive (a lost peer:
        across hosts, a rank or a whole host lost elsewhere; or another host's agent ended
        the attempt). Each one's leaving is reported as its RankExit (exit code None,
        peer_lost: evidence about another rank, processors/core/detectors/peer_loss.py); the others
        here are told to give up, and all of them wait for the next attempt."""
        runner = self.runner
        assert runner.hot is not None
        runner.hot.aborted_elsewhere(self.attempt)  # its ranks here then leave as well
        left = runner.hot.left(self.attempt, sorted(self.live))
        if not left or any(self.procs[r].poll() is not None for r in self.live):
            return None  # a rank here died: the next poll takes it as the crash, the cause
        if any(why.startswith(RESIZED) for why in left.values()):
            return self._resized(left, now)
        rank = min(left)
        interruption = runner.restarts.interruption(
            RestartCause.CRASH, f"rank {rank} left the attempt alive (lost a peer: {left[rank]})",
            self.attempt, now, now, rank=rank, node=self.placement.node_of(rank),
        )  # fmt: skip
        interruption.path = "in-process"
        for r in sorted(left):
            self.live.discard(r)
            self.exit(RankEnd(self.attempt, r, self.placement.node_of(r), None, now, False, left=True))
        self.held = True
        runner.hot.abort(self.attempt)
        return interruption

    def _resized(self, left: dict[int, str], now: float) -> RestartPhases | None:
        """The ranks left at the checkpoint they agreed on for a resize (elastic training)
        or a drain (a planned change: requested exits, no lost peer), once all of them have."""
        runner = self.runner
        assert runner.hot is not None
        if len(left) < len(self.live):
            return None  # the others leave at the same step, a moment later
        full = runner.config.nproc
        why = f"spares ready for a world of {full}" if self.world.nodes_waiting is None else "a host joins"
        said = left[min(left)]
        interruption = drain.left_at_boundary(runner.restarts, runner.state, self.attempt, said, now)
        if interruption is None:
            interruption = runner.restarts.interruption(
                RestartCause.RESIZE, f"{said}: {why}", self.attempt, now, now
            )
        interruption.path = "in-process"
        for r in sorted(left):
            self.live.discard(r)
            self.exit(RankEnd(self.attempt, r, self.placement.node_of(r), None, now, True, left=True))
        self.held = True
        return interruption

    def _quarantined(self) -> bool:
        """Across hosts: this host was quarantined during the attempt (a QuarantineNode; a
        DrainNode's host leaves at the boundary instead)."""
        state, node = self.runner.state, self.runner.config.node
        with state.lock:
            return node in state.quarantined and not drain.draining(state, node)

    def reap(self, now: float) -> list[tuple[int, int]]:
        ended = []
        for r in sorted(self.live):
            if (rc := self.procs[r].poll()) is None:
                continue
            self.live.discard(r)
            teardown = None
            if rc < 0 and closed_cleanly(self.runner.run_dir, self.attempt, r):
                # Training was over: a backend thread still releasing a collective's
                # tensors when the interpreter finalizes aborts the process (pytorch#179291).
                teardown, rc = -rc, 0
                log.warning("rank %d: signal %d after its Supervisor closed with 0: clean", r, teardown)
            node, dying = self.placement.node_of(r), r in self.dying  # a dying rank's end is its own
            requested = self.stopping and not dying
            self.exit(
                RankEnd(self.attempt, r, node, rc, now, requested, teardown_signal=teardown, dying=dying)
            )
            ended.append((r, rc))
        return ended

    def teardown(self) -> None:
        self.stopping = True
        self.ctx.close(signal.SIGTERM, timeout=max(1, int(math.ceil(self.runner.config.term_timeout_s))))
        now = self.runner.clock()
        self.reap(now)
        for r in sorted(self.live):  # unkillable (D-state): abandoned by close()
            dying = r in self.dying
            self.exit(RankEnd(self.attempt, r, self.placement.node_of(r), None, now, not dying, dying=dying))
        self.live.clear()

    def exit(self, end: RankEnd) -> None:
        self.result.exits.append(end)
        self.runner.events.rank_exit(end, self.world.local_ranks)
