"""`trainguard launch` across two hosts on this machine, offline, checkpointing to a bucket
(a local S3 endpoint, tests/producers/s3_server.py) with the launchers' shared state in
--state-dir."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from harness.hosts import agent, clean_run, environment, log_tail
from trainguard.producers.launcher.config import free_port

from ..s3_server import S3

torch = pytest.importorskip("torch")


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
