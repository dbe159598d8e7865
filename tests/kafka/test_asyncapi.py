"""The published AsyncAPI document as the official tools read it: `@asyncapi/parser`
(pinned in tools/asyncapi/package-lock.json, installed by scripts/setup with `npm ci`)
parses docs/contract/asyncapi.json with no error and no warning, and rejects a document
with a Kafka binding as the contract once wrote it. Every message is on the channel of
its topic, with its schema format declared. A consumer built from the parser's view of
the document alone (each channel's messages and their payload schemas, resolved by the
parser from docs/contract/schemas/) accepts what the project's own producers put on each
topic, packed by the rank shipper, decided and signed by the processor's driver, and
rejects malformed records, a batch with a bad record inside among them.

Without Node.js or the parser's packages these tests fail, saying what to install: the
contract's acceptance by the official parser is part of the suite, not optional."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

from harness.streams import Job
from trainguard.kafka import topics
from trainguard.kafka.contract import SCHEMA_FORMAT, asyncapi
from trainguard.processors.core import CorePolicy, HangPolicy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.rank.shipper import pack
from trainguard.schemas import Ack, AckStatus, encode
from trainguard.schemas.codec import ACKS, COMMANDS, DERIVED, LONE_RECORDS

from ..schemas.test_codec import build

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ROOT / "docs" / "contract" / "asyncapi.json"
CHECK = ROOT / "tools" / "asyncapi" / "check.mjs"
SECRET = b"asyncapi-test-secret-0123456789ab"


def parse(document: Path) -> tuple[int, dict[str, Any]]:
    """tools/asyncapi/check.mjs on `document`: its exit status and its JSON report."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js is not installed (Debian: apt-get install nodejs npm; then scripts/setup)")
    if not (CHECK.parent / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.fail("the AsyncAPI parser is not installed: run scripts/setup (npm ci in tools/asyncapi)")
    done = subprocess.run(
        [node, str(CHECK), str(document), "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.fixture(scope="module")
def parsed() -> dict[str, Any]:
    status, report = parse(DOCUMENT)
    assert status == 0, json.dumps(report["diagnostics"], indent=1)
    return report


def test_the_official_parser_accepts_the_published_document(parsed: dict[str, Any]) -> None:
    problems = [d for d in parsed["diagnostics"] if d["severity"] in ("error", "warning")]
    assert parsed["parsed"] and parsed["errors"] == 0 and parsed["warnings"] == 0, problems
    # What it still says, for information: the document is AsyncAPI 3.0.0, not 3.1.0.
    assert {d["code"] for d in parsed["diagnostics"]} <= {"asyncapi-latest-version"}


def test_the_parser_rejects_the_binding_the_contract_once_had(tmp_path: Path) -> None:
    shutil.copytree(DOCUMENT.parent, tmp_path / "contract")
    document = json.loads(DOCUMENT.read_text())
    kafka = document["channels"]["events"]["bindings"]["kafka"]
    kafka["topicConfiguration"] = {"cleanup.policy": "delete", "retention.ms": "2592000000"}
    broken = tmp_path / "contract" / "asyncapi.json"
    broken.write_text(json.dumps(document))
    status, report = parse(broken)
    assert status == 1 and not report["parsed"] and report["errors"] == 3
    wrong = {d["path"] for d in report["diagnostics"] if d["severity"] == "error"}
    assert "channels/events/bindings/kafka/topicConfiguration/cleanup.policy" in wrong


def test_every_message_is_on_the_channel_of_its_topic(parsed: dict[str, Any]) -> None:
    channels = parsed["channels"]
    assert {address: set(messages) for address, messages in channels.items()} == {
        topics.TELEMETRY: {"batch", *LONE_RECORDS},
        topics.EVENTS: set(DERIVED),
        topics.COMMANDS: set(COMMANDS),
        topics.ACKS: set(ACKS),
        topics.DEADLETTER: {"dead_letter"},
    }
    on_channels = {kind for messages in channels.values() for kind in messages}
    assert on_channels == set(asyncapi()["components"]["messages"])  # none is on no channel
    for messages in channels.values():
        for kind, message in messages.items():
            if kind == "dead_letter":  # the bytes as they arrived
                assert message["contentType"] == "application/octet-stream"
                continue
            assert message["schemaFormat"] == SCHEMA_FORMAT, kind
            jsonschema.Draft202012Validator.check_schema(message["payload"])
            assert message["payload"]["properties"]["schema"]["const"].split("/")[0] == kind


class Malformed(ValueError):
    """A value the contract does not admit on its topic."""


@dataclass
class ContractConsumer:
    """A consumer that knows the streams only through the parsed document: a value on a
    topic is one of that channel's messages, picked by its "schema" key, and must validate
    against that message's payload."""

    validators: dict[str, dict[str, jsonschema.Draft202012Validator]]

    @classmethod
    def of(cls, parsed: dict[str, Any]) -> ContractConsumer:
        validators = {
            address: {
                message["payload"]["properties"]["schema"]["const"]: jsonschema.Draft202012Validator(
                    message["payload"]
                )
                for message in messages.values()
                if message["schemaFormat"] == SCHEMA_FORMAT
            }
            for address, messages in parsed["channels"].items()
        }
        return cls(validators)

    def read(self, topic: str, value: bytes) -> str:
        """The value's "kind/version", once it validates; Malformed if it does not."""
        record = orjson.loads(value)
        schema = record.get("schema") if isinstance(record, dict) else None
        validator = self.validators[topic].get(schema) if isinstance(schema, str) else None
        if validator is None:
            raise Malformed(f"{schema!r} is no message of {topic}")
        error = jsonschema.exceptions.best_match(validator.iter_errors(record))
        if error is not None:
            raise Malformed(f"{schema} on {topic}: {error.message} at {error.json_path}")
        assert isinstance(schema, str)
        return schema


@dataclass
class Streams:
    """What the project's producers put on each topic for one faulty run."""

    telemetry: list[bytes]
    events: list[bytes]
    commands: list[bytes]
    acks: list[bytes]


def produced() -> Streams:
    """A 16-rank run (4 nodes): steps with checkpoints, a GPU reading, a hang (every rank
    heartbeating in the collective, none stepping), the aborted ranks' stacks and exits,
    a restart, more steps. The rank shipper packs the telemetry as it ships it (a node's
    step timings as one columnar block); the processor's driver decodes each record, folds
    it and signs the commands it decides; each rank acknowledges each command."""
    policy = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))
    job = Job(world_size=16, ranks_per_node=4).start().steps(40)
    job.health(5, temperature_c=91.0)
    job.stall(8.0)
    job.abort_all(culprit=5, culprit_stack="collective:allreduce>ncclProxyProgress")
    job.restart(resumed_from_step=40).steps(5)
    driver = CoreDriver(policy, SECRET)
    telemetry = []
    streams = Streams([], [], [], [])
    seq = 0
    for events in _per_flush(job):
        for record in pack(events, job.run_id, job.world_size, 0, "shipper-test", seq):
            seq += 1
            telemetry.append(record.value)
            result = driver.handle(record.value)
            assert not result.rejections, result.rejections
            streams.events += [encode(event) for event in result.derived]
            streams.commands += [encode(command) for command in result.commands]
            telemetry += [encode(event) for event in result.forwards]
            for command in result.commands:
                streams.acks += [
                    encode(
                        Ack(
                            command_id=command.command_id,
                            command_kind=command.KIND,
                            run_id=job.run_id,
                            attempt=command.attempt,
                            rank=rank,
                            node=job.node(rank),
                            status=AckStatus.EXECUTED,
                            ts=job.t,
                        )
                    )  # fmt: skip
                    for rank in range(job.world_size)
                ]
    streams.telemetry = telemetry
    return streams


def _per_flush(job: Job, size: int = 64) -> Iterator[list[Any]]:
    """The run's events in the order they happened, as a shipper's flushes take them."""
    for start in range(0, len(job.events), size):
        yield job.events[start : start + size]


def test_a_consumer_built_from_the_document_reads_what_the_project_produces(parsed: dict[str, Any]) -> None:
    consumer = ContractConsumer.of(parsed)
    streams = produced()
    seen: dict[str, set[str]] = {}
    for topic, values in [
        (topics.TELEMETRY, streams.telemetry),
        (topics.EVENTS, streams.events),
        (topics.COMMANDS, streams.commands),
        (topics.ACKS, streams.acks),
    ]:
        assert values, topic
        seen[topic] = {consumer.read(topic, value) for value in values}
    assert seen[topics.TELEMETRY] == {"batch/2"}
    assert "interruption/1" in seen[topics.EVENTS] and "abort/1" in seen[topics.COMMANDS]
    kinds_in_batches = {
        record["schema"] for value in streams.telemetry for record in orjson.loads(value)["records"]
    }
    assert {
        "step_timings/1",
        "heartbeat/2",
        "gpu_health/3",
        "rank_exit/3",
        "run_started/3",
    } <= kinds_in_batches
    # A lone record of every telemetry kind, and a forwarded prediction, are read too.
    for kind in sorted(LONE_RECORDS):
        assert consumer.read(topics.TELEMETRY, encode(build(kind))) == f"{kind}/{LONE_RECORDS[kind].VERSION}"


def test_the_consumer_rejects_what_the_contract_does_not_admit(parsed: dict[str, Any]) -> None:
    consumer = ContractConsumer.of(parsed)
    streams = produced()
    batch = orjson.loads(streams.telemetry[1])
    records = batch["records"]
    block = next(i for i, r in enumerate(records) if r["schema"] == "step_timings/1")
    heartbeat = build("heartbeat")
    wire = orjson.loads(encode(heartbeat))
    malformed = [
        # a batch whose columnar block has a rank that is not a number: the batch's schema
        # reaches its records' schemas
        (topics.TELEMETRY, {**batch, "records": [*records[:block], {**records[block], "rank": ["six"]}]}),
        # a batch holding a heartbeat without its run
        (topics.TELEMETRY, {**batch, "records": [{k: v for k, v in wire.items() if k != "run_id"}]}),
        # a record of no known kind inside a batch
        (topics.TELEMETRY, {**batch, "records": [{**wire, "schema": "heartbeat/99"}]}),
        (topics.TELEMETRY, {**wire, "step": "one hundred"}),
        (topics.TELEMETRY, orjson.loads(streams.commands[0])),  # a command is no telemetry
        (topics.EVENTS, orjson.loads(streams.telemetry[0])),  # nor a batch a derived event
        (topics.COMMANDS, {**orjson.loads(streams.commands[0]), "attempt": "first"}),
        (topics.ACKS, {**orjson.loads(streams.acks[0]), "status": "maybe"}),
    ]
    for topic, record in malformed:
        with pytest.raises(Malformed):
            consumer.read(topic, orjson.dumps(record))
    consumer.read(topics.TELEMETRY, orjson.dumps(batch))  # the batch they were made from is fine
