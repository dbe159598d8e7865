"""A run recorded through the real broker and the live processor, shared by the replay
and backtest tests: the demo's crash, hang and thermal straggler (evicted), 360 steps."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.devtools.stack import builtin_policy
from trainguard.kafka.topics import TopicNames
from trainguard.producers.simulator.driver import run_simulation
from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay.log import Recording, read_recording
from trainguard.replay.replay import decisions_of
from trainguard.sinks.archive import ArchiveWriter

from ..pipeline import running_processor

SECRET = b"replay-test-secret-0123456789abcdef"
POLICY = builtin_policy("demo")


@dataclass
class Recorded:
    bootstrap: str
    names: TopicNames
    recording: Recording
    #: The topics as the archive writer stored them (sinks/archive.py), caught up.
    archive: Path


@pytest.fixture(scope="package")  # one recording for test_replay and test_backtest
def recorded(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET.decode(), log) as processor:
        names = processor.names
        demo = Scenario.builtin("demo")
        scenario = Scenario.parse({**demo.model_dump(mode="json"), "steps": 360}, source="demo-replay")
        run_id = f"rec-{uuid.uuid4().hex[:8]}"
        result = run_simulation(scenario, bootstrap, names, SECRET, speed=4.0, run_id=run_id)
        assert result.finished and result.attempts >= 3, result  # crash, hang (and the eviction)
        recording = read_recording(bootstrap, names, run_id)
        for _ in range(20):  # the processor may still be publishing its last decisions
            if len(decisions_of(recording)) == len(decisions_of(read_recording(bootstrap, names, run_id))):
                break
            recording = read_recording(bootstrap, names, run_id)
        archive = tmp_path_factory.mktemp("archive") / "lake"
        with ArchiveWriter(bootstrap, names, archive, group_id=f"archive-{run_id}") as writer:
            writer.run_until_caught_up(timeout_s=120)
        yield Recorded(bootstrap, names, recording, archive)
