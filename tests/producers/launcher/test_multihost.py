"""`trainguard launch` across hosts (issue 17), on this one machine, offline (no broker):
the same script under torchrun and trainguard launch, the agent left without a world, and
a run whose checkpoints are in a bucket (a local S3 endpoint, tests/producers/s3_server.py)
with the launchers' shared state in --state-dir. The whole-host loss through the broker
and processor is test_multihost_broker.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine

from ..s3_server import S3
from .hosts import EXAMPLE, agent, clean_run, environment, log_tail

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


def test_across_hosts_checkpoints_in_a_bucket_and_the_shared_state_in_state_dir(
    tmp_path: Path, s3: S3
) -> None:
    """Two hosts checkpoint to a bucket; their beats, journals and quarantine list are in
    --state-dir (a bucket has no appends). A rank SIGKILLed at step 45 restarts both hosts
    from the newest validated checkpoint in the bucket, and the run ends with the weights
    of an uninterrupted run of the same world kept in a directory."""
    steps = 60
    (tmp_path / "clean").mkdir()
    clean_ckpt = clean_run(tmp_path / "clean", 4, steps, "bucket-clean")

    bucket, shared = f"{s3.bucket()}/run", tmp_path / "shared"
    endpoint, env = f"127.0.0.1:{free_port()}", environment(steps, TRAINGUARD_EXAMPLE_FAULT="kill:3:45:0")
    extra = ("--offline", "--state-dir", str(shared))
    hosts = {
        name: agent(name, endpoint, bucket, tmp_path, env, "2:2", "bucket-run", extra=extra)
        for name in ("host-a", "host-b")
    }
    codes = {name: proc.wait(300) for name, proc in hosts.items()}
    assert codes == {"host-a": 0, "host-b": 0}, [log_tail(tmp_path, name) for name in hosts]
    journals = sorted(p.parent.name for p in (shared / "hosts").glob("*/launcher.actions.jsonl"))
    assert journals == ["host-a", "host-b"]  # under --state-dir, none beside the checkpoints
    restarts = [json.loads(line) for p in (shared / "hosts").glob("*/restarts.jsonl") for line in p.open()]
    resumed = {r["resumed_from_step"] for r in restarts}
    assert len(resumed) == 1 and resumed <= {9, 19, 29, 39}, restarts  # before step 45, on both hosts
    bucket_fs = fsspec.filesystem("s3")
    assert bucket_fs.exists(f"{bucket}/step-{resumed.pop():09d}/VALIDATED")
    listed = {p.rsplit("/", 1)[-1] for p in bucket_fs.ls(bucket, detail=False)}
    assert f"step-{steps - 1:09d}" in listed and ".trainguard" not in listed

    (expected,) = list(clean_ckpt.glob(".trainguard/**/final.pt"))
    (resumed,) = list(shared.glob("**/final.pt"))
    want, got = torch.load(expected), torch.load(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
