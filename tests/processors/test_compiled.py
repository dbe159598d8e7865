"""The compiled core (processors/core/compiled.py): used only while valid, and deciding
exactly what the Python core decides."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.processors.core import compiled, goodput
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import encode

from ..simulated import packed_records


@pytest.fixture
def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A build folder of our own (the real one is left alone), with no stamp yet."""
    folder = tmp_path / "_compiled"
    folder.mkdir()
    monkeypatch.setattr(compiled, "BUILD", folder)
    monkeypatch.setattr(compiled, "STAMP", folder / "stamp.json")
    monkeypatch.delenv(compiled.PURE_ENV, raising=False)
    return folder


def test_a_build_for_these_sources_goes_first_on_the_path(build: Path) -> None:
    (build / "stamp.json").write_text(json.dumps(compiled.stamp()))
    path = ["/the/sources"]
    assert compiled.use_build(path)
    assert path == [str(build), "/the/sources"]


def test_no_build_or_a_stale_one_leaves_the_python(build: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = ["/the/sources"]
    assert not compiled.use_build(path)  # nothing built
    stale = compiled.stamp()
    sources = dict(stale["sources"])  # type: ignore[call-overload]
    sources["engine"] = hashlib.sha256(b"the engine as it was").hexdigest()
    (build / "stamp.json").write_text(json.dumps({**stale, "sources": sources}))
    with caplog.at_level(logging.WARNING):
        assert not compiled.use_build(path)
    assert path == ["/the/sources"] and "stale" in caplog.text
    (build / "stamp.json").write_text(json.dumps({**compiled.stamp(), "python": "cpython-27"}))
    assert not compiled.use_build(path)  # another interpreter's build
    (build / "stamp.json").write_text("{not json")
    assert not compiled.use_build(path)


def test_pure_python_on_request(build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (build / "stamp.json").write_text(json.dumps(compiled.stamp()))
    monkeypatch.setenv(compiled.PURE_ENV, "1")
    assert not compiled.use_build(path := ["/the/sources"]) and path == ["/the/sources"]


#: Folds a library scenario's packed records and prints a digest of every decision and
#: dead letter, the run's goodput and which core ran (run in a fresh interpreter).
_FOLD = """
import sys
from tests.processors.test_compiled import decisions_digest
from trainguard.processors.core import compiled
print(compiled.active(), decisions_digest(sys.argv[1]))
"""


def decisions_digest(name: str) -> str:
    scenario = Scenario.builtin(name)
    driver, digest = CoreDriver(CorePolicy(), b"k" * 32), hashlib.sha256()
    for value in packed_records(scenario, "compiled-run", shard_ranks=16):
        result = driver.handle(value)
        for output in (*result.derived, *result.commands):
            digest.update(encode(output))
        for rejection in result.rejections:
            digest.update(f"{rejection.reason}: {rejection.detail}".encode() + rejection.raw)
    for key, run in sorted(driver.state.runs.items()):
        window = f"{len(run.seen)} {len(run.seen.ids)}"  # the dedupe window's deque and set
        digest.update(f"{key} {goodput(run)!r} {run.duplicates} {run.stale} {window}".encode())
    return digest.hexdigest()


def fold_in(name: str, pure: bool) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    if pure:
        env[compiled.PURE_ENV] = "1"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _FOLD, name], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", out[1]


@pytest.mark.skipif(not compiled.active(), reason="no valid compiled core here (scripts/setup builds one)")
def test_the_compiled_core_decides_what_the_python_core_decides() -> None:
    """A straggler run cut in 8 shards (block folds on the coordinator and on shards, the
    detector's decisions, goodput): every decision, dead letter and end figure the same."""
    compiled_run = fold_in("straggler-thermal", pure=False)
    python_run = fold_in("straggler-thermal", pure=True)
    assert compiled_run[0] and not python_run[0]  # each ran the core it was meant to
    assert compiled_run[1] == python_run[1]
