"""`trainguard launch` across hosts (issue 17), on this one machine: host agents as separate
process trees with their own --node-name, torch's c10d rendezvous on localhost, the
README's example (docs/examples/train_tiny.py, with dropout and AdamW) on real gloo ranks,
offline (no broker)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
STEPS = 160


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_STEPS": str(STEPS), "TRAIN_CHECKPOINT_EVERY": "10"}
    env["TRAIN_MODEL"] = "dropout-adamw"  # the masks come from each rank's RNG: restored too
    # Offline: the suite's broker (scripts/test exports it) must not reach plain torchrun's ranks.
    unset = ("TRAINGUARD_EXAMPLE_FAULT", "TRAINGUARD_INJECT_WRONG_DEVICE", "TRAINGUARD_LAUNCHER_FAULT")
    for name in (*unset, "TRAINGUARD_BOOTSTRAP", "TRAINGUARD_TOPIC_PREFIX", "TRAINGUARD_SECRET_FILE"):
        env.pop(name, None)
    return env


def agent(
    node: str, endpoint: str, ckpt: Path, workdir: Path, log: str = "", *extra: str
) -> subprocess.Popen[str]:
    """One host's agent, with torchrun's flags and the example in torchrun's form."""
    command = [
        sys.executable, "-m", "trainguard", "launch", "--offline",
        "--nnodes", "3:3", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "multihost-test",
        "--local-addr", "127.0.0.1", "--node-name", node,
        "--checkpoint-dir", str(ckpt), "--max-restarts", "2", "--decision-wait-s", "1", *extra,
        str(EXAMPLE),
    ]  # fmt: skip
    out = (workdir / f"{log or node}.log").open("w")
    return subprocess.Popen(
        command, env=environment(), cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """The whole host gone: its agent and every rank it started (they run in sessions of
    their own), at once."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(30)


def attempted(ckpt: Path, node: str) -> bool:
    """`node`'s agent journaled an attempt: it is in a world."""
    journal = ckpt / ".trainguard" / "hosts" / node / "launcher.actions.jsonl"
    return journal.exists() and '"op":"attempt"' in journal.read_text()


def final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    (path,) = list(ckpt.glob(".trainguard/**/final.pt"))
    weights: dict[str, torch.Tensor] = torch.load(path)
    return weights


def test_a_lost_host_is_replaced_by_a_spare_and_the_run_ends_bitwise(tmp_path: Path) -> None:
    clean_ckpt = tmp_path / "clean"
    clean = subprocess.run(
        [sys.executable, "-m", "trainguard", "launch", "--offline", "--nproc", "6", "--ranks-per-node", "2",
         "--run-id", "multihost-clean", "--checkpoint-dir", str(clean_ckpt), str(EXAMPLE)],
        env=environment(), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]

    ckpt = tmp_path / "ckpt"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = {"host-a": agent("host-a", endpoint, ckpt, tmp_path)}
    time.sleep(2)  # host-a hosts the rendezvous store
    agents |= {name: agent(name, endpoint, ckpt, tmp_path) for name in ("host-b", "host-c")}
    try:
        deadline = time.monotonic() + 240
        while not all(attempted(ckpt, name) for name in agents):  # the world of three formed
            assert time.monotonic() < deadline, "the first round never completed"
            time.sleep(0.1)
        agents["spare-1"] = agent("spare-1", endpoint, ckpt, tmp_path)  # waits: the job is at MAX
        while not (ckpt / "step-000000049" / "VALIDATED").exists():
            assert time.monotonic() < deadline, "no checkpoint at step 49"
            assert agents["host-a"].poll() is None, (tmp_path / "host-a.log").read_text()[-3000:]
            time.sleep(0.1)
        kill_tree(agents["host-b"])
        listed = SharedQuarantine(ckpt)
        while "host-b" not in listed.nodes():  # the survivors found it lost: out of the run
            assert time.monotonic() < deadline, "host-b was never quarantined"
            time.sleep(0.1)
        assert listed.nodes()["host-b"].startswith("host lost")
        # The host comes back (its agent restarted with the same name): it is not readmitted.
        back = agent("host-b", endpoint, ckpt, tmp_path, log="host-b-again")
        assert back.wait(120) == 1
        assert "host-b is quarantined for run multihost-test" in (tmp_path / "host-b-again.log").read_text()
        for name in ("host-a", "host-c", "spare-1"):
            assert agents[name].wait(300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in agents.values():
            kill_tree(proc)
    # The survivors' ranks died with host-b's (gloo: connection reset); each survivor
    # recorded the crash, and the spare's ranks took host-b's place from the checkpoint.
    for name in ("host-a", "host-c"):
        restarts = ckpt / ".trainguard" / "hosts" / name / "restarts.jsonl"
        (restart,) = [json.loads(line) for line in restarts.open()]
        assert restart["cause"] == "crash" and restart["resumed_from_step"] >= 49, restart
    journal = ckpt / ".trainguard" / "hosts" / "spare-1" / "launcher.actions.jsonl"
    (spare_attempt,) = [r for r in map(json.loads, journal.open()) if r["op"] == "attempt"]
    assert "host-b" not in spare_attempt["nodes"] and spare_attempt["resume"] >= 49
    expected, got = final_weights(clean_ckpt), final_weights(ckpt)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights diverged"


def test_one_script_runs_under_torchrun_and_trainguard_launch_with_the_same_flags(
    tmp_path: Path,
) -> None:
    """Replacing `torchrun` by `trainguard launch` is the whole change: the same flags, the
    same script in torchrun's form, the same environment (trainguard's settings in it);
    both runs train the same weights."""
    finals = {}
    for name, launcher in (
        ("torchrun", ["-m", "torch.distributed.run"]),
        ("trainguard", ["-m", "trainguard", "launch"]),
    ):
        workdir = tmp_path / name
        workdir.mkdir()
        flags = [
            "--nnodes", "1:1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"same-{name}",
        ]  # fmt: skip
        env = environment() | {
            "TRAINGUARD_CHECKPOINT_DIR": str(workdir / "ckpt"),
            "TRAINGUARD_RUN_DIR": str(workdir),  # where the example writes final.pt
            "TRAINGUARD_OFFLINE": "1",
            "TRAIN_STEPS": "40",
        }
        done = subprocess.run(
            [sys.executable, *launcher, *flags, str(EXAMPLE)],
            env=env, cwd=workdir, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        (final,) = list(workdir.glob("**/final.pt"))
        finals[name] = torch.load(final)
    assert finals["torchrun"].keys() == finals["trainguard"].keys()
    assert all(torch.equal(finals["torchrun"][k], finals["trainguard"][k]) for k in finals["torchrun"])


def test_with_no_spare_left_the_run_stops_naming_the_host_its_cause_and_the_missing_spare(
    tmp_path: Path,
) -> None:
    """A world of three hosts, one of them out (found lost earlier: on the run's shared list):
    the agent left alone cannot form a round, and says who is out, why, and that no spare
    came, instead of waiting forever."""
    ckpt = tmp_path / "ckpt"
    lost = "host lost: its agent left the rendezvous during attempt 3"
    SharedQuarantine(ckpt).add("host-b", lost, by="host-c")
    endpoint = f"127.0.0.1:{free_port()}"
    alone = agent("host-a", endpoint, ckpt, tmp_path, "", "--rdzv-conf", "join_timeout=4")
    assert alone.wait(120) == 1
    text = (tmp_path / "host-a.log").read_text()
    assert "no round of 3 to 3 hosts formed within 4 s" in text, text[-2000:]
    assert f"host-b: {lost}" in text
    assert "No spare host joined" in text
