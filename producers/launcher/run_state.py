"""What the launcher's two threads share: the run's mutable state, under one lock, rebuilt
from the action journal when a launcher starts.

The actuator thread writes it (a command's effect: :mod:`.commands`); the main loop reads
it between polls and between attempts (:mod:`.launcher`, :mod:`.attempt`). Every effect
is journaled under the lock before it is applied (:meth:`LauncherState.record`), so a launcher
killed after the record has executed the command and its successor, replaying the
journal into a new LauncherState, applies it; one killed before has not, and its successor
runs it (:mod:`.journal`).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chaos import kill_at
from .journal import ActionJournal, JournalState, last_interval, replay
from .plan import Placement
from .records import RestartCause


@dataclass
class StopRequest:
    """A command that ends the running attempt (Abort, Rollback, ResumeFrom, EvictRank):
    what the restart after it needs."""

    cause: RestartCause
    command_id: str
    issued_ts: float
    received_ts: float
    detail: str
    resume_step: int | None = None
    evict_after_step: int | None = None


@dataclass
class DrainRequest:
    """DrainNode commands in force for one attempt (commands.py, drain.py): their nodes
    leave at the attempt's next checkpoint boundary, the cadence's or one taken by
    `deadline_ts` (the earliest of the commands' ``within_s`` after each arrived)."""

    attempt: int
    nodes: list[str]
    command_ids: list[str]
    issued_ts: float
    received_ts: float
    #: Wall clock: the latest the boundary may come (the launcher's clock).
    deadline_ts: float
    why: str
    #: Full restarts: the newest validated checkpoint at the command (the eviction path).
    after_step: int = -1
    #: The ranks were asked (hot.resize), with this deadline (a later drain asks again).
    asked_by: float | None = None


def request_of(data: dict[str, Any]) -> StopRequest:
    """A journaled request back (journal.py's ``command`` record)."""
    known = {f.name for f in dataclasses.fields(StopRequest)}
    fields = {k: v for k, v in data.items() if k in known}
    return StopRequest(**{**fields, "cause": RestartCause(fields["cause"])})


class LauncherState:
    """The run as both threads see it. Fields the actuator thread writes are read and
    written under `lock`."""

    def __init__(self, journal: ActionJournal, run_dir: Path, fault: str = "") -> None:
        self.journal = journal
        self.fault = fault
        #: The journal as this launcher found it (what a killed predecessor left).
        self.replayed: JournalState = replay(journal.records)
        state = self.replayed
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ended = threading.Event()  # the run is over: every node is free for its self-test
        self.quarantined: set[str] = set(state.quarantined)
        self.placement: Placement | None = None
        #: Nodes with live ranks of the running attempt (none between attempts).
        self.busy: frozenset[str] = frozenset()
        #: Executed commands by command_id (the journal's records): never executed twice.
        self.commands: dict[str, dict[str, Any]] = dict(state.commands)
        #: Rollback/ResumeFrom command ids whose resume step was taken.
        self.taken: set[str] = set(state.taken)
        #: Attempts whose interruption the processor has decided on (InterruptionDecided).
        self.decided: set[int] = set()
        #: Elastic training: the processor's choice for an attempt's lost capacity
        #: ("wait" or "shrink", InterruptionDecided.capacity).
        self.capacity: dict[int, str] = {}
        self.request: StopRequest | None = None  # ends the running attempt
        self.evict: StopRequest | None = None  # ends it at the next validated checkpoint
        #: DrainNode: the nodes leave at the running attempt's next checkpoint boundary.
        self.drain: DrainRequest | None = None
        self.forced_resume: int | None = None  # the next attempt's resume step, if named
        #: Steps whose batch every later attempt skips (SkipUpdate, journaled).
        self.skip_batches: set[int] = set(state.skip_batches)
        #: The last checkpoint interval the run was sent (SetCheckpointInterval, journaled).
        self.checkpoint_interval_s: float | None = last_interval(state.commands.values())
        #: A PauseRun in force (its journal record): no attempt starts while it is set.
        self.pause: dict[str, Any] | None = state.paused
        #: (step S, ts): checkpoints newer than S validated before ts are excluded (rollbacks).
        self.rollbacks: list[tuple[int, float]] = list(state.rollbacks)
        last = state.last
        #: The predecessor died with `last` in flight, or between it and the next attempt.
        self.resuming = last is not None and not state.clean and last.ended in (None, "restart", "lost")
        # A relaunched launcher continues the attempt numbering (attempt dirs are kept). While
        # it recovers, the interrupted attempt's commands are still the ones accepted.
        dirs = [int(p.name[8:]) for p in run_dir.glob("attempt-*") if p.name[8:].isdigit()]
        if last is not None and self.resuming:
            self.attempt = last.attempt
        else:
            self.attempt = 1 + max([*dirs, *state.attempts], default=-1)

    def record(
        self,
        command: Any | None,
        detail: str,
        ok: bool = True,
        request: StopRequest | None = None,
        quarantine: str | None = None,
        release: str | None = None,
        pause: dict[str, Any] | None = None,
        skip: int | None = None,
        interval_s: float | None = None,
    ) -> None:
        """Under the lock: journal an executed command (or an operator's quarantine)."""
        key = command.command_id if command is not None else f"operator-quarantine:{quarantine}"
        if command is None and quarantine is None and release is not None:
            key = f"operator-release:{release}"
        kind = command.KIND if command is not None else "quarantine_node"
        self.commands[key] = self.journal.append(
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
        kill_at(self.fault, "after-command", kind)

    def pending_command(self, attempt: int) -> dict[str, Any] | None:
        """Under the lock: an Abort/Rollback/ResumeFrom executed in `attempt`, not acted upon."""
        for key, cmd in self.commands.items():
            if (
                cmd.get("ok")
                and cmd.get("request")
                and cmd.get("attempt") == attempt
                and key not in self.taken
            ):
                return cmd
        return None

    def untaken_resume(self) -> dict[str, Any] | None:
        """Under the lock: the newest executed Rollback/ResumeFrom whose resume was not taken."""
        found = None
        for key, cmd in self.commands.items():
            req = cmd.get("request") or {}
            if cmd.get("ok") and req.get("resume_step") is not None and key not in self.taken:
                found = cmd
        return found
