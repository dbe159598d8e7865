"""Relaunch after a kill (issue 7, scenario 5): a launcher started on the run dir of one
that was SIGKILLed finishes the action in flight instead of repeating it.

Every action is journaled, fsynced, before it takes effect (:mod:`.journal`). The
successor reads it back and:

- ends the ranks the dead launcher left running (journaled pids, and any process whose
  environment names this run dir): normally none, since every rank dies with its launcher
  (:mod:`.agent_bound`), but a rank program's own children may be left, and an attempt
  whose pids were not journaled yet leaves no trace of having run (it is spawned again
  under its number); it keeps the quarantines and rollback barriers
  (:class:`~.run_state.LauncherState` is rebuilt from the journal);
- reports the interrupted attempt's RankExits again (same event ids: duplicates of those
  the predecessor shipped, and the ones it could not ship);
- gives the interrupted attempt's unacked commands ``decision_wait_s`` to be redelivered;
- completes the journaled interruption, or acts once on an Abort/Rollback the dead one had
  accepted, or records its death as an interruption of cause ``launcher`` when its ranks
  were running;
- spawns an attempt that was journaled but never spawned under its own number, and writes
  each interruption to restarts.jsonl once.

A command its actuator claimed but that the launcher never recorded (death in between)
was not executed and runs once when redelivered (:func:`~.wiring.make_actuator`). The
restart budget counts across relaunches until a clean end. ``TRAINGUARD_LAUNCHER_FAULT``
(:data:`..chaos.FAULT_POINTS`) kills the launcher at a named point, for the tests
(``tests/producers/launcher/test_launcher_restart.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from .context import LaunchContext
from .journal import AttemptRecord, JournalState, rank_processes
from .journal import terminate as terminate_orphans
from .plan import Placement
from .records import LaunchResult, RankEnd, RestartCause, RestartPhases
from .run_state import request_of

log = logging.getLogger(__name__)

#: (the interruption the next attempt restarts after, restarts of this session so far,
#: the journaled attempt to spawn again)
Recovered = tuple[RestartPhases | None, int, AttemptRecord | None]


class Recovery:
    def __init__(self, ctx: LaunchContext) -> None:
        self.ctx = ctx
        self.config, self.run_dir, self.pool, self.state = ctx.config, ctx.run_dir, ctx.pool, ctx.state
        self.resume, self.restarts, self.events, self.clock = ctx.resume, ctx.restarts, ctx.events, ctx.clock

    def recover(self, result: LaunchResult) -> Recovered | None:
        """The predecessor died with its last attempt in flight or between two attempts:
        end its ranks, then finish the restart it was in (the interruption it journaled,
        else one for the Abort/Rollback it had accepted, else one for its own death),
        without repeating anything journaled. None when the run ended here (stopped,
        max_restarts)."""
        run, cfg, restarts = self.state, self.config, self.restarts
        replayed = run.replayed
        last = replayed.last
        assert last is not None
        session_restarts = len(replayed.session_restarts)
        if len(last.nodes) == self.pool.slots(cfg.nproc):  # slot-stable placement across the relaunch
            run.placement = Placement(tuple(last.nodes), cfg.ranks_per_node, cfg.nproc, {})
        orphans = self._end_orphans(replayed)
        ran = last.spawned or last.attempt in orphans.values()
        if last.ended is None and not ran:
            # Journaled, never spawned: nothing of it ran, so it starts again under its number,
            # for the interruption it was journaled for (already counted as a restart).
            log.warning("recovery: attempt %d was never spawned; spawning it", last.attempt)
            pending = restarts.rebuilt(last.interruption) if last.interruption is not None else None
            return pending, session_restarts, last
        self._report_exits(last, result, lost=last.ended is None)
        if last.interruption is not None and last.interruption not in restarts.recorded:
            restarts.finish(restarts.rebuilt(last.interruption), result)  # the restart into `last`
        # The interrupted attempt's commands may still come (redelivered: not acked before
        # the death): give them the time a crash gives the processor's decisions.
        if run.stop.wait(cfg.decision_wait_s):
            result.status, result.reason = "stopped", "the launcher was stopped"
            return None
        interruption = self._interruption_of(last, len(orphans))
        if last.ended is None:
            run.journal.append("ended", attempt=last.attempt, end="lost", exits=[])
        with run.lock:  # a Rollback/ResumeFrom accepted but not taken: the next attempt resumes there
            untaken = run.untaken_resume()
            if untaken is not None:
                self.resume.take(request_of(untaken["request"]))
        run.attempt = last.attempt + 1
        if session_restarts >= cfg.max_restarts:
            restarts.give_up(interruption, session_restarts, result)
            return None
        return interruption, session_restarts + 1, None

    def _interruption_of(self, last: AttemptRecord, orphans: int) -> RestartPhases:
        """What ended `last`: the journaled interruption, else one for the command the
        predecessor had accepted but not acted upon, else one for its own death."""
        found = self.state.replayed.interruption_of(last.attempt)
        if found is not None:
            return self.restarts.rebuilt(int(found["index"]))
        with self.state.lock:
            accepted = self.state.pending_command(last.attempt)
        now = self.clock()
        if accepted is not None:  # executed before the death, never acted upon: act on it once
            req = accepted["request"]
            cause, detail, key = RestartCause(req["cause"]), str(req["detail"]), accepted["key"]
            fault_ts, detected_ts = float(req["issued_ts"]), float(req["received_ts"])
        else:
            cause, key = RestartCause.LAUNCHER, ""
            detail = f"the launcher died with attempt {last.attempt} running ({orphans} orphans ended)"
            fault_ts = detected_ts = now
        return self.restarts.interruption(cause, detail, last.attempt, fault_ts, detected_ts, command_id=key)

    def _end_orphans(self, replayed: JournalState) -> dict[int, int]:
        """pid -> attempt of the predecessor's ranks that were still running, now ended."""
        candidates = {
            pid: a.attempt for a in replayed.attempts.values() if a.ended is None for pid in a.pids.values()
        }
        found = rank_processes(self.run_dir, candidates)
        if found:
            log.warning("recovery: ending %d ranks a dead launcher left running: %s", len(found), found)
            left = terminate_orphans(sorted(found), max(1.0, self.config.term_timeout_s))
            self.state.journal.append("orphans", pids={str(p): a for p, a in found.items()}, left=left)
        return found

    def _report_exits(self, att: AttemptRecord, result: LaunchResult, lost: bool) -> None:
        """The attempt's RankExits again: as journaled, or requested exits of unknown
        status for an attempt whose ranks the successor ended."""
        world = att.world_size if att.world_size is not None else self.config.nproc
        ranks = att.ranks if att.ranks is not None else list(range(world))
        placement = Placement(tuple(att.nodes), self.config.ranks_per_node, world, {})
        now = self.clock()
        ends: list[RankEnd]
        if lost:
            ends = [RankEnd(att.attempt, r, placement.node_of(r), None, now, True) for r in ranks]
        else:
            ended: dict[str, Any] = next(
                (
                    r
                    for r in reversed(self.state.journal.records)
                    if r["op"] == "ended" and r["attempt"] == att.attempt
                ),
                {},
            )
            ends = [
                RankEnd(att.attempt, rank, placement.node_of(rank), rc, now, bool(requested))
                for rank, rc, requested in ended.get("exits", [])
            ]
        for end in ends:
            result.exits.append(end)
            self.events.rank_exit(end, ranks)
