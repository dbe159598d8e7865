"""The fork server's own process (issue 48): imports the modules every rank imports (torch
first) once, then forks one child per rank and turns it into ``python script.py args``.

Run by :mod:`.fork_server` as ``python -m trainguard.producers.launcher.zygote FD MODULE...``
(through :mod:`.agent_bound`: it dies with its launcher). ``FD`` is its end of a Unix
``SOCK_SEQPACKET`` pair: one JSON message per packet, the rank's stdin, stdout and stderr
passed beside a spawn request (``SCM_RIGHTS``).

- in: ``{"argv": [...], "command": [...], "script": path | null, "module": name | null,
  "env": {...}, "cwd": dir, "unbuffered": bool}`` with three descriptors;
- out: ``{"ready": [modules imported], "failed": {module: error}, "import_s": s,
  "presents": null | why not}`` once,
  ``{"pid": p}`` for each spawn, ``{"exit": p, "status": rc}`` when a child ends (``rc`` as
  ``Popen.returncode``: negative for a signal).

A child becomes what a fresh interpreter running the command would be: its own session,
bound to this process (``PR_SET_PDEATHSIG``: it dies with the server, which dies with the
launcher), the rank's command line and environment where ``ps`` and /proc/PID/environ read
them (``PR_SET_MM_MAP``, unprivileged where the kernel has checkpoint/restore: the server
checks it once and says so in its "ready" message; without it the launcher forks
nothing), the rank's streams on 0/1/2, exactly the rank's environment, the launcher's
working directory, ``sys.argv``, ``sys.path[0]``, ``__main__``, stdio buffering (``-u``),
and fresh random state; the script then runs at module level of this file, so the
interpreter's own exit runs its ``atexit`` hooks, joins its threads and reports its exit
status or traceback as ``python`` would.

What the preload cannot give a child: a variable that a preloaded module reads when it is
imported takes the server's value (the launcher's environment; :mod:`.fork_server` starts
the server with the ranks' ``OMP_NUM_THREADS``, the one torch reads then). Only the
standard library is imported here before the preload.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

#: Beside a spawn request: the child's stdin, stdout and stderr.
STDIO_FDS = 3
#: One message's largest size (an environment of a few hundred variables fits).
MAX_MESSAGE = 1 << 20
#: linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_MM, PR_SET_MM_MAP = 35, 14


class _MMMap(ctypes.Structure):
    """linux/prctl.h's struct prctl_mm_map."""

    _fields_ = [
        *((name, ctypes.c_uint64) for name in (
            "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
            "arg_start", "arg_end", "env_start", "env_end", "auxv",
        )),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]  # fmt: skip


#: /proc/self/stat's fields (1-based, man 5 proc) that PR_SET_MM_MAP takes back unchanged.
_STAT_FIELDS = {
    "start_code": 26, "end_code": 27, "start_stack": 28, "start_data": 45, "end_data": 46,
    "start_brk": 47,
}  # fmt: skip


def _outliving(libc: ctypes.CDLL, data: bytes) -> tuple[int, int]:
    """`data` (strings, each ended by a NUL) in memory that is never freed: (its address,
    len(data)). The kernel reads /proc/PID/cmdline and environ from it until the process
    is gone, and a Python object's buffer is freed while the interpreter shuts down (a
    rank's last seconds then showed malloc's own pointers as its command line)."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    address = libc.malloc(max(1, len(data)))
    if not address:
        raise MemoryError("malloc failed")
    ctypes.memmove(address, data, len(data))
    return int(address), len(data)


def present(command: list[str], env: dict[str, str]) -> str | None:
    """Make /proc/self/cmdline and /proc/self/environ (what ``ps``, ``pgrep -f`` and psutil
    read) `command` and `env`, as they are for a process exec'd with them: the kernel's
    pointers to both moved to new memory (``PR_SET_MM_MAP``, no privilege needed). None
    once done, else why not (the kernel's error)."""
    encode = os.fsencode
    libc = ctypes.CDLL(None, use_errno=True)
    args, argsize = _outliving(libc, b"".join(encode(a) + b"\0" for a in command))
    envs, envsize = _outliving(libc, b"".join(encode(f"{k}={v}") + b"\0" for k, v in env.items()))
    try:
        raw = open("/proc/self/stat", "rb").read()  # noqa: SIM115 - read at once
    except OSError as exc:
        return f"/proc/self/stat: {exc.strerror}"
    fields = raw[raw.rindex(b")") + 2 :].split()  # the first is field 3
    values = {name: int(fields[n - 3]) for name, n in _STAT_FIELDS.items()}
    libc.sbrk.restype = ctypes.c_void_p
    mm = _MMMap(
        **values, brk=libc.sbrk(0) or values["start_brk"], arg_start=args, arg_end=args + argsize,
        env_start=envs, env_end=envs + envsize, auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF,
    )  # fmt: skip
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm), ctypes.sizeof(mm), 0) != 0:
        return f"prctl(PR_SET_MM_MAP): {os.strerror(ctypes.get_errno())}"
    return None


#: Extensions that count their objects and report those still alive at exit as leaked
#: (triton's nanobind, under torch._dynamo). When the preload imported one, the frozen
#: objects are collectable again at exit. Otherwise they stay frozen: unfreezing makes the
#: exit's collection walk, and copy page by page, the whole preloaded heap (0.7 CPU-s of
#: every rank's and self-test worker's exit, against 0.35 left frozen), and Python does not
#: promise finalizers at exit for objects still alive (none of them is the program's own).
COUNT_THEIR_OBJECTS = ("triton",)

#: A preloaded name that stands for trainguard's whole rank side (every module behind
#: trainguard.torch's public names, which that module itself imports lazily).
TRAINGUARD_TORCH = "trainguard.torch"


def preload(modules: list[str]) -> tuple[list[str], dict[str, str]]:
    """Import `modules` (those that fail are reported, not fatal: the rank imports them
    itself and fails as it would have)."""
    done: list[str] = []
    failed: dict[str, str] = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
            if name == TRAINGUARD_TORCH:
                for implementation in sorted(set(module.EXPORTS.values())):
                    importlib.import_module(implementation)
            done.append(name)
        except Exception as exc:  # any import-time error is the rank's to meet
            failed[name] = f"{type(exc).__name__}: {exc}"
    return done, failed


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> dict[str, Any]:
    """Fork a child per request until the launcher closes its end (then exit). Returns only
    in a child, with its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    children: set[int] = set()
    while True:
        _reap(sock, children)
        ready = select.select([sock.fileno(), wake_r], [], [])[0]  # retried on EINTR (PEP 475)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if sock.fileno() not in ready:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, STDIO_FDS)
        if not data:  # the launcher is gone: so are we (the children follow, PDEATHSIG)
            sys.exit(0)
        if len(fds) != STDIO_FDS:
            for fd in fds:
                os.close(fd)
            send(sock, {"error": f"a spawn request needs {STDIO_FDS} descriptors, got {len(fds)}"})
            continue
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(wake_r)
            os.close(wake_w)
            _become(request, fds, sock, server)
            return request
        for fd in fds:
            os.close(fd)
        children.add(pid)
        send(sock, {"pid": pid})


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            children.discard(pid)
            send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket, server: int) -> None:
    """In the child of `server`: the process a fresh ``python`` would have started for
    `request`."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:  # the server died before the prctl: as if it fired
        os.kill(os.getpid(), signal.SIGKILL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    present(request["command"], request["env"])  # checked by the server: it forks only if it can
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    script = request.get("script")
    sys.path[0] = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()
    _stdio(bool(request.get("unbuffered")))
    _reseed()
    importlib.invalidate_caches()  # files written since the server started
    gc.enable()


def _stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr as the interpreter makes them for these descriptors."""
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, old in ((0, sys.stdin), (1, sys.stdout), (2, sys.stderr)):
        raw = io.FileIO(fd, "w" if fd else "r", closefd=False)
        buffered: Any = io.BufferedReader(raw) if fd == 0 else raw if unbuffered else io.BufferedWriter(raw)
        write_through = unbuffered and fd != 0
        line_buffering = not write_through and (fd == 2 or os.isatty(fd))
        errors = "backslashreplace" if fd == 2 else old.errors
        wrapper = io.TextIOWrapper(buffered, old.encoding, errors, None, line_buffering, write_through)
        streams.append(wrapper)
    sys.stdin, sys.stdout, sys.stderr = streams
    for name, stream in zip(("__stdin__", "__stdout__", "__stderr__"), streams, strict=True):
        setattr(sys, name, stream)  # what a fresh interpreter's originals are


def _reseed() -> None:
    """Fresh random state, as a new interpreter has (`random` reseeds itself after a fork;
    numpy's global generator, seeded from the OS when imported, does not)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run(request: dict[str, Any]) -> None:
    """Run the rank's program as ``__main__``, as ``python script.py`` / ``python -m mod``."""
    if request.get("module"):
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return
    import types
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(request["script"])
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = SourceFileLoader("__main__", path)
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__spec__ = None
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def main(argv: list[str]) -> dict[str, Any]:
    sock = socket.socket(fileno=int(argv[0]))
    with open("/proc/self/cmdline", "rb") as own:  # the check: this process as it is
        command = [os.fsdecode(a) for a in own.read().split(b"\0")[:-1]]
    return _serve_preloaded(sock, argv[1:], command, dict(os.environ))


def forked_server(
    sock: socket.socket, modules: list[str], command: list[str], env: dict[str, str]
) -> dict[str, Any]:
    """The server as the launcher's own fork (:func:`.fork_server.prefork`: torch already
    imported, with the ranks' import-time variables), made the process `command` with `env`
    would be: its own session, bound to the launcher, /dev/null for stdin and stdout, and
    `command` and `env` in /proc. Returns only in a child, with its request (then
    :func:`exit_as_program`)."""
    launcher = os.getppid()
    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before the prctl: as if it fired
        os.kill(os.getpid(), signal.SIGKILL)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.excepthook = sys.__excepthook__  # the launcher's CLI may have set its own
    return _serve_preloaded(sock, modules, command, env)


def _serve_preloaded(
    sock: socket.socket, modules: list[str], command: list[str], env: dict[str, str]
) -> dict[str, Any]:
    start = time.monotonic()
    done, failed = preload(modules)
    gc.collect()
    gc.freeze()  # the preloaded objects out of the collector's way: fewer copied pages per child
    gc.disable()
    if any(name in sys.modules for name in COUNT_THEIR_OBJECTS):
        # Collectable again at exit, in the server and in every child (inherited; registered
        # first, it runs after a program's own atexit hooks), or such an extension reports
        # the frozen ones as leaked on stderr (the rank's, or the launcher's for the server).
        atexit.register(gc.unfreeze)
    presents = present(command, env)  # the check (and, in a fork, what /proc shows of it)
    ready = {"ready": done, "failed": failed, "import_s": round(time.monotonic() - start, 3)}
    send(sock, {**ready, "presents": presents})
    return serve(sock)


def exit_as_program(request: dict[str, Any]) -> NoReturn:
    """Run the rank's program in a child of a forked server (:func:`forked_server`), deep in
    the launcher's call stack, and end as the interpreter ends a program: SystemExit with
    its status through to the interpreter's own exit (atexit hooks, threads joined), an
    uncaught exception's traceback from the program's frames on (as ``python`` prints it:
    none of the launcher's), then status 1."""
    try:
        run(request)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code is not run.__code__:
            tb = tb.tb_next
        if tb is not None:
            exc.__traceback__ = tb.tb_next
        sys.excepthook(type(exc), exc, exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt):  # python ends as usual, then by SIGINT itself
            threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own steps
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    run(main(sys.argv[1:]))
