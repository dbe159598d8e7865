"""`trainguard launch` across hosts (issue 17), on this one machine, offline (no broker):
the same script under torchrun and trainguard launch, and the agent left without a world.
The whole-host loss through the broker and processor is test_multihost_broker.py; hosts
checkpointing to a bucket, test_multihost_bucket.py (a slow variant)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.hosts import EXAMPLE, agent, environment
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine

torch = pytest.importorskip("torch")


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
        env = environment(40) | {
            "TRAINGUARD_CHECKPOINT_DIR": str(workdir / "ckpt"),
            "TRAINGUARD_RUN_DIR": str(workdir),  # where the example writes final.pt
            "TRAINGUARD_OFFLINE": "1",
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
    SharedQuarantine(ckpt / ".trainguard").add("host-b", lost, by="host-c")
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ("--offline", "--rdzv-conf", "join_timeout=4")
    alone = agent("host-a", endpoint, ckpt, tmp_path, environment(160), extra=extra)
    assert alone.wait(120) == 1
    text = (tmp_path / "host-a.log").read_text()
    assert "no round of 3 to 3 hosts formed within 4 s" in text, text[-2000:]
    assert f"host-b: {lost}" in text
    assert "No spare host joined" in text
