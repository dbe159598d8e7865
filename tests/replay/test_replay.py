"""Replay determinism: a run recorded through the real broker and the live processor
(the demo's crash, hang and straggler, with the restarts they cause), read back from
the topics and driven through a fresh core with the policy the run used, yields the
live processor's decisions exactly, event for event; under another policy it does not.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from trainguard.broker.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.processors.core.policy import CorePolicy, load_policy, parse_policy
from trainguard.producers.simulator.driver import run_simulation
from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay.log import Recording, read_recording
from trainguard.replay.replay import compare, decisions_of, replay, replayed_decisions
from trainguard.schemas import Abort, Interruption, Reason, ReasonCode, StragglerFlagged
from trainguard.stack import builtin_policy, start_processor

SECRET = b"replay-test-secret-0123456789abcdef"
POLICY = builtin_policy("demo")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Recorded:
    bootstrap: str
    names: TopicNames
    recording: Recording


@pytest.fixture(scope="module")
def recorded(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    processor, _ = start_processor(
        bootstrap, POLICY, free_port(), log, {"TRAINGUARD_SECRET": SECRET.decode()}, topic_prefix=prefix
    )
    try:
        demo = Scenario.builtin("demo")
        scenario = Scenario.parse({**demo.model_dump(mode="json"), "steps": 360}, source="demo-replay")
        run_id = f"rec-{uuid.uuid4().hex[:8]}"
        result = run_simulation(scenario, bootstrap, names, SECRET, speed=4.0, run_id=run_id)
        assert result.finished and result.attempts == 4, result  # crash, hang, eviction
        recording = read_recording(bootstrap, names, run_id)
        for _ in range(20):  # the processor may still be publishing its last decisions
            if len(decisions_of(recording)) == len(decisions_of(read_recording(bootstrap, names, run_id))):
                break
            recording = read_recording(bootstrap, names, run_id)
        yield Recorded(bootstrap, names, recording)
    finally:
        processor.terminate()
        try:
            processor.wait(30)
        except subprocess.TimeoutExpired:
            processor.kill()
        delete_topics(bootstrap, list(names.all()))


@pytest.mark.broker
def test_replaying_a_recorded_run_with_its_policy_reproduces_every_decision(recorded: Recorded) -> None:
    recording = recorded.recording
    causes = {d.cause.value for d in recording.derived if isinstance(d, Interruption)}
    assert {"crash", "hang", "eviction"} <= causes  # a run with faults, restarts and their decisions
    assert any(isinstance(d, StragglerFlagged) for d in recording.derived)
    assert len(recording.commands) > 10

    replayed = replay(recording, load_policy(str(POLICY)))
    comparison = compare(decisions_of(recording), replayed_decisions(replayed))
    assert comparison.identical, comparison.differences[:10]
    assert comparison.matched == comparison.recorded == comparison.replayed > 20
    assert replayed.events > 10_000 and replayed.rejections == 0


@pytest.mark.broker
def test_replaying_under_another_policy_shows_the_decisions_that_differ(recorded: Recorded) -> None:
    strict = parse_policy({"version": 1, "hang": {"min_samples": 20, "floor_s": 2.0, "stack_collect_s": 5.0},
                           "straggler": {"consecutive_steps": 50}})  # fmt: skip
    comparison = compare(
        decisions_of(recorded.recording), replayed_decisions(replay(recorded.recording, strict))
    )
    assert not comparison.identical
    # The same straggle (its id is its onset's) is flagged 50 steps sooner.
    (flag,) = [d for d in comparison.differences if d.kind == "straggler_flagged" and d.what == "changed"]
    assert "step" in flag.detail and "consecutive_steps" in flag.detail


def flagged(rank: int, step: int) -> StragglerFlagged:
    return StragglerFlagged(
        event_id=f"flag-{rank}-{step}", run_id="r", attempt=0, rank=rank, node=f"n{rank}", step=step,
        ts=step * 2.0, reason=Reason(code=ReasonCode.STRAGGLER, text=f"rank {rank} slow"),
        robust_z=9.0, slowdown=1.2,
    )  # fmt: skip


def test_compare_names_missing_extra_changed_and_moved_decisions() -> None:
    a, b, c = (flagged(rank=r, step=100 + r) for r in (1, 2, 3))
    changed = b.model_copy(update={"robust_z": b.robust_z + 1})
    assert compare([a, b, c, a], [a, b, c]).identical  # a redelivered decision counts once
    what = {(d.what, d.decision_id) for d in compare([a, b], [changed, c]).differences}
    assert what == {("missing", a.event_id), ("changed", b.event_id), ("extra", c.event_id)}
    (moved,) = compare([a, b, c], [a, c, b]).differences
    assert (moved.what, moved.decision_id) == ("moved", b.event_id)


def test_a_replay_of_nothing_decides_nothing() -> None:
    replayed = replay(Recording("empty"), CorePolicy())
    assert (replayed.records, replayed.derived, replayed.commands) == (0, [], [])


def test_signature_is_not_compared() -> None:
    abort = Abort(
        command_id="a1",
        run_id="r",
        attempt=0,
        issued_ts=1.0,
        reason=Reason(code=ReasonCode.OPERATOR, text="x"),
    )
    assert compare([abort.model_copy(update={"signature": "a" * 64})], [abort]).identical
    assert not compare([abort.model_copy(update={"attempt": 1})], [abort]).identical
