"""The checkpoint store (producers/checkpoint/storage.py) behaves the same on a local
directory, on fsspec's memory:// (no atomic rename, no directories of its own) and on an
S3 endpoint (tests/producers/s3_server.py): a DCP save and load round trip, the commit
files written whole, listing, digests and deletion; an uninstalled protocol is refused."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainguard.common.checkpoint_location import LocationError
from trainguard.producers.checkpoint.storage import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def uninstalled_protocol() -> str:
    """A protocol fsspec knows whose package is not installed here (gcsfs, adlfs, ...)."""
    for protocol in ("gs", "az", "oci", "dropbox", "box"):
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError:
            return protocol
    raise AssertionError("every candidate filesystem package is installed")


@pytest.fixture(params=["local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ckpt"))
    if request.param == "s3":
        return CheckpointStore(f"{request.getfixturevalue('s3').bucket()}/ckpt")
    return CheckpointStore(f"memory://ckpt-{uuid.uuid4().hex[:8]}")


def test_a_dcp_round_trip_and_the_commit_files(store: CheckpointStore) -> None:
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    dcp.save({"app": state}, storage_writer=store.child("step-000000007").dcp_writer(), no_dist=True)
    store.write_json({"step": 7, "files": store.names("step-000000007")}, "step-000000007", "MANIFEST.json")
    assert store.names() == ["step-000000007"]
    assert {".metadata", "MANIFEST.json"} <= set(store.names("step-000000007"))
    manifest = store.read_json("step-000000007", "MANIFEST.json")
    assert manifest is not None and manifest["step"] == 7
    raw = store.fs.cat_file(store.path("step-000000007", ".metadata"))
    assert store.digest("step-000000007", ".metadata") == (hashlib.sha256(raw).hexdigest(), len(raw))

    loaded = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp.load({"app": loaded}, storage_reader=store.child("step-000000007").dcp_reader(), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and int(loaded["step"]) == 7

    store.remove("step-000000007")
    assert store.names() == [] and not store.exists("step-000000007", "MANIFEST.json")
    store.remove("step-000000007")  # already gone: nothing


def test_missing_and_unreadable_files_read_as_none(store: CheckpointStore) -> None:
    assert store.read_json("step-000000001", "VALIDATED") is None
    store.fs.makedirs(store.path("step-000000001"), exist_ok=True)
    store.fs.pipe_file(store.path("step-000000001", "VALIDATED"), b"{not json")
    assert store.read_json("step-000000001", "VALIDATED") is None
    assert store.names("nowhere") == []


def test_a_local_commit_file_leaves_no_temporary_behind(tmp_path: Path) -> None:
    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    assert store.local
    store.write_json({"ok": True}, "step-000000002", "VALIDATED")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-000000002").iterdir()) == ["VALIDATED"]


def test_a_protocol_without_its_package_is_refused_with_the_reason() -> None:
    missing = uninstalled_protocol()
    with pytest.raises(LocationError, match=f"{missing}://"):
        CheckpointStore(f"{missing}://bucket/ckpt")
    with pytest.raises(LocationError):
        CheckpointStore("nosuchprotocol://bucket/ckpt")
