"""The two files a rank writes for its launcher, best effort (never raising into the loop):

- the restart phases of this process (``TRAINGUARD_PHASES_FILE``), once, after its first
  step: when it started, how long the checkpoint load and the process-group init took,
  when the first step completed (producers/launcher/restarts.py reads them), and later
  how the rank ended: a lost peer's error, the Supervisor's clean close (launcher/records.py);
- its newest completed step (``TRAINGUARD_PROGRESS_FILE``), after every step, so that a
  RankExit says exactly how much work was lost (producers/launcher/records.py reads it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from . import agent_watch, inprocess
from .config import pg_init_seconds, pg_init_started_ts, process_start_ts

log = logging.getLogger(__name__)


def write_phases(
    path: Path | None, step: int, checkpoint: Any = None, supervisor_ts: float | None = None
) -> None:
    """After the first step of this process's attempt: its start (the process's, or the
    attempt's in a process that outlived the last one: inprocess.py), the `checkpoint`
    manager's load (seconds, and from where: "own" memory, a "peer"'s, "storage"), the
    process-group init, the first step's completion, and the marks that split the rest:
    the init's start (a new process's imports before it) and the Supervisor's creation
    (`supervisor_ts`: the model and DDP built before it). Replaced atomically."""
    if path is None:
        return
    restored = getattr(checkpoint, "last_restore", None)  # (step, "own" | "peer" | "storage")
    restartable = inprocess.current()
    started = restartable.attempt_start_ts if restartable is not None else None
    phases = {
        "start_ts": started if started is not None else process_start_ts(),
        "checkpoint_load_s": getattr(checkpoint, "last_load_s", None),
        "pg_init_s": pg_init_seconds(),
        "pg_init_ts": pg_init_started_ts(),  # before it: the imports (a new process's)
        "supervisor_ts": supervisor_ts,  # between the init and it: the model and DDP built
        "first_step_ts": time.time(),
        "last_step": step,
        "restore_from": restored[1] if restored else None,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: v for k, v in phases.items() if v is not None}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("trainguard: restart phases not written to %s: %s", path, exc)


def note_exit(path: Path | None, peer_lost: str) -> None:
    """The rank is dying of a lost peer (producers/training/peer_loss.py): add it to the
    phases file (written or not yet), for the launcher's RankExit."""
    _note(path, "peer_lost", peer_lost)


def note_closed(path: Path | None, exit_code: int | None) -> None:
    """The Supervisor closed with `exit_code`: training is over in this process. What the
    interpreter's teardown does after it is not the run's: a signal it dies of then (a
    backend thread still releasing a collective's tensors at finalization aborts the
    process) is a clean end to the launcher when the close said 0 (launcher/attempt.py)."""
    _note(path, "closed", exit_code)


def _note(path: Path | None, key: str, value: object) -> None:
    """Add `key` to the phases file (written or not yet); replaced atomically."""
    if path is None:
        return
    try:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".exit.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("trainguard: %s not noted in %s: %s", key, path, exc)


class ProgressFile:
    """This rank's newest completed step: one fixed-width record rewritten in place with
    pwrite (~6 µs; a write-then-rename took 1-2 ms a step on a loaded 2-core machine). No
    fsync: a host crash loses the ranks with it. The reader (launcher's read_progress)
    reads until two reads agree."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None
        if path is not None:
            agent_watch.start()  # under a launcher: this rank writes only while it lives
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:
                log.warning("trainguard: no progress file %s: %s", path, exc)

    def write(self, step: int) -> None:
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, b"%20d\n" % step, 0)
        except OSError as exc:
            log.warning("trainguard: progress not written to %s: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
