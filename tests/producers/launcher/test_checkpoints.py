"""The launcher's view of the checkpoint location (producers/launcher/checkpoints.py): a
location it cannot list is logged once per distinct error, not on every poll, and its
recovery once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.launcher.checkpoints import validated_steps


def test_an_unlistable_location_is_logged_once_per_error_and_its_recovery_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000000005").mkdir(parents=True)
    (ckpt / "step-000000005" / "MANIFEST.json").write_text("{}")
    (ckpt / "step-000000005" / "VALIDATED").write_text("ok")
    listing = CheckpointStore.names
    outage: list[OSError] = []

    def names(self: CheckpointStore, *parts: str) -> list[str]:
        if outage:  # the object store's answer while it is out
            raise outage[0]
        return listing(self, *parts)

    monkeypatch.setattr(CheckpointStore, "names", names)
    caplog.set_level(logging.INFO, logger="trainguard.producers.launcher.checkpoints")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert validated_steps(ckpt).keys() == {5}
    outage.append(ConnectionResetError("connection reset by peer"))
    for _ in range(20):  # an eviction waiting for a newer checkpoint polls every 0.5 s
        assert validated_steps(ckpt) == {}
    assert len(warnings()) == 1 and "not listed: connection reset by peer" in warnings()[0]
    outage[0] = TimeoutError("read timed out")  # another error: said once more
    for _ in range(5):
        validated_steps(ckpt)
    assert len(warnings()) == 2 and "read timed out" in warnings()[1]

    outage.clear()
    assert validated_steps(ckpt).keys() == validated_steps(ckpt).keys() == {5}
    assert sum("listed again" in r.getMessage() for r in caplog.records) == 1
    outage.append(ConnectionResetError("connection reset by peer"))
    validated_steps(ckpt)
    assert len(warnings()) == 3  # a new outage is news, even with the first one's words
