"""Rank processes forked from a process that has already imported torch (issue 48), the
default (``--preload torch,trainguard.torch``; ``--preload none``: a new process per
rank).

Every rank of a Python job imports torch, 2-2.5 s of CPU each, and a full restart waits for
it again. When the rank program is this interpreter running a script or a module
(``python train.py ...``, ``python -m pkg.train ...``, torchrun's ``train.py ...``), the
launcher keeps one server process (:mod:`.zygote`) that imported the ``--preload``
modules, and each rank is a fork of it turned into that command (its own session, the
rank's environment, streams, ``sys.argv``, ``__main__``). Anything else (another
interpreter, a binary, ``python -c``, interpreter options other than ``-u``) is spawned as
before, a new process per rank (with ``--preload none``, every command is).

A forked rank shows its own command line and environment to ``ps``, ``pgrep -f`` and
/proc/PID/environ, as a spawned one does (:func:`.zygote.present`); where the kernel does
not let a process do that (no checkpoint/restore support), the server says so once and
every rank is a new process, with a warning.

The first server is the launcher's own fork (:func:`prefork`): `trainguard launch` imports
torch with the ranks' import-time variables (:mod:`.import_env`) and forks before it starts a
thread, so that server imports only the rest of the preload (about 1 CPU-s, not 3.5) and
is ready sooner; a server started later (another OMP_NUM_THREADS, the first one died) is a
new process, as before.

The ranks stay under torch elastic's process layer: :class:`ForkedContext` is its
``SubprocessContext`` whose handlers fork through the server instead of ``Popen``
(its log files, error files, ``close`` escalating SIGTERM to SIGKILL: unchanged), and
:class:`ForkedProcess` answers as a ``Popen`` does (``pid``, ``poll``, ``wait``, signals), its
exit status reported by the server, the child's parent. The server is bound to this
launcher (:mod:`.agent_bound`) and its children to it, so they still die with the launcher;
it carries the run dir in its environment, so a relaunched launcher's recovery finds it
and its children (journal.rank_processes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from .agent_bound import bound
from .config import rank_program
from .import_env import import_time, torch_imported_with, with_import_time
from .zygote import MAX_MESSAGE, exit_as_program, forked_server

log = logging.getLogger(__name__)

#: How long a spawn waits for the server to finish its imports (then: a new process).
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Program:
    """A rank command this interpreter can run from a fork: a script or a module."""

    argv: tuple[str, ...]  # sys.argv as the program sees it
    command: tuple[str, ...]  # the command line as /proc/PID/cmdline shows it
    script: str | None = None
    module: str | None = None
    unbuffered: bool = False


def forkable(command: Sequence[str]) -> Program | None:
    """`command` as a :class:`Program` when it is this interpreter (same environment)
    running a script or a module with no interpreter option other than ``-u``; else None."""
    if len(command) < 2:
        return None
    found = shutil.which(command[0])
    if found is None or not _same_interpreter(found):
        return None
    rest, unbuffered = list(command[1:]), False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] == "-m" and not rest[1].startswith("-"):
        return Program((rest[1], *rest[2:]), tuple(command), module=rest[1], unbuffered=unbuffered)
    if rest and not rest[0].startswith("-") and os.path.isfile(rest[0]):
        return Program(tuple(rest), tuple(command), script=rest[0], unbuffered=unbuffered)
    return None


def _same_interpreter(path: str) -> bool:
    """The same interpreter in the same environment (a venv's python links to the system's:
    the same file in another directory is another environment)."""
    here = os.path.abspath(sys.executable)
    there = os.path.abspath(path)
    try:
        return os.path.dirname(here) == os.path.dirname(there) and os.path.samefile(here, there)
    except OSError:
        return False


class ServerGone(RuntimeError):
    """The fork server ended (killed, or failed to start), or cannot fork a rank that looks
    like itself to /proc (:func:`.zygote.present`)."""


class ForkServer:
    """The launcher's end of one :mod:`.zygote` process: spawn requests, exit statuses."""

    def __init__(
        self, preload: Sequence[str], env: Mapping[str, str], forked: tuple[socket.socket, int] | None = None
    ) -> None:
        """A new server process (`forked`: the one :func:`prefork` made, its socket and pid)."""
        self.preload = tuple(preload)
        #: The server's environment: the launcher's, and the ranks' import-time variables.
        self.env = dict(env)
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | _Child
        if forked is not None:
            self._sock, pid = forked
            self._proc = _Child(pid)
        else:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock = mine
            self._proc = subprocess.Popen(
                bound(server_command(theirs.fileno(), self.preload)), env=self.env,
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            theirs.close()
        self.pid = self._proc.pid
        self.ready: dict[str, Any] | None = None
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self.gone = False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """The server's imports done (what it imported, what failed, in how long)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.ready is None:
                left = deadline - time.monotonic()
                if self.gone:
                    raise ServerGone(f"the fork server (pid {self.pid}) ended before its imports were done")
                if left <= 0:
                    raise ServerGone(f"the fork server did not import {list(self.preload)} in {timeout:.0f}s")
                self._pump(left)
            return self.ready

    def spawn(
        self, program: Program, env: Mapping[str, str], stdio: Sequence[int], cwd: str
    ) -> ForkedProcess:
        """A child running `program` with exactly `env`, its stdin/stdout/stderr `stdio`."""
        request = {
            "argv": list(program.argv), "command": list(program.command), "script": program.script,
            "module": program.module, "unbuffered": program.unbuffered, "env": dict(env), "cwd": cwd,
        }  # fmt: skip
        with self._lock:
            if (why := self.cannot_present()) is not None:
                raise ServerGone(f"a forked rank could not show its command line and environment ({why})")
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], list(stdio))
            except OSError as exc:
                self._lost()
                raise ServerGone(f"the fork server (pid {self.pid}) is gone: {exc}") from exc
            while not self._replies:
                self._pump(None)
            reply = self._replies.pop(0)
        if "pid" not in reply:
            raise ServerGone(f"the fork server refused a spawn: {reply.get('error')}")
        return ForkedProcess(self, int(reply["pid"]), tuple(program.argv))

    def cannot_present(self, timeout: float = READY_TIMEOUT_S) -> str | None:
        """Why a child could not show its own command line and environment in /proc (None:
        it can), once the server's imports are done."""
        why = self.wait_ready(timeout).get("presents")
        return None if why is None else str(why)

    def returncode(self, pid: int, timeout: float | None = 0) -> int | None:
        """`pid`'s exit status once the server reported it; waits up to `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._pump(0)
                    break
                self._pump(left if left is None else min(left, 0.05))
            return self._exits.get(pid)

    def _pump(self, timeout: float | None) -> None:
        """Read what the server sent within `timeout` s (None: until one message)."""
        if self.gone:
            if timeout is None:
                raise ServerGone(f"the fork server (pid {self.pid}) is gone")
            return
        while True:
            readable, _, _ = select.select([self._sock], [], [], timeout)
            if not readable:
                return
            data = self._sock.recv(MAX_MESSAGE)
            if not data:
                self._lost()
                if timeout is None:
                    raise ServerGone(f"the fork server (pid {self.pid}) is gone")
                return
            message = json.loads(data)
            if "exit" in message:
                self._exits[int(message["exit"])] = int(message["status"])
            elif "ready" in message:
                self.ready = message
                if message.get("failed"):
                    log.warning("fork server: could not preload %s", message["failed"])
            else:
                self._replies.append(message)
            timeout = 0  # then whatever else is already there

    def _lost(self) -> None:
        """The server died: its children died with it (PR_SET_PDEATHSIG, SIGKILL)."""
        self.gone = True
        self._proc.poll()

    def dead(self, pid: int) -> None:
        """A child of a lost server: killed with it."""
        self._exits.setdefault(pid, -signal.SIGKILL)

    def close(self) -> None:
        """End the server (its children with it)."""
        with self._lock:
            self._sock.close()
            self.gone = True
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def server_command(fd: int, preload: Sequence[str]) -> list[str]:
    """The server's command line (what ``ps`` shows of it, a forked one included)."""
    return [sys.executable, "-m", __package__ + ".zygote", str(fd), *preload]


class _Child:
    """The server :func:`prefork` forked, as the ``Popen`` a spawned one has."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout or 0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _wait(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere
                pid, status = self.pid, 255 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


#: The server this launcher forked from itself (:func:`prefork`), until a ForkServers takes it.
_preforked: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def prefork(preload: Sequence[str], command: Sequence[str], env: Mapping[str, str]) -> ForkServer | None:
    """The launcher's fork server as its own fork, made before the launcher starts a thread:
    torch is imported already (:func:`.import_env.importing_as_ranks`), so the server only
    imports the rest of `preload` (about 1 CPU-s, not 3.5 for a new interpreter), and is
    ready sooner. Its key is the ranks' import-time variables torch was imported with; the
    first :class:`ForkServers` that asks for that key takes it. None (a new process is
    started when asked, as before) when `command` is not forkable, nothing is preloaded,
    torch was not imported that way, or a thread is already running (a fork of a threaded
    process may inherit a held lock)."""
    imported_with = torch_imported_with()
    preload = tuple(m for m in preload if m)
    if not preload or forkable(rank_program(command)) is None or imported_with is None:
        return None
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    env = with_import_time(env, imported_with)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server; its children return here, each to run its rank's program
        mine.close()
        exit_as_program(forked_server(theirs, list(preload), server_command(theirs.fileno(), preload), env))
    theirs.close()
    server = ForkServer(preload, env, forked=(mine, pid))
    _preforked[tuple(sorted(imported_with.items()))] = server
    return server


class ForkedProcess:
    """A forked rank as a ``Popen``: what torch elastic's handlers and the launcher's watch use."""

    def __init__(self, server: ForkServer, pid: int, args: tuple[str, ...]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 0)
            if self.returncode is None and self.server.gone:
                self.server.dead(self.pid)
                self.returncode = self.server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout or 0)
            left = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            self.server.returncode(self.pid, left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As ``Popen.send_signal``: nothing once it ended, also when it ended after the poll
        (the server reaps it the moment it exits; its report may still be on the way)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedHandler(SubprocessHandler):
    """torch elastic's handler of one rank, its process forked by the server."""

    def __init__(self, server: ForkServer, program: Program, **kwargs: Any) -> None:
        self._server, self._program = server, program
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        stdio: list[IO[Any] | int] = [0, self._stdout or 1, self._stderr or 2]
        fds = [s if isinstance(s, int) else s.fileno() for s in stdio]
        return self._server.spawn(self._program, env, fds, os.getcwd())

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """As torch elastic closes a rank it started: its session signalled, its files closed.
        A forked rank that ended since the caller's poll is reaped by the server at once (a
        spawned one stays a zombie until waited for, its group signalable): nothing to signal."""
        try:
            super().close(death_sig)
        except ProcessLookupError:
            for stream in (self._stdout, self._stderr):
                if stream:
                    stream.close()


def start_handler(forks: ForkServers | None, spec: dict[str, Any]) -> SubprocessHandler:
    """torch elastic's handler of one process (`spec`: its arguments), forked by `forks`'
    server when the command is forkable, else a new process (also when the server is gone)."""
    server = forks.get(spec["env"]) if forks is not None else None
    if server is not None and forks is not None and forks.program is not None:
        try:
            return ForkedHandler(server, forks.program, **spec)
        except ServerGone as exc:
            log.warning("%s: a new process instead", exc)
    return SubprocessHandler(**spec)


def start_context(forks: ForkServers, spec: dict[str, Any]) -> Any:
    """torch elastic's process context for `spec` (start_processes' arguments), started as
    start_processes() starts one, its ranks forked by `forks`' server when it has one (a
    server that died meanwhile, or refuses: new processes)."""
    from torch.distributed.elastic.multiprocessing import start_processes

    envs = spec["envs"]
    server = forks.get(envs[0]) if envs else None
    if server is None or forks.program is None:
        return start_processes(**spec)
    ctx = ForkedContext(server, forks.program, **spec)
    try:
        ctx.start()
    except ServerGone as exc:
        log.warning("%s: the ranks start as new processes", exc)
        ctx.close()
        return start_processes(**spec)
    except BaseException:
        ctx.close()
        raise
    return ctx


class ForkedContext(SubprocessContext):
    """torch elastic's binary ``PContext``, each rank forked by `server` as `program`."""

    def __init__(self, server: ForkServer, program: Program, **kwargs: Any) -> None:
        self._server, self._program = server, program
        super().__init__(**kwargs)

    def _start(self) -> None:
        self.subprocess_handlers = {
            local_rank: ForkedHandler(
                self._server,
                self._program,
                entrypoint=self.entrypoint,
                args=self.args[local_rank],
                env=self.envs[local_rank],
                stdout=self.stdouts[local_rank],
                stderr=self.stderrs[local_rank],
                local_rank_id=local_rank,
                numa_options=None,
            )
            for local_rank in range(self.nprocs)
        }


class ForkServers:
    """The launcher's fork servers for its rank `command`, one per value of the ranks'
    import-time variables (in practice one): started ahead (their imports overlap the world
    forming), started again when one died. A server is ended only with the run: its
    children die with it. None are started without `preload` or for a command that is not
    forkable (`program` None), and none used once one found that a fork could not show its
    command line and environment (:func:`.zygote.present`): new processes, as before."""

    def __init__(self, preload: Sequence[str], command: Sequence[str], base_env: Mapping[str, str]) -> None:
        self.preload = tuple(m for m in preload if m)
        #: The command as each fork runs it.
        self.program = forkable(rank_program(command)) if self.preload else None
        self.base_env = dict(base_env)
        #: Why forked ranks cannot look like spawned ones here (then none is forked).
        self.refused: str | None = None
        self._servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
        self._lock = threading.Lock()

    def get(self, rank_env: Mapping[str, str] | None = None) -> ForkServer | None:
        """A live server whose import-time variables are `rank_env`'s (None: no preload, or
        a command that is not forkable)."""
        if self.program is None or self.refused is not None:
            return None
        wanted = import_time(rank_env)
        key = tuple(sorted(wanted.items()))
        with self._lock:  # the ranks' thread and a spare's self-test may ask at once
            server = self._servers.get(key)
            if server is None or server.gone:
                server = _preforked.pop(key, None)
                if server is None or server.gone or server.preload != self.preload:
                    if server is not None:  # not this launcher's to use: ended, not left behind
                        server.close()
                    server = ForkServer(self.preload, with_import_time(self.base_env, wanted))
                self._servers[key] = server
        if server.ready is not None and (why := server.ready.get("presents")) is not None:
            self.refused = str(why)
            log.warning("fork server: a forked rank could not show its own command line and environment "
                        "in /proc (%s): every rank is a new process", why)  # fmt: skip
            return None
        return server

    def popen(self, command: Sequence[str], env: Mapping[str, str]) -> ForkedCommand | None:
        """`command` (not a rank: the node self-test's workers) forked from the server already
        started for `env`'s import-time variables, its output captured as ``Popen(...,
        stdout=PIPE, stderr=PIPE, text=True)`` captures it; None when there is no such
        server, or it cannot fork `command` (then a new process runs it, as before)."""
        program = forkable(command)
        with self._lock:
            server = self._servers.get(tuple(sorted(import_time(env).items())))
        if program is None or server is None or server.gone or self.refused is not None:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            process = server.spawn(program, env, [0, out_w, err_w], os.getcwd())
        except ServerGone as exc:
            log.warning("%s: a new process instead", exc)
            os.close(out_r)
            os.close(err_r)
            return None
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedCommand(process, out_r, err_r)

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()


class ForkedCommand:
    """A forked command whose stdout and stderr are pipes to this process, answering as the
    ``Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` the self-test would otherwise start."""

    def __init__(self, process: ForkedProcess, stdout: int, stderr: int) -> None:
        self.process = process
        self._pipes = {stdout: bytearray(), stderr: bytearray()}
        self._order = (stdout, stderr)
        self._open = {stdout, stderr}

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end and the exit status, within `timeout` s
        (subprocess.TimeoutExpired after it, as Popen's: call again to go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(list(self.process.args), timeout or 0)
            for fd in select.select(list(self._open), [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if chunk:
                    self._pipes[fd] += chunk
                else:
                    os.close(fd)
                    self._open.discard(fd)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.process.wait(left)
        out, err = (self._pipes[fd].decode(errors="replace") for fd in self._order)
        return out, err

    def kill(self) -> None:
        self.process.kill()
