"""Each interruption of the run, from its decision to its record in ``restarts.jsonl``,
with the restart measured phase by phase.

Per interruption (see :class:`~.records.RestartPhases`): detect (fault to the launcher
noticing: the last poll that saw the rank alive to the poll that saw it gone, for a
crash; the command's issued_ts to its arrival, for a command), reschedule (noticing to
the new processes being spawned: teardown, decision wait, placement), and from the
per-rank file ``<run_dir>/attempt-N/rank-R.phases.json`` written by the rank-side
Supervisor (path in TRAINGUARD_PHASES_FILE): process start (spawn to the slowest rank's
``start_ts``), checkpoint load and process-group init (slowest rank's
``checkpoint_load_s`` / ``pg_init_s``), first step (the slowest rank's
``first_step_ts − start_ts − load − init``) and ``restart_s`` (fault to the last rank's
first step: the R of seed §6). Records go to ``<run_dir>/restarts.jsonl`` and
:attr:`LaunchResult.restarts`, and out as a RestartPhases event. The same file may carry
``last_step``, ``stack_dump_ref`` and ``stack_signature``, which the launcher copies into
RankExit.

An interruption is journaled (under its idempotency key: the command's id, else
``<cause>:<attempt>``) before the teardown it causes; its "done" is its line in
restarts.jsonl, written once, by this launcher or by a successor (:meth:`rebuilt`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from ...schemas import RUN_LEVEL_RANK
from ..chaos import kill_at
from .config import LauncherConfig
from .events import LauncherEvents
from .journal import ActionJournal, JournalState, replay
from .records import LaunchResult, RestartCause, RestartPhases, collect_phases, restart_indices


class RestartRecorder:
    def __init__(
        self,
        config: LauncherConfig,
        run_dir: Path,
        journal: ActionJournal,
        events: LauncherEvents,
        replayed: JournalState,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.journal = journal
        self.events = events
        self._file = run_dir / "restarts.jsonl"
        #: Set while no restart is in progress: cleared at an interruption, set again once
        #: the attempt after it completed its first step (or ended). Work that would only
        #: slow a restart (a quarantined node's self-test: spares.py) waits for it.
        self.settled = threading.Event()
        self.settled.set()
        self.recorded = restart_indices(self._file)  # interruptions in restarts.jsonl
        self._next = max(max(replayed.interruptions, default=-1) + 1, max(self.recorded, default=-1) + 1)
        #: attempt -> the ranks this launcher ran in it (whose phase files it reads).
        self._ranks: dict[int, Sequence[int]] = {
            a.attempt: a.ranks for a in replayed.attempts.values() if a.ranks is not None
        }

    def interruption(
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
        self._next += 1
        rec = RestartPhases(
            run_id=self.config.run_id,
            interruption=self._next - 1,
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
        kill_at(self.config.fault, "after-interruption", attempt)
        self.settled.clear()
        return rec

    def spawned(
        self, rec: RestartPhases, attempt: int, spawn_ts: float, resume: int, ranks: Sequence[int]
    ) -> None:
        """The attempt after `rec` is spawned, with `ranks` here: reschedule ends."""
        self._ranks[attempt] = ranks
        rec.to_attempt, rec.spawn_ts, rec.resumed_from_step = attempt, spawn_ts, resume
        rec.reschedule_s = spawn_ts - rec.detected_ts

    def progress(self, rec: RestartPhases) -> None:
        """While the attempt after `rec` starts: read the ranks' phase files; once every
        rank completed its first step, publish the phases at once."""
        collect_phases(rec, self.run_dir, self._ranks_of(rec))
        if rec.complete:
            self.events.restart_phases(rec)
            self.settled.set()

    def finish(self, rec: RestartPhases, result: LaunchResult) -> None:
        """The attempt after `rec` ended (or none will start): record it, once."""
        collect_phases(rec, self.run_dir, self._ranks_of(rec))
        self.events.restart_phases(rec)
        self.settled.set()
        result.restarts.append(rec)
        if rec.interruption in self.recorded:  # a predecessor wrote it before it died
            return
        with self._file.open("a") as fh:
            fh.write(json.dumps(rec.to_json()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.recorded.add(rec.interruption)

    def give_up(self, rec: RestartPhases, restarts: int, result: LaunchResult) -> None:
        """`max_restarts` reached: `rec` is the run's last interruption; the run failed."""
        self.finish(rec, result)
        result.status = "failed"
        result.reason = f"{rec.cause} after {restarts} restarts (max_restarts): {rec.detail}"

    def pause(self, rec: RestartPhases, reason: str, result: LaunchResult) -> None:
        """The launcher's own pause (startup.py: the same start-up error again): `rec` is
        the run's last interruption, recorded with the decision; the run ends "paused"."""
        rec.decision, rec.decision_reason = "pause", reason[:2000]
        self.finish(rec, result)
        result.status, result.reason = "paused", reason

    def rebuilt(self, index: int) -> RestartPhases:
        """Interruption `index` from the journal, with the attempt started after it."""
        state = replay(self.journal.records)
        known = {f.name for f in dataclasses.fields(RestartPhases)}
        data = {k: v for k, v in state.interruptions[index]["record"].items() if k in known}
        rec = RestartPhases(**{**data, "cause": RestartCause(data["cause"])})
        nxt = next((a for a in state.attempts.values() if a.interruption == index), None)
        if nxt is not None and nxt.ranks is not None:
            self._ranks[nxt.attempt] = nxt.ranks
        if nxt is not None:
            rec.to_attempt, rec.resumed_from_step = nxt.attempt, nxt.resume
            if nxt.spawn_ts is not None:
                rec.spawn_ts, rec.reschedule_s = nxt.spawn_ts, nxt.spawn_ts - rec.detected_ts
        return rec

    def _ranks_of(self, rec: RestartPhases) -> Sequence[int]:
        attempt = rec.to_attempt
        return self._ranks.get(attempt, range(self.config.nproc)) if attempt is not None else ()

    def record_unrecorded(self, replayed: JournalState, result: LaunchResult) -> None:
        """Write the restarts.jsonl line of every journaled interruption whose next attempt
        was spawned but that a predecessor died before recording (its phases are in that
        attempt's files); the ones recorded already are not written again."""
        for index in sorted(replayed.interruptions):
            spawned = any(a.interruption == index and a.spawned for a in replayed.attempts.values())
            if spawned and index not in self.recorded:
                self.finish(self.rebuilt(index), result)
