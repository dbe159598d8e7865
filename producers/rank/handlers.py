"""The rank side's command handlers, registered on the :class:`~.actuator.Actuator`.

Handlers run on the actuator's thread while the training thread is busy (or stuck in a
collective), so they never touch the model. A command that acts on the training loop
only sets a flag in :class:`RankControl`, which the training thread reads at its next
step boundary (:mod:`..training.supervisor`); a command that ends the rank (abort, roll back,
resume from) does its work here, because a stuck training thread would never read a
flag. Each handler returns the detail of its ack, as the simulator's do; one that
raises gives a FAILED ack with the error.

=====================  ==============================================================
command                on this rank
=====================  ==============================================================
CheckpointNow          save at the next step boundary (the supervisor calls the
                       checkpoint manager's ``save(step)``, or ``should_checkpoint``
                       answers True)
SetCheckpointInterval  ``should_checkpoint`` uses the new interval from now on, counted
                       in steps of the measured step time (:mod:`..checkpoint.cadence`)
SkipUpdate(step)       ``check()`` of that step returns False (FAILED if it is already
                       applied: the core then knows the update went in)
RunSelfCheck(step)     the bitwise replay runs at the first step >= step
RunRingCheck(step)     own and neighbour's microbatch recomputed at the first step >=
                       step that every rank agrees on (:mod:`..training.ring_check`)
RunCrossRankCheck      the named ranks recompute ``batch_fn(batch_rank, step)`` after the
                       update of the first step at which all of them hold it (agreed by
                       every rank); one all-reduce gathers the values and ``ranks[0]``
                       reports CrossRankCheck (:mod:`..training.cross_check`). FAILED without
                       ``batch_rank``, the hooks, or ranks inside the world
Abort(stack_dump)      all threads' stacks to a file (faulthandler), the main thread's
                       stack signature and the file reported in RankExit(requested),
                       telemetry flushed (bounded), then ``os._exit``, which ends even
                       a rank stuck in a collective
Rollback, ResumeFrom   RankExit(requested) and exit; the launcher restarts the job from
                       the named checkpoint
=====================  ==============================================================

Exit is delayed by `grace_s` (default 1 s) on a thread of its own, so that the actuator
can deliver the handler's ack first; then telemetry is closed (at most `flush_s`) and
the process ends with :data:`REQUESTED_EXIT_CODE`.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from ...schemas import (
    Abort,
    CheckpointNow,
    Command,
    ResumeFrom,
    Rollback,
    RunCrossRankCheck,
    RunRingCheck,
    RunSelfCheck,
    SetCheckpointInterval,
    SkipUpdate,
)
from ..training import cross_check, inprocess
from ..training.cross_check import CrossCheck
from .agent import RankAgent

log = logging.getLogger(__name__)

#: Exit status of a rank that ended because a command asked it to (128 + SIGTERM).
REQUESTED_EXIT_CODE = 143
#: Innermost frames of the training thread that make its stack signature.
SIGNATURE_DEPTH = 6
_MAX_SIGNATURE = 2000


class CheckpointManager(Protocol):
    """What the supervisor needs of a checkpoint manager (producers/checkpoint/manager.py)."""

    def save(self, step: int) -> Any: ...


class Registrar(Protocol):
    """The actuator's ``register`` (an Actuator, or a test double)."""

    def register(self, kind: Any, handler: Any) -> None: ...


class TooLate(RuntimeError):
    """The command's step has passed on this rank (FAILED ack, with this text)."""


@dataclass
class RankControl:
    """Flags shared by the actuator thread (writer) and the training thread (reader).
    Every access holds `lock`; the training thread's reads are a few dict lookups."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Checkpoint at the next step boundary (CheckpointNow).
    checkpoint_requested: bool = False
    #: Seconds between checkpoints (SetCheckpointInterval); None: never on time.
    checkpoint_interval_s: float | None = None
    #: Steps whose update must be skipped (SkipUpdate).
    skip_steps: set[int] = field(default_factory=set)
    #: First steps >= which a self-check replay is due (RunSelfCheck).
    self_checks_due: list[int] = field(default_factory=list)
    #: Ring checks due, oldest first: (first step >= which, check_id, offset) (RunRingCheck).
    ring_checks_due: list[tuple[int, str, int]] = field(default_factory=list)
    #: Cross checks naming this rank, as received (RunCrossRankCheck; :mod:`..training.cross_check`).
    cross_checks_due: list[CrossCheck] = field(default_factory=list)
    #: Newest step this rank has begun (-1 before the first); set by the training thread.
    current_step: int = -1
    #: Steps decided locally (bounded): step -> True if applied, False if skipped.
    decided: dict[int, bool] = field(default_factory=dict)
    _decided_order: deque[int] = field(default_factory=deque)
    #: The training thread (whose stack makes the signature); set on the first step.
    training_thread: int = field(default_factory=lambda: threading.main_thread().ident or 0)
    exiting: bool = False

    def record_decision(self, step: int, applied: bool, keep: int = 4096) -> None:
        with self.lock:
            if step not in self.decided:
                self._decided_order.append(step)
            self.decided[step] = applied
            while len(self._decided_order) > keep:
                self.decided.pop(self._decided_order.popleft(), None)

    def take_skip(self, step: int) -> bool:
        with self.lock:
            if step in self.skip_steps:
                self.skip_steps.discard(step)
                return True
            return False

    def take_self_check(self, step: int) -> bool:
        with self.lock:
            due = [s for s in self.self_checks_due if s <= step]
            if not due:
                return False
            self.self_checks_due = [s for s in self.self_checks_due if s > step]
            return True

    def oldest_ring_check(self) -> int | None:
        """The step of the oldest pending ring check (what the ranks agree on), or None."""
        with self.lock:
            return self.ring_checks_due[0][0] if self.ring_checks_due else None

    def take_ring_check(self, first: int) -> tuple[str, int] | None:
        """Remove the pending ring check due from `first`: its (check_id, offset)."""
        with self.lock:
            for i, (due, check_id, offset) in enumerate(self.ring_checks_due):
                if due == first:
                    del self.ring_checks_due[i]
                    return check_id, offset
            return None

    def cross_check_head(self, step: int) -> tuple[CrossCheck | None, list[CrossCheck]]:
        """The cross check this rank offers to the agreement at `step`, and the ones it
        drops there, held too long (:data:`.cross_check.PATIENCE_STEPS`). One that came
        before the first step is held from this one."""
        with self.lock:
            due = [c if c.since >= 0 else dataclasses.replace(c, since=step) for c in self.cross_checks_due]
            gone = [c for c in due if cross_check.expired(c, step)]
            self.cross_checks_due = [c for c in due if c not in gone]
            return cross_check.head(self.cross_checks_due), gone

    def take_cross_check(self, key: int) -> CrossCheck | None:
        """Remove the pending cross check the ranks agreed on (None: it does not name us)."""
        with self.lock:
            for i, check in enumerate(self.cross_checks_due):
                if check.key == key:
                    return self.cross_checks_due.pop(i)
            return None

    def drop_cross_checks(self) -> list[CrossCheck]:
        with self.lock:
            gone, self.cross_checks_due = self.cross_checks_due, []
            return gone

    def take_checkpoint_request(self) -> bool:
        with self.lock:
            requested, self.checkpoint_requested = self.checkpoint_requested, False
            return requested


# --------------------------------------------------------------------------- stacks


def stack_signature(frame: FrameType | None, depth: int = SIGNATURE_DEPTH) -> str:
    """The innermost `depth` frames, outermost first: ``file.py:function>...``. No line
    numbers and no directories, so that ranks stopped at the same place (the same
    collective, through the same code) have equal signatures and the odd one out
    differs (processors/core/detectors/stacks.py compares them for equality)."""
    frames: list[str] = []
    while frame is not None and len(frames) < depth:
        code = frame.f_code
        frames.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return ">".join(reversed(frames))[-_MAX_SIGNATURE:]


def dump_stacks(path: Path) -> None:
    """All threads' stacks to `path`: faulthandler's dump (the C-safe one, as a hang
    needs), then each thread's Python stack with its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fh.write(f"# trainguard stack dump, pid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        fh.write("# faulthandler (all threads)\n")
        fh.flush()
        faulthandler.dump_traceback(file=fh, all_threads=True)
        fh.write("\n# python threads\n")
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            fh.write(f"\nThread {ident:#x} ({names.get(ident, '?')}):\n")
            fh.write("".join(traceback.format_stack(frame)))
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- handlers


class RankHandlers:
    """The handlers for one rank. `close_telemetry(timeout_s)` ships what is queued before
    exit (the supervisor's); `terminate(code)` ends the process (``os._exit``)."""

    def __init__(
        self,
        agent: RankAgent,
        control: RankControl,
        run_dir: Path,
        close_telemetry: Callable[[float], None] = lambda _timeout: None,
        terminate: Callable[[int], None] = os._exit,
        grace_s: float = 1.0,
        flush_s: float = 3.0,
        can_self_check: Callable[[], str | None] = lambda: None,
        can_ring_check: Callable[[], str | None] = lambda: None,
        can_cross_check: Callable[[RunCrossRankCheck], str | None] = lambda _command: None,
    ) -> None:
        self.agent = agent
        self.control = control
        self.run_dir = Path(run_dir)
        self.close_telemetry = close_telemetry
        self.terminate = terminate
        self.grace_s = grace_s
        self.flush_s = flush_s
        #: Why this rank cannot run a self-check (None: it can).
        self.can_self_check = can_self_check
        #: Why this rank cannot run a ring check (None: it can).
        self.can_ring_check = can_ring_check
        #: Why this rank cannot run a cross check (None: it can).
        self.can_cross_check = can_cross_check
        self.exit_thread: threading.Thread | None = None

    def command_handlers(self) -> dict[type[Command], Callable[[Any, int], str]]:
        """The rank role's handlers (producers/command_roles.py: EXECUTED_BY)."""
        return {
            CheckpointNow: self.checkpoint_now,
            SetCheckpointInterval: self.set_interval,
            SkipUpdate: self.skip_update,
            RunSelfCheck: self.run_self_check,
            RunRingCheck: self.run_ring_check,
            RunCrossRankCheck: self.run_cross_rank_check,
            Abort: self.abort,
            Rollback: self.restart_from,
            ResumeFrom: self.restart_from,
        }

    def register(self, actuator: Registrar) -> None:
        for kind, handler in self.command_handlers().items():
            actuator.register(kind, handler)

    # ------------------------------------------------------------------ flags
    def checkpoint_now(self, command: CheckpointNow, rank: int) -> str:
        with self.control.lock:
            self.control.checkpoint_requested = True
            step = self.control.current_step
        return f"checkpoint at the next step boundary (step {step} running)"

    def set_interval(self, command: SetCheckpointInterval, rank: int) -> str:
        with self.control.lock:
            self.control.checkpoint_interval_s = command.interval_s
        return f"checkpoint every {command.interval_s:g}s"

    def skip_update(self, command: SkipUpdate, rank: int) -> str:
        with self.control.lock:
            applied = self.control.decided.get(command.step)
            if applied is True:
                raise TooLate(f"update of step {command.step} was already applied")
            if applied is False:
                return f"update of step {command.step} already skipped locally"
            self.control.skip_steps.add(command.step)
        return f"update of step {command.step} will be skipped"

    def run_self_check(self, command: RunSelfCheck, rank: int) -> str:
        if (missing := self.can_self_check()) is not None:
            raise RuntimeError(missing)
        with self.control.lock:
            first = max(command.step, self.control.current_step + 1)
            self.control.self_checks_due.append(first)
        return f"self-check at the first step >= {first}"

    def run_ring_check(self, command: RunRingCheck, rank: int) -> str:
        if (missing := self.can_ring_check()) is not None:
            raise RuntimeError(missing)
        with self.control.lock:
            if any(check_id == command.check_id for _, check_id, _ in self.control.ring_checks_due):
                return f"ring check {command.check_id} already due"
            self.control.ring_checks_due.append((command.step, command.check_id, command.offset))
            self.control.ring_checks_due.sort()
        return (
            f"ring check {command.check_id}: recompute own and rank (r + {command.offset})'s microbatch "
            f"at the first step >= {command.step} that every rank holds it"
        )

    def run_cross_rank_check(self, command: RunCrossRankCheck, rank: int) -> str:
        if (why := self.can_cross_check(command)) is not None:
            raise RuntimeError(why)
        with self.control.lock:
            check = cross_check.from_command(command, since=self.control.current_step)
            if any(c.microbatch_id == check.microbatch_id for c in self.control.cross_checks_due):
                return f"cross check {check.microbatch_id} already due"
            self.control.cross_checks_due.append(check)
        return (
            f"cross check {check.microbatch_id}: ranks {list(check.ranks)} recompute rank "
            f"{check.batch_rank}'s microbatch of step {check.step} at the first step all of them hold it"
        )

    # ------------------------------------------------------------------ exits
    def abort(self, command: Abort, rank: int) -> str:
        if self._claim_exit():
            return "already exiting"
        restartable = inprocess.current()
        ref = signature = ""
        if command.stack_dump:
            path = self.run_dir / f"attempt-{self.agent.attempt}" / "stacks" / f"rank-{rank:05d}.txt"
            signature = stack_signature(sys._current_frames().get(self.control.training_thread))
            try:
                dump_stacks(path)
                ref = str(path.resolve())
            except OSError as exc:  # no storage: the signature still goes out
                log.error("rank %d: cannot write the stack dump %s: %s", rank, path, exc)
        self.agent.exit(
            exit_code=REQUESTED_EXIT_CODE, requested=True, stack_dump_ref=ref, stack_signature=signature
        )
        where = f"; stacks in {ref}" if ref else ""
        if restartable is not None:  # the launcher ends the stuck rank, the others go on in process
            restartable.note_stack(rank, signature)
            return f"the attempt ends in process (in-process restart){where}; signature {signature or '-'}"
        self._exit_soon()
        return f"aborting: exit in {self.grace_s:g}s{where}; signature {signature or '-'}"

    def restart_from(self, command: Rollback | ResumeFrom, rank: int) -> str:
        if self._claim_exit():
            return "already exiting"
        self.agent.exit(exit_code=REQUESTED_EXIT_CODE, requested=True)
        self._exit_soon()
        return (
            f"exiting in {self.grace_s:g}s; the launcher restarts from checkpoint "
            f"{command.checkpoint_step} ({command.uri})"
        )

    def _claim_exit(self) -> bool:
        with self.control.lock:
            already, self.control.exiting = self.control.exiting, True
        return already

    def _exit_soon(self) -> None:
        def run() -> None:
            time.sleep(self.grace_s)  # lets the actuator deliver this command's ack
            try:
                self.close_telemetry(self.flush_s)
            except Exception:
                log.exception("closing telemetry before exit failed")
            finally:
                self.terminate(REQUESTED_EXIT_CODE)

        self.exit_thread = threading.Thread(target=run, name="trainguard-exit", daemon=True)
        self.exit_thread.start()
