"""The compiled core (processors/core/compiled.py) and block checks (schemas/compiled.py)
decide exactly what the Python decides (when a build is used: tests/test_compiled_build.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.compiled_build import PURE_ENV
from trainguard.processors.core import compiled, goodput
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import encode

from ..simulated import packed_records

#: Folds a library scenario's packed records and prints a digest of every decision and
#: dead letter, the run's goodput and which core ran (run in a fresh interpreter).
_FOLD = """
import sys
from tests.processors.test_compiled import decisions_digest
from trainguard.processors.core import compiled
from trainguard.schemas import block_check
print(compiled.active() and not block_check.__file__.endswith(".py"), decisions_digest(sys.argv[1]))
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
        window = f"{len(run.seen)} {len(run.seen.ids)}"  # the dedupe window's ids, in age order and as a set
        digest.update(f"{key} {goodput(run)!r} {run.duplicates} {run.stale} {window}".encode())
    return digest.hexdigest()


def fold_in(name: str, pure: bool) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    if pure:
        env[PURE_ENV] = "1"
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
