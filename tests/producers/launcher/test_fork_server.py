"""The fork server (producers/launcher/fork_server.py, zygote.py): a rank forked from a
process that imported torch is the process a fresh ``python script.py`` would have been.
Each check runs the same probe both ways, a new interpreter (as torch elastic's Popen
starts it) and a fork of a real server, and compares what the probe saw."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.producers.launcher.config import PRELOAD
from trainguard.producers.launcher.fork_server import (
    ForkedHandler,
    ForkServer,
    ForkServers,
    Program,
    ServerGone,
    forkable,
)
from trainguard.producers.launcher.journal import ENV_ATTEMPT, ENV_RUN_DIR, alive, rank_processes

PROBE = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading, time
    mode = os.environ["PROBE_MODE"]
    seen = {
        "argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
        "env": dict(os.environ), "spec": __spec__ and [__spec__.name, __spec__.origin],
        "main": sys.modules["__main__"].__dict__ is globals(),
        "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
        "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.errors],
        "own_session": os.getsid(0) == os.getpid(), "stdin_tty": sys.stdin.isatty(),
        # what ps, pgrep -f and an operator's /proc lookup read
        "proc_cmdline": open("/proc/self/cmdline", "rb").read().split(b"\\0")[:-1],
        "proc_environ": sorted(open("/proc/self/environ", "rb").read().split(b"\\0")[:-1]),
    }
    seen["proc_cmdline"] = [a.decode() for a in seen["proc_cmdline"]]
    seen["proc_environ"] = [a.decode() for a in seen["proc_environ"]]
    if mode == "numpy":
        import numpy
        seen = {"draw": numpy.random.randint(1 << 30)}
    if mode == "threads":
        import torch
        seen = {"threads": torch.get_num_threads()}
    print(json.dumps(seen))
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("the probe's own error")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "shutdown":  # the interpreter's exit: threads joined, then atexit hooks, in order
        atexit.register(lambda: print("atexit", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    if mode == "sleep":
        time.sleep(60)
    if mode == "finalizer":  # a global's finalizer, run by the interpreter's teardown
        class Last:
            def __del__(self):
                print("finalized", flush=True)
        last = Last()
    """
)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    srv = ForkServer(list(PRELOAD), {**os.environ, "OMP_NUM_THREADS": "1"})
    assert srv.wait_ready()["ready"] == list(PRELOAD)
    yield srv
    srv.close()


def _probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _both(
    server: ForkServer, tmp_path: Path, mode: str, command: list[str] | None = None
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """(returncode, stdout, stderr) of the probe as a new interpreter and as a fork."""
    command = command or [sys.executable, "-u", str(_probe(tmp_path)), "--lr", "3e-4"]
    env = {**os.environ, "PROBE_MODE": mode, "RANK": "1", "OMP_NUM_THREADS": "1"}
    out = []
    for how in ("fresh", "forked"):
        stdout, stderr = tmp_path / f"{how}.out", tmp_path / f"{how}.err"
        with stdout.open("w") as o, stderr.open("w") as e:
            if how == "fresh":
                rc = subprocess.Popen(command, env=env, stdout=o, stderr=e, start_new_session=True).wait(60)
            else:
                program = forkable(command)
                assert program is not None
                rc = server.spawn(program, env, [0, o.fileno(), e.fileno()], os.getcwd()).wait(60)
        out.append((rc, stdout.read_text(), stderr.read_text()))
    return out[0], out[1]


def test_a_forked_rank_sees_what_a_new_interpreter_sees(server: ForkServer, tmp_path: Path) -> None:
    fresh, forked = _both(server, tmp_path, "report")
    assert fresh[0] == forked[0] == 0, (fresh[2], forked[2])
    seen = json.loads(forked[1])
    assert seen == json.loads(fresh[1])  # argv, __main__, env, stdio, session, /proc's view
    assert seen["proc_cmdline"] == [sys.executable, "-u", str(tmp_path / "probe.py"), "--lr", "3e-4"]
    assert "PROBE_MODE=report" in seen["proc_environ"]


def test_a_server_that_cannot_show_a_ranks_command_line_forks_none(tmp_path: Path) -> None:
    """Where the kernel refuses PR_SET_MM_MAP, the server's ready message says why, and no
    rank is forked: each is a new process (this kernel allows it: the answer is replaced)."""
    script = _probe(tmp_path)
    servers = ForkServers(["json"], [sys.executable, str(script)], dict(os.environ))
    try:
        srv = servers.get({})
        assert srv is not None and srv.cannot_present() is None  # this kernel lets a fork present itself
        assert srv.ready is not None
        srv.ready["presents"] = "prctl(PR_SET_MM_MAP): Operation not permitted"  # as a refusing kernel says
        assert servers.get({}) is None and servers.refused is not None
        program = servers.program
        assert program is not None
        with pytest.raises(ServerGone, match="could not show its command line"):
            srv.spawn(program, dict(os.environ), [0, 1, 2], os.getcwd())
    finally:
        servers.close()


def test_a_module_run_with_dash_m_is_the_same_too(server: ForkServer, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # -m finds the package from the working directory
    try:
        fresh, forked = _both(server, tmp_path, "report", [sys.executable, "-m", "pkg.probe", "x"])
    finally:
        os.chdir(cwd)
    assert fresh[0] == forked[0] == 0, (fresh[2], forked[2])
    seen = json.loads(forked[1])
    assert seen == json.loads(fresh[1]) and seen["argv"] == [str(tmp_path / "pkg" / "probe.py"), "x"]


@pytest.mark.parametrize("mode", ["exit3", "raise", "interrupt", "kill", "shutdown"])
def test_exits_as_a_new_interpreter_exits(server: ForkServer, tmp_path: Path, mode: str) -> None:
    fresh, forked = _both(server, tmp_path, mode)
    assert forked[0] == fresh[0] == {"exit3": 3, "raise": 1, "interrupt": -signal.SIGINT,
                                     "kill": -signal.SIGKILL, "shutdown": 0}[mode]  # fmt: skip
    assert forked[1].splitlines()[1:] == fresh[1].splitlines()[1:]  # "thread done" before "atexit"
    if mode in ("exit3", "shutdown"):  # nothing on stderr (no extension's warnings at exit either)
        assert forked[2] == fresh[2] == ""
    if mode == "raise":  # the traceback on stderr, as python prints it
        assert forked[2].strip().endswith("ValueError: the probe's own error")
        assert f'File "{tmp_path / "probe.py"}"' in forked[2]


#: The launcher's side of a preforked server, as `trainguard launch` does it: torch imported
#: as the ranks import it, then the server forked before any thread; each probe mode run
#: once by a fork of it, its (returncode, stdout, stderr) and the server's /proc printed.
PREFORK_DRIVER = textwrap.dedent(
    """
    import json, os, sys, threading
    from trainguard.cli.ending import run_to_end
    from trainguard.producers.launcher.import_env import importing_as_ranks
    with importing_as_ranks(2):
        from trainguard.producers.launcher.config import PRELOAD
        from trainguard.producers.launcher.fork_server import ForkServers, forkable, prefork
    def launch():  # under the CLI's ending, as `trainguard launch` runs
      command, modes, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
      env = {**os.environ, "TRAINGUARD_RUN_DIR": out}
      server = prefork(PRELOAD, command, env)
      assert server is not None and threading.active_count() == 1
      servers = ForkServers(PRELOAD, command, env)
      assert servers.get({**os.environ, "OMP_NUM_THREADS": "1"}) is server  # the preforked one, taken
      ready = server.wait_ready()
      seen = {"ready": ready["ready"], "presents": ready["presents"], "import_s": ready["import_s"],
              "cmdline": open(f"/proc/{server.pid}/cmdline", "rb").read().decode().split(chr(0))[:-1],
              "environ": open(f"/proc/{server.pid}/environ", "rb").read().decode().split(chr(0))[:-1]}
      for mode in modes:
          with open(f"{out}/{mode}.out", "w") as o, open(f"{out}/{mode}.err", "w") as e:
              child = server.spawn(forkable(command), {**os.environ, "PROBE_MODE": mode, "RANK": "1",
                                   "OMP_NUM_THREADS": "1"}, [0, o.fileno(), e.fileno()], os.getcwd())
              seen[mode] = child.wait(60)
      servers.close()
      print(json.dumps(seen))
    run_to_end(launch)
    """
)
PREFORK_MODES = ["report", "threads", "exit3", "raise", "interrupt", "kill", "shutdown", "finalizer"]


def test_a_rank_forked_by_the_launchers_own_fork_is_what_a_new_interpreter_is(tmp_path: Path) -> None:
    """The server `trainguard launch` forks from itself (torch imported already, the launcher's
    CLI on its stack) serves ranks that are what a new interpreter is: the same view of
    argv, __main__, environment, stdio and /proc, torch's thread count, exits, tracebacks
    (the program's frames, none of the launcher's), atexit and thread joins. And the server
    shows its own command line and the run dir in /proc, as a spawned one."""
    command = [sys.executable, "-u", str(_probe(tmp_path)), "--lr", "3e-4"]
    out = tmp_path / "preforked"
    out.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(PREFORK_DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the user's usual launcher
    done = subprocess.run(
        [sys.executable, str(driver), json.dumps(command), json.dumps(PREFORK_MODES), str(out)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["ready"] == list(PRELOAD) and seen["presents"] is None
    assert seen["cmdline"][:3] == [sys.executable, "-m", "trainguard.producers.launcher.zygote"]
    assert f"{ENV_RUN_DIR}={out}" in seen["environ"] and "OMP_NUM_THREADS=1" in seen["environ"]
    for mode in PREFORK_MODES:
        fresh = (tmp_path / "fresh.out", tmp_path / "fresh.err")
        with fresh[0].open("w") as o, fresh[1].open("w") as e:
            probe_env = {**os.environ, "PROBE_MODE": mode, "RANK": "1", "OMP_NUM_THREADS": "1"}
            rc = subprocess.Popen(command, env=probe_env, stdout=o, stderr=e, start_new_session=True).wait(60)
        stdout, stderr = (out / f"{mode}.out").read_text(), (out / f"{mode}.err").read_text()
        assert seen[mode] == rc, (mode, stderr)
        if mode in ("report", "threads"):
            assert json.loads(stdout) == json.loads(fresh[0].read_text()), mode
        else:
            assert stdout.splitlines()[1:] == fresh[0].read_text().splitlines()[1:], mode
            assert stderr == fresh[1].read_text(), mode  # a traceback exactly as python prints it


def test_a_preloaded_extension_that_counts_its_objects_reports_no_leak_at_a_ranks_exit(
    tmp_path: Path,
) -> None:
    """Triton (under torch._dynamo) reports its objects still alive at exit as leaked: a
    server whose preload imported it lets them be collected at each child's exit (frozen,
    they were ~1.4 kB of "nanobind: leaked" on every rank's stderr), as a new interpreter's
    exit does; the default preload has no such extension, and its objects stay frozen."""
    srv = ForkServer(["torch", "torch._dynamo"], {**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert srv.wait_ready()["ready"] == ["torch", "torch._dynamo"]
        fresh, forked = _both(srv, tmp_path, "shutdown")
    finally:
        srv.close()
    assert forked[0] == fresh[0] == 0
    assert forked[2] == fresh[2] == ""


def test_closing_a_rank_that_ended_since_the_last_poll_is_not_an_error(
    server: ForkServer, tmp_path: Path
) -> None:
    """torch elastic closes a rank it polled alive by signalling its session: a forked rank
    that ended meanwhile is already reaped by the server (a spawned one would be a zombie,
    still signalable), and the close must not fail the launcher (a fresh-clone run:
    ProcessLookupError out of `trainguard launch`)."""
    script = _probe(tmp_path)
    handler = ForkedHandler(
        server, forkable([sys.executable, str(script)]), entrypoint=sys.executable, args=(str(script),),
        env={**os.environ, "PROBE_MODE": "exit3"}, stdout=str(tmp_path / "out"), stderr=str(tmp_path / "err"),
        local_rank_id=0, numa_options=None,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while alive(handler.proc.pid):  # ended and reaped, its exit not yet read by this side
        assert time.monotonic() < deadline
        time.sleep(0.02)
    handler.close(signal.SIGTERM)
    assert handler.proc.wait(10) == 3 and (tmp_path / "out").read_text().startswith("{")


def test_each_fork_draws_its_own_random_numbers(server: ForkServer, tmp_path: Path) -> None:
    script = _probe(tmp_path)
    program = forkable([sys.executable, str(script)])
    assert program is not None
    draws = set()
    for i in range(2):
        out = tmp_path / f"{i}.out"
        with out.open("w") as o:
            proc = server.spawn(
                program, {**os.environ, "PROBE_MODE": "numpy"}, [0, o.fileno(), 2], os.getcwd()
            )
            assert proc.wait(60) == 0
        draws.add(json.loads(out.read_text())["draw"])
    assert len(draws) == 2  # numpy's global generator reseeded in each child, as in new processes


def test_the_ranks_thread_count_is_what_torch_reads_at_import(tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read when torch is imported: the server starts with the ranks'."""
    script = _probe(tmp_path)
    program = forkable([sys.executable, str(script)])
    assert program is not None
    servers = ForkServers(["torch"], [sys.executable, str(script)], dict(os.environ))
    assert servers.program == program
    try:
        for threads in ("1", "2"):
            env = {**os.environ, "PROBE_MODE": "threads", "OMP_NUM_THREADS": threads}
            srv = servers.get(env)
            assert srv is not None
            out = tmp_path / f"{threads}.out"
            with out.open("w") as o:
                assert srv.spawn(program, env, [0, o.fileno(), 2], os.getcwd()).wait(60) == 0
            assert json.loads(out.read_text()) == {"threads": int(threads)}
    finally:
        servers.close()


def test_the_ranks_die_with_the_server_and_the_launcher_is_told(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    srv = ForkServer(["json"], {**os.environ, ENV_RUN_DIR: run_dir})
    program = forkable([sys.executable, str(_probe(tmp_path))])
    assert program is not None
    env = {**os.environ, "PROBE_MODE": "sleep", ENV_RUN_DIR: run_dir}
    procs = [
        srv.spawn(program, env | attempt, [0, 1, 2], os.getcwd()) for attempt in ({ENV_ATTEMPT: "4"}, {})
    ]
    deadline = time.monotonic() + 10  # a child shows its own environment once it made itself the rank
    while not all(b"PROBE_MODE" in Path(f"/proc/{p.pid}/environ").read_bytes() for p in procs):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # a relaunched launcher's recovery finds them by their environment, as spawned ones (the
    # attempt from the journal where the environment has none); not the server, this
    # process's own child (as a relaunched launcher's own is)
    assert rank_processes(Path(run_dir), {procs[1].pid: 3}) == {procs[0].pid: 4, procs[1].pid: 3}
    assert procs[0].poll() is None
    os.kill(srv.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p.pid) for p in procs)  # PR_SET_PDEATHSIG
    assert [p.wait(5) for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    srv.close()


def test_only_this_interpreter_running_a_script_or_a_module_is_forked(tmp_path: Path) -> None:
    script = str(_probe(tmp_path))
    command = (sys.executable, script, "--x")
    assert forkable(command) == Program((script, "--x"), command, script=script)
    command = (sys.executable, "-u", script)
    assert forkable(command) == Program((script,), command, script=script, unbuffered=True)
    command = (sys.executable, "-m", "pkg.train", "a")
    assert forkable(command) == Program(("pkg.train", "a"), command, module="pkg.train")
    other = tmp_path / "venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))  # the same binary, another environment
    for command in (
        [str(other / "python"), script],
        [sys.executable, "-c", "print(1)"],
        [sys.executable, "-X", "dev", script],
        [sys.executable, str(tmp_path / "missing.py")],
        ["sh", "-c", f"{sys.executable} {script}"],
        [sys.executable],
    ):
        assert forkable(command) is None, command


def test_a_presented_command_line_outlives_the_objects_that_made_it() -> None:
    """A rank's /proc/PID/cmdline and environ stay its own while its interpreter shuts down
    and frees its objects (they were Python buffers once: `ps` then showed freed memory
    for a rank's last seconds). Here: every object of the zygote module freed, the memory
    used again, then read."""
    probe = textwrap.dedent(
        """
        import gc, sys
        from trainguard.producers.launcher import zygote
        assert zygote.present(["tg-probe", "--lr", "3e-4"], {"PROBE": "outlives"}) is None
        zygote.__dict__.clear()
        del sys.modules["trainguard.producers.launcher.zygote"], zygote
        gc.collect()
        reuse = [bytes(k) for k in range(1, 4000) for _ in range(3)]
        print(open("/proc/self/cmdline", "rb").read().hex(), open("/proc/self/environ", "rb").read().hex())
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    cmdline, environ = (bytes.fromhex(part) for part in done.stdout.split())
    assert cmdline == b"tg-probe\0--lr\x003e-4\0"
    assert environ == b"PROBE=outlives\0"
