"""Ranks never outlive their agent (issue 44): killing only the launcher process (not its
group: the ranks run in sessions of their own) leaves no rank process of the run after
5 s, in a full-restart run and under in-process restart with a warm spare
(producers/launcher/agent_bound.py), and so does the fork server they were forked from
(they die with it); a rank the launcher did not spawn itself ends
through the rank side's watch (producers/training/agent_watch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from trainguard.producers.launcher.agent_bound import bound
from trainguard.producers.launcher.journal import rank_processes

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

#: Notes its pid when it starts (a warm spare too), then trains forever: a beat file
#: rewritten every 50 ms, as a rank writes its progress.
TRAINS_FOREVER = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    out = Path(os.environ["FAKE_OUT"])
    (out / f"proc-{os.getpid()}").write_text("")
    from trainguard.producers.training import inprocess

    def main():
        beat = out / f"rank-{os.environ['RANK']}.beat"
        while True:
            beat.write_text(str(time.time()))
            time.sleep(0.05)

    if __name__ == "__main__":
        inprocess.run(main)
    """
)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize(  # the rank processes (a warm spare too), and the fork server they were
    ("flags", "processes", "servers"),  # forked from (producers/launcher/fork_server.py), if any
    [
        (["--preload", "none"], 2, 0),
        ([], 2, 1),  # the default: forked
        (["--restart", "in-process", "--warm-spares", "1", "--preload", "torch"], 3, 1),
    ],
    ids=["full-spawned", "full", "in-process-warm-spare-forked"],
)
def test_killing_only_the_agent_leaves_no_rank_running_after_5_s(
    tmp_path: Path, flags: list[str], processes: int, servers: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(TRAINS_FOREVER)
    argv = [sys.executable, "-m", "trainguard", "launch", "--nproc", "2", "--offline", "--self-test", "off"]
    argv += ["--run-id", "agent-kill", "--checkpoint-dir", str(tmp_path / "ckpt"), *flags]
    argv += ["--", sys.executable, str(script)]
    env = {**os.environ, "FAKE_OUT": str(out), "OMP_NUM_THREADS": "1"}
    with (tmp_path / "launcher.log").open("w") as log:  # not a pipe: ranks left behind would hold it
        launcher = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not all((out / f"rank-{r}.beat").exists() for r in range(2)) or (
            len(list(out.glob("proc-*"))) < processes
        ):
            assert launcher.poll() is None and time.monotonic() < deadline, (
                tmp_path / "launcher.log"
            ).read_text()
            time.sleep(0.1)
        ranks = psutil.Process(launcher.pid).children(recursive=True)
        started = {int(p.name.removeprefix("proc-")) for p in out.glob("proc-*")}
        assert started <= {p.pid for p in ranks} and len(ranks) == processes + servers, (started, ranks)
        assert all(os.getsid(p.pid) == p.pid for p in ranks)  # own sessions: the agent's group misses them

        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone
        assert launcher.wait(10) == -signal.SIGKILL
        killed = time.monotonic()
        while any(running(p) for p in ranks) and time.monotonic() < killed + 5:
            time.sleep(0.05)
        assert [p.pid for p in ranks if running(p)] == [], "ranks outlived their agent"
        assert rank_processes(tmp_path / "ckpt" / ".trainguard") == {}  # as a successor would look
        beats = {r: (out / f"rank-{r}.beat").read_text() for r in range(2)}
        time.sleep(0.3)
        assert {r: (out / f"rank-{r}.beat").read_text() for r in range(2)} == beats  # no more writes
    finally:
        for proc in [psutil.Process(launcher.pid)] if launcher.poll() is None else []:
            proc.kill()
        for proc in ranks:  # only if the assertion above failed
            if running(proc):
                proc.kill()


def test_a_bound_program_that_cannot_run_says_so_and_exits_127() -> None:
    done = subprocess.run(bound(["/nonexistent/trainguard-rank"]), capture_output=True, text=True, timeout=30)
    assert done.returncode == 127
    assert "cannot run '/nonexistent/trainguard-rank'" in done.stderr


WATCHED = textwrap.dedent(
    """
    import time
    from trainguard.producers.training import agent_watch
    agent_watch.start()
    print("watching", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("reaped", [True, False], ids=["agent-reaped", "agent-zombie"])
def test_a_rank_that_is_not_the_agents_child_ends_once_the_agent_is_gone(reaped: bool) -> None:
    """The rank side's watch: a process whose TRAINGUARD_AGENT_PID names a process that
    dies (reaped, or left a zombie by its parent) SIGKILLs itself within a second."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = {**os.environ, "TRAINGUARD_AGENT_PID": str(agent.pid)}
    rank = subprocess.Popen([sys.executable, "-c", WATCHED], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "watching\n"
        time.sleep(0.6)
        assert rank.poll() is None  # the agent lives: so does the rank
        agent.kill()
        if reaped:
            agent.wait()
        else:  # a zombie until its parent waits: gone all the same
            while psutil.Process(agent.pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.01)
        assert rank.wait(3) == -signal.SIGKILL
    finally:
        for proc in (agent, rank):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
