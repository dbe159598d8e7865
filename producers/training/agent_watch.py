"""The rank side of "ranks never outlive their agent" (issue 44).

The launcher binds every process it spawns to itself with the kernel's parent-death
signal (producers/launcher/agent_bound.py), which reaches that process only. A rank
program that runs the training in a child of its own (``sh -c "python train.py; ..."``,
a wrapper that forks) leaves that child unbound: this watch, started by the rank's
Supervisor (through its progress file, rank_files.py), looks every ``POLL_S`` at the
launcher named by ``TRAINGUARD_AGENT_PID`` and SIGKILLs its own process once the
launcher is gone, before more of its writes (a checkpoint, a telemetry batch) can land.
A zombie, or another process that took the pid, counts as gone (its start time differs).
Outside ``trainguard launch`` (no such variable) nothing is started.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

ENV_AGENT_PID = "TRAINGUARD_AGENT_PID"  # producers/launcher/agent_bound.py's
POLL_S = 0.5

_started = False
_lock = threading.Lock()


def start() -> None:
    """Watch the launcher from now on (once per process; a process that outlives attempts
    under in-process restart keeps its one watch: the launcher is the same)."""
    global _started
    try:
        agent = int(os.environ.get(ENV_AGENT_PID, ""))
    except ValueError:
        return
    with _lock:
        if _started:
            return
        _started = True
    born = _start_time(agent)
    if born is None:
        _gone(agent)
    threading.Thread(target=_watch, args=(agent, born), name="trainguard-agent-watch", daemon=True).start()


def alive(pid: int, born: str | None) -> bool:
    """`pid` is the process that started at `born` (its /proc start time) and not a zombie."""
    return born is not None and _start_time(pid) == born


def _watch(agent: int, born: str | None) -> None:
    while alive(agent, born):
        threading.Event().wait(POLL_S)
    _gone(agent)


def _gone(agent: int) -> None:
    log.error("trainguard: the launcher (pid %d) is gone: this rank ends with it", agent)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (the start time in clock ticks); None when the process
    is gone or a zombie. Without /proc (not Linux) every process counts as alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else "?"
    except OSError:
        return "?"
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()
