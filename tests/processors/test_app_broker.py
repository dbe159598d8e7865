"""The live pipeline on a real broker: the faust processor (its own process, as in
production) detects an injected crash and hang, its signed commands reach real
actuators that execute each once and acknowledge; bad records go to the dead-letter
topic while the good ones around them are all processed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from harness.streams import Job
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.producers.rank.actuator import Actuator
from trainguard.producers.simulator.driver import run_simulation
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import (
    Abort,
    Ack,
    AckStatus,
    Command,
    Interruption,
    InterruptionRecovered,
    ReasonCode,
    auth,
    decode,
    encode,
    encode_batch,
)
from trainguard.schemas.codec import ACKS, COMMANDS, DERIVED

from ..pipeline import free_port
from ..readers import Seen, TopicReader

pytestmark = pytest.mark.broker

SECRET = b"integration-test-secret-0123456789"
POLICY = Path(__file__).parents[2] / "processors" / "policies" / "demo.yaml"


@dataclass
class Live:
    bootstrap: str
    names: TopicNames
    metrics_url: str

    def reader(self, topic: str) -> TopicReader:
        return TopicReader(self.bootstrap, topic)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rpartition(" ")[2])
        return 0.0

    def metric_reaches(self, name: str, at_least: float, timeout_s: float = 30.0) -> bool:
        """Whether `name` reaches `at_least` within `timeout_s`: a metric the processor
        updates after its outputs are delivered may lag a reader that already saw them."""
        deadline = time.monotonic() + timeout_s
        while self.metric(name) < at_least:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


@pytest.fixture(scope="module")
def live(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    port = free_port()
    log_path = tmp_path_factory.mktemp("processor") / "processor.log"
    command = [sys.executable, "-m", "trainguard", "process", "--bootstrap", bootstrap]
    command += ["--topic-prefix", prefix, "--policy", str(POLICY), "--metrics-port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*command, "--loglevel", "info"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TRAINGUARD_SECRET": SECRET.decode()},
        )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "processor did not start"
                time.sleep(0.3)
        yield Live(bootstrap, topic_names(prefix), url)
        assert proc.poll() is None, f"the processor died:\n{log_path.read_text()[-3000:]}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        delete_topics(bootstrap, list(topic_names(prefix).all()))


def derived_of(seen: list[Seen], run_id: str) -> list:
    return [d for d in (decode(s.value, DERIVED) for s in seen) if d.run_id == run_id]


def acks_of(seen: list[Seen], run_id: str) -> list[Ack]:
    acks = [decode(s.value, ACKS) for s in seen]
    return [a for a in acks if isinstance(a, Ack) and a.run_id == run_id]


def test_simulated_crash_and_hang_are_detected_and_every_rank_executes_the_aborts(live: Live) -> None:
    demo = Scenario.builtin("demo")
    scenario = Scenario.parse({**demo.model_dump(mode="json"), "steps": 240}, source="demo-short")
    run_id = f"sim-{uuid.uuid4().hex[:8]}"
    events, acks = live.reader(live.names.events), live.reader(live.names.acks)

    result = run_simulation(scenario, live.bootstrap, live.names, SECRET, speed=4.0, run_id=run_id)
    # 4 attempts: the thermal straggler (rank 5, 22% slow from step 30) evicted at the first
    # checkpoint boundary after the windowed detector's flag (a 32-step block), the crash,
    # the hang
    assert result.finished and result.attempts == 4, result

    derived = derived_of(
        events.until(
            lambda s: len([d for d in derived_of(s, run_id) if isinstance(d, InterruptionRecovered)]) >= 3
        ),
        run_id,
    )
    interruptions = {i.cause.value: i for i in derived if isinstance(i, Interruption)}
    truth = {t.kind: t for t in scenario.truth()}
    crash, hang = interruptions["crash"], interruptions["hang"]
    eviction = interruptions["eviction"]
    assert (eviction.rank, eviction.node, eviction.attempt) == (5, "node-0000", 0)
    assert (crash.rank, crash.node) == (truth["crash"].rank, truth["crash"].node)
    assert crash.reason.code == ReasonCode.RANK_EXITED and crash.lost_steps == 4
    assert (hang.rank, hang.node) == (truth["hang"].rank, truth["hang"].node)
    assert hang.reason.code == ReasonCode.ODD_STACK and hang.detected_by == "progress_watchdog"
    recovered = {r.interruption_id for r in derived if isinstance(r, InterruptionRecovered)}
    assert recovered == {eviction.interruption_id, crash.interruption_id, hang.interruption_id}

    def aborts(seen: list[Seen]) -> list[Ack]:
        return [a for a in acks_of(seen, run_id) if a.command_kind == "abort"]

    by_command: dict[str, set[int]] = {}
    for ack in aborts(acks.until(lambda s: len(aborts(s)) >= 2 * 63)):
        assert ack.status == AckStatus.EXECUTED, ack
        by_command.setdefault(ack.command_id, set()).add(ack.rank)
    assert len(by_command) == 2 and all(len(ranks) >= 63 for ranks in by_command.values())
    for reader in (events, acks):
        reader.close()


def test_commands_execute_once_when_redelivered_refuse_forgeries_and_bad_records_are_dead_lettered(
    live: Live,
) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    key = auth.run_key(SECRET, run_id)
    executions: list[tuple[str, int]] = []
    actuator = Actuator(
        live.bootstrap, live.names.commands, live.names.acks, run_id, 0, range(4), key, node="node-000"
    )
    actuator.register(Abort, lambda command, rank: executions.append((command.command_id, rank)) or "aborted")
    actuator.start()
    assert actuator.wait_ready(30)
    readers = {name: live.reader(getattr(live.names, name)) for name in ("events", "commands", "acks")}
    deadletter = live.reader(live.names.deadletter)
    try:
        job = Job(run_id=run_id, world_size=4, ranks_per_node=2).start().steps(12)
        first = [encode(e) for e in job.events]
        job.exit(1, signal=9)
        second = [encode(e) for e in job.events[len(first) :]]
        bad_rank = orjson.loads(second[0]) | {"rank": 9, "event_id": "out-of-range"}
        header = dict(run_id=run_id, node="node-000", world_size=4, producer_id="test", seq=0)
        garbage = b"\x00\x01 not a batch"
        before = live.metric("trainguard_events_processed_total")
        producer = Producer({"bootstrap.servers": live.bootstrap})
        for value in (
            encode_batch(header, first),
            garbage,
            encode_batch({**header, "seq": 1}, [orjson.dumps(bad_rank), *second]),
        ):
            producer.produce(live.names.telemetry, key=run_id.encode(), value=value)
        producer.flush(10)

        # The crash after the bad records is still detected, from good events only.
        derived = derived_of(readers["events"].until(lambda s: bool(derived_of(s, run_id))), run_id)
        (crash,) = [d for d in derived if isinstance(d, Interruption)]
        assert (crash.rank, crash.node, crash.lost_steps) == (1, "node-000", 1)
        assert live.metric("trainguard_events_processed_total") - before == len(first) + len(second)
        # the crash decision was timed (once its outputs were delivered: after this reader saw them)
        assert live.metric_reaches("trainguard_decision_latency_seconds_count", 1)

        # The abort reaches the actuator; each rank executes it once and acknowledges. (The
        # crashed rank's node is also quarantined: a command this actuator has no handler for.)
        def abort_acks(seen: list[Seen]) -> list[Ack]:
            return [a for a in acks_of(seen, run_id) if a.command_kind == "abort"]

        acks = abort_acks(readers["acks"].until(lambda s: len(abort_acks(s)) >= 4))
        assert sorted((a.rank, a.status) for a in acks) == [(r, AckStatus.EXECUTED) for r in range(4)]
        mine, abort_schema = run_id.encode(), b'"schema":"abort/'
        seen = readers["commands"].until(
            lambda s: any(mine in x.value and abort_schema in x.value for x in s)
        )
        ours = [x.value for x in seen if mine in x.value and abort_schema in x.value]
        (command_raw,) = ours
        command = decode(command_raw, COMMANDS)
        assert isinstance(command, Abort) and auth.verify(command, key)

        # At-least-once: the same command delivered again is acknowledged, not re-run.
        producer.produce(live.names.commands, key=run_id.encode(), value=command_raw)
        # A forged command (another key) and a tampered one (signature kept) are refused.
        forged = auth.sign(command.model_copy(update={"command_id": "forged"}), b"k" * 32)
        tampered: Command = command.model_copy(update={"command_id": "tampered", "ranks": [0]})
        for value in (encode(forged), encode(tampered)):
            producer.produce(live.names.commands, key=run_id.encode(), value=value)
        producer.flush(10)
        acks = abort_acks(readers["acks"].until(lambda s: len(abort_acks(s)) >= 10))
        readers["acks"].settle()
        acks = abort_acks(readers["acks"].seen)
        statuses = sorted((a.command_id, a.status.value) for a in acks[4:])
        assert statuses == sorted(
            [(command.command_id, "duplicate")] * 4 + [("forged", "refused"), ("tampered", "refused")]
        )
        assert sorted(executions) == [(command.command_id, r) for r in range(4)]
        assert actuator.counters.refused_total == 2

        # Bad input: dead-lettered with its reason and original bytes; nothing else lost.
        dead = deadletter.until(lambda s: len(s) >= 2)
        reasons = {d.headers["reason"].decode(): d.value for d in dead}
        assert reasons["malformed"] == garbage
        assert orjson.loads(reasons["rank_out_of_range"])["event_id"] == "out-of-range"

        # A redelivered telemetry batch changes nothing: no second interruption.
        duplicates_before = live.metric("trainguard_duplicate_events_total")
        producer.produce(live.names.telemetry, key=run_id.encode(), value=encode_batch(header, second))
        producer.flush(10)
        deadline = time.monotonic() + 30
        while live.metric("trainguard_duplicate_events_total") - duplicates_before < len(second):
            assert time.monotonic() < deadline
            time.sleep(0.3)
        readers["events"].settle()
        assert len([d for d in derived_of(readers["events"].seen, run_id) if d.KIND == "interruption"]) == 1
    finally:
        actuator.stop()
        for reader in (*readers.values(), deadletter):
            reader.close()
