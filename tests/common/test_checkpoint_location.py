"""Which checkpoint locations a run accepts (trainguard/common/checkpoint_location.py): a path or a
file:// URI, an fsspec URL whose package is installed; every other one refused in a
sentence that says why (`trainguard launch` and the run API: tests/cli/test_errors.py,
tests/processors/test_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.producers.checkpoint.test_storage import uninstalled_protocol
from trainguard.common.checkpoint_location import LocationError, checkpoint_location


def test_paths_file_uris_and_installed_object_stores_are_accepted(tmp_path: Path) -> None:
    assert checkpoint_location(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")
    assert checkpoint_location(f"file://{tmp_path}/ckpt") == str(tmp_path / "ckpt")
    assert checkpoint_location("s3://bucket/runs/ckpt") == "s3://bucket/runs/ckpt"  # s3fs: the dev extra


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("", "an empty checkpoint location"),
        ("file://relative/ckpt", "needs an absolute path"),
        ("nosuch://bucket/ckpt", "no filesystem is known for nosuch://"),
        ("memory://ckpt", "one process's memory"),
        ("https://example.com/ckpt", "read-only"),
        ("s3://", "name a bucket"),
    ],
)
def test_unusable_locations_are_refused_with_the_reason(uri: str, reason: str) -> None:
    with pytest.raises(LocationError, match=reason):
        checkpoint_location(uri)


def test_a_store_whose_package_is_missing_is_refused_where_ranks_run_only() -> None:
    missing = uninstalled_protocol()
    with pytest.raises(LocationError, match=f"(?i){missing}://bucket/ckpt.*install"):
        checkpoint_location(f"{missing}://bucket/ckpt")
    # The run API's host only checks the form: the package matters where the ranks run.
    assert checkpoint_location(f"{missing}://bucket/ckpt", need_package=False) == f"{missing}://bucket/ckpt"
