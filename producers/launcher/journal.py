"""The launcher's write-ahead journal, and what a relaunched launcher reads back from it.

A launcher killed in the middle of an action (SIGKILL, OOM, a host reboot) leaves its
successor, started on the same run dir, three questions: which attempt was in flight and
are its ranks still running, which actions were already executed (quarantines, accepted
Abort/Rollback/ResumeFrom commands, the interruption being handled) and which restart
was half done. ``<run_dir>/launcher.actions.jsonl`` answers them: one JSON object a
line, each appended and fsynced before the launcher acts on it (write-ahead: intent
first; the next record is the "done"), so a successor finishes the action in flight
instead of repeating it, and repeats nothing that was recorded.

Records (``op``; every record also has ``ts``):

- ``run``: the journal's first record; ``nonce`` makes the launcher's event ids unique
  to this run dir (deterministic otherwise, so a successor's re-report is a duplicate);
- ``command``: a command the launcher executed, keyed by its ``command_id`` (the
  idempotency key), written before its effect is applied and before it is acked:
  ``kind``, ``attempt``, ``ok`` (False: it was refused, e.g. an unvalidated step),
  ``detail`` (the ack's), ``quarantine`` (the node it took out of the pool, if any) and,
  for Abort/Rollback/ResumeFrom, ``request`` (what the restart needs); ``release`` (the
  node a ReleaseNode returned to the pool), ``skip`` (a SkipUpdate's step: every later
  attempt passes over that step's batch), ``pause`` (a PauseRun's step and reason: no
  restart until a clean end, so a successor ends paused too);
- ``take``: a Rollback/ResumeFrom request consumed (``key``, ``step``, ``rollback``):
  the next attempt resumes from ``step``; a rollback also bars the checkpoints newer than
  ``step`` validated before ``ts`` (the suspect lineage);
- ``interruption``: an attempt's end was decided (crash, command, or the launcher's own
  death), keyed by ``key`` (the command id, else ``<cause>:<attempt>``), with its
  :class:`~.records.RestartPhases` as ``record``; written before the teardown;
- ``attempt`` (intent: ``attempt``, ``resume``, ``nodes``, ``world_size``, the ``ranks``
  this launcher runs, ``interruption`` index or None), ``spawned`` (``pids``,
  ``spawn_ts``: the ranks exist), ``ended`` (``end``: ok, restart, stopped, lost: every
  rank of the attempt is gone);
- ``session``: the launcher's ``run()`` returned (``status``): a clean end. The restart
  budget (max_restarts) counts from the last one.

The interruption's "done" is its line in ``restarts.jsonl`` (matched by index), which is
written once the attempt after it ended, or by a successor.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOURNAL_NAME = "launcher.actions.jsonl"


class ActionJournal:
    """Append-only, fsynced per record. A torn last line (a kill mid-write) is dropped
    on load and cut off the file, so that the next record starts on a line of its own.
    Thread-safe: the launcher's loop and its actuator thread both append."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = _load(path)
        self._fh = path.open("ab")
        if not self.records or self.records[0].get("op") != "run":
            if self.records:  # a journal without its header: keep it, give it one
                self.records.insert(0, {"op": "run", "nonce": uuid.uuid4().hex, "ts": 0.0})
            else:
                self.append("run", nonce=uuid.uuid4().hex)

    @property
    def nonce(self) -> str:
        return str(self.records[0].get("nonce", ""))

    def append(self, op: str, **fields: Any) -> dict[str, Any]:
        record = {"op": op, "ts": time.time(), **fields}
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        with self._lock:  # file order = memory order
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self.records.append(record)
        return record

    def close(self) -> None:
        self._fh.close()


def _load(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    if end < len(data):  # torn last line: never acted upon (its fsync had not returned)
        with path.open("r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
    out: list[dict[str, Any]] = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("op"), str):
            out.append(record)
    return out


@dataclass
class AttemptRecord:
    attempt: int
    resume: int
    nodes: list[str]
    interruption: int | None  # the interruption this attempt restarts after
    pids: dict[int, int] = field(default_factory=dict)
    #: The attempt's world size and the ranks this launcher ran (None: journaled before
    #: they were recorded: the configured world, every rank of it).
    world_size: int | None = None
    ranks: list[int] | None = None
    spawn_ts: float | None = None
    spawned: bool = False
    ended: str | None = None


@dataclass
class JournalState:
    """The run as the journal tells it (pure: :func:`replay` of the records)."""

    attempts: dict[int, AttemptRecord] = field(default_factory=dict)
    commands: dict[str, dict[str, Any]] = field(default_factory=dict)
    quarantined: list[str] = field(default_factory=list)
    #: (step, ts) of every rollback taken.
    rollbacks: list[tuple[int, float]] = field(default_factory=list)
    #: Steps whose batch every later attempt skips (SkipUpdate).
    skip_batches: list[int] = field(default_factory=list)
    #: The PauseRun record in force (none after a clean end: a human relaunched).
    paused: dict[str, Any] | None = None
    #: Command keys whose resume was taken.
    taken: set[str] = field(default_factory=set)
    #: index -> interruption record (with key and from_attempt).
    interruptions: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Restarts of the current session (since the last clean end): interruption indices
    #: some attempt was started for.
    session_restarts: set[int] = field(default_factory=set)
    #: The launcher's last session ended cleanly (a ``session`` record after the last
    #: attempt or interruption record), or nothing ran yet.
    clean: bool = True

    @property
    def last(self) -> AttemptRecord | None:
        return self.attempts[max(self.attempts)] if self.attempts else None

    def interruption_of(self, attempt: int) -> dict[str, Any] | None:
        """The interruption that ended `attempt` (at most one: an attempt ends once)."""
        return next((i for i in self.interruptions.values() if i["from_attempt"] == attempt), None)


def replay(records: list[dict[str, Any]]) -> JournalState:
    state = JournalState()
    for rec in records:
        op = rec["op"]
        if op == "command":
            state.commands[str(rec["key"])] = rec
            node = rec.get("quarantine")
            if rec.get("ok") and isinstance(node, str) and node not in state.quarantined:
                state.quarantined.append(node)
            released = rec.get("release")
            if rec.get("ok") and isinstance(released, str) and released in state.quarantined:
                state.quarantined.remove(released)
            skip = rec.get("skip")
            if rec.get("ok") and isinstance(skip, int) and skip not in state.skip_batches:
                state.skip_batches.append(skip)
            if rec.get("ok") and isinstance(rec.get("pause"), dict):
                state.paused = rec
        elif op == "take":
            state.taken.add(str(rec["key"]))
            if rec.get("rollback"):
                state.rollbacks.append((int(rec["step"]), float(rec["ts"])))
        elif op == "interruption":
            state.interruptions[int(rec["index"])] = rec
        elif op == "attempt":
            index = rec.get("interruption")
            ranks = rec.get("ranks")
            state.attempts[int(rec["attempt"])] = AttemptRecord(
                int(rec["attempt"]),
                int(rec["resume"]),
                list(rec.get("nodes", [])),
                index,
                world_size=int(rec["world_size"]) if rec.get("world_size") is not None else None,
                ranks=[int(r) for r in ranks] if isinstance(ranks, list) else None,
            )
            if index is not None:
                state.session_restarts.add(int(index))
        elif op == "spawned":
            a = state.attempts.get(int(rec["attempt"]))
            if a is not None:
                a.spawned, a.spawn_ts = True, float(rec["spawn_ts"])
                a.pids = {int(r): int(p) for r, p in rec.get("pids", {}).items()}
        elif op == "ended":
            a = state.attempts.get(int(rec["attempt"]))
            if a is not None:
                a.ended = str(rec["end"])
        elif op == "session":
            state.session_restarts = set()
            state.paused = None
        if op in ("attempt", "spawned", "ended", "interruption", "take", "session"):
            state.clean = op == "session"
    return state


# --------------------------------------------------------------------------- orphans
#
# The ranks run in sessions of their own (torch elastic's start_new_session), so they
# outlive a killed launcher: its successor must end them before it starts the next
# attempt, or two groups would train and checkpoint at once. They are found by their
# journaled pids and, for the ones spawned after the last fsync, by their environment
# (TRAINGUARD_RUN_DIR, which the launcher sets for every rank); the environment also
# guards against a journaled pid reused by an unrelated process.

ENV_RUN_DIR = "TRAINGUARD_RUN_DIR"
ENV_ATTEMPT = "TRAINGUARD_ATTEMPT"


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's reaper may be slow or absent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _alive_child_of(pid: int, parent: int) -> bool | None:
    """From one read of /proc/PID/stat: None when `pid` is gone or a zombie, else whether
    `parent` is its parent."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else int(fields[1]) == parent
    except (OSError, ValueError, IndexError):
        return None if not alive(pid) else False


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def rank_processes(run_dir: Path, candidates: dict[int, int] | None = None) -> dict[int, int]:
    """pid -> attempt of every live process started by a launcher of `run_dir`: the
    `candidates` (pid -> attempt, journaled) that still carry its environment, and any
    other process under /proc that does. Never this process, its parent or its own
    children (its fork server, started while the world forms). A process with the run dir
    but no attempt in its environment (a fork server of an earlier launcher of the run)
    takes its attempt from the journal, else -1."""
    want = str(run_dir)
    mine = {os.getpid(), os.getppid()}
    found: dict[int, int] = {}

    def check(pid: int) -> int | None:
        env = _environ(pid)
        if env is None or env.get(ENV_RUN_DIR) != want or _alive_child_of(pid, os.getpid()) is not False:
            return None
        try:
            return int(env[ENV_ATTEMPT]) if ENV_ATTEMPT in env else (candidates or {}).get(pid, -1)
        except ValueError:
            return -1

    pids = set(candidates or {})
    try:
        pids |= {int(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
    except OSError:  # no /proc: trust the journal alone
        return {p: a for p, a in (candidates or {}).items() if p not in mine and alive(p)}
    for pid in sorted(pids - mine):
        attempt = check(pid)
        if attempt is not None:
            found[pid] = attempt
    return found


def _signal_group(pid: int, sig: int) -> None:
    """Signal the rank's whole session (it leads one), else the process alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(pids: list[int], term_timeout_s: float, kill_timeout_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after `term_timeout_s`; the pids still alive after that
    (unkillable, D-state), which the caller can only report."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    for sig, timeout in ((signal.SIGKILL, term_timeout_s), (0, kill_timeout_s)):
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in pids if alive(p)]
        if not left or sig == 0:
            return left
        for pid in left:
            _signal_group(pid, sig)
    return [p for p in pids if alive(p)]


def last_interval(commands: Iterable[dict[str, Any]]) -> float | None:
    """The interval of the last SetCheckpointInterval among journaled command records."""
    found = None
    for record in commands:
        value = record.get("interval_s")
        if record.get("ok") and isinstance(value, int | float) and value > 0:
            found = float(value)
    return found
