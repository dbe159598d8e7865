"""The streams' published contract (docs/contract/, trainguard/kafka/contract.py) is the
models' own: the committed files are exactly what the models generate, every record kind
has its schema and its message in the AsyncAPI document, a real record of every kind
validates against its schema (and a mangled one does not), a batch's schema reaches its
records' schemas (relative references between the files), and the example consumer,
written against the contract alone, reads the derived events off a real broker.
tests/kafka/test_asyncapi.py has the official AsyncAPI parser read the document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import orjson
import pytest
import referencing
from confluent_kafka import Producer
from referencing.jsonschema import DRAFT202012
from typer.testing import CliRunner

from trainguard.cli import app
from trainguard.kafka.contract import (
    SCHEMA_FORMAT,
    asyncapi,
    rendered,
    schema_file,
    schema_name,
    topic_configuration,
)
from trainguard.kafka.topics import TopicNames
from trainguard.schemas import Ack, AckStatus, encode, encode_batch
from trainguard.schemas.codec import ALL, BATCH_RECORDS, DERIVED, TELEMETRY
from trainguard.schemas.columnar import encode_step_timings

from ..schemas.test_codec import COMMAND_SAMPLES, SAMPLES, build

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "contract"


def _registry() -> referencing.Registry:
    """The committed schemas by their `$id` (their file name), as a consumer loads them."""
    schemas = [json.loads(path.read_text()) for path in (CONTRACT / "schemas").glob("*.json")]
    return referencing.Registry().with_resources(
        (schema["$id"], DRAFT202012.create_resource(schema)) for schema in schemas
    )


def _validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((CONTRACT / schema_file({**ALL, **BATCH_RECORDS}[kind])).read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def test_the_committed_contract_is_what_the_models_generate() -> None:
    done = CliRunner().invoke(app, ["contract", "--check", str(CONTRACT)])
    assert done.exit_code == 0, done.output + "\nregenerate: trainguard contract --write docs/contract"
    committed = {str(p.relative_to(CONTRACT)) for p in CONTRACT.rglob("*.json")}
    assert committed == set(rendered())


def test_a_changed_model_fails_the_check(tmp_path: Path) -> None:
    for name, text in rendered().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    stale = tmp_path / schema_file(ALL["heartbeat"])
    stale.write_text(stale.read_text().replace('"phase"', '"stage"'))
    done = CliRunner().invoke(app, ["contract", "--check", str(tmp_path)])
    assert done.exit_code == 1 and "heartbeat.v2.json: differs from the models" in done.output


def test_every_kind_has_a_schema_and_a_message() -> None:
    document = asyncapi()
    messages = document["components"]["messages"]
    assert set(ALL) <= set(messages)
    for kind, cls in ALL.items():
        assert messages[kind]["payload"] == {
            "schemaFormat": SCHEMA_FORMAT,
            "schema": {"$ref": schema_file(cls)},
        }
    events = document["channels"]["events"]
    assert set(events["messages"]) == set(DERIVED) and events["address"] == "trainguard.events"
    assert "heartbeat/1" in messages["heartbeat"]["summary"]  # the upcast versions are named
    assert "step_timings" not in messages  # inside batches only: the batch's schema has it
    batch = json.loads((CONTRACT / schema_file(ALL["batch"])).read_text())
    items = batch["properties"]["records"]["items"]["oneOf"]
    assert [item["$ref"] for item in items] == [schema_name(BATCH_RECORDS[k]) for k in sorted(BATCH_RECORDS)]


def test_the_topic_configuration_is_typed_as_the_kafka_binding_says() -> None:
    assert topic_configuration(
        {"retention.ms": "604800000", "cleanup.policy": "compact,delete", "compression.type": "producer"}
    ) == {"cleanup.policy": ["compact", "delete"], "compression.type": "producer", "retention.ms": 604800000}
    kafka = asyncapi()["channels"]["telemetry"]["bindings"]["kafka"]
    assert kafka["topicConfiguration"]["max.message.bytes"] == 8 * 1024 * 1024
    assert kafka["bindingVersion"] == "0.5.0"


@pytest.mark.parametrize("kind", sorted([*SAMPLES, *COMMAND_SAMPLES]))
def test_a_real_record_of_each_kind_validates_and_a_mangled_one_does_not(kind: str) -> None:
    wire = orjson.loads(encode(build(kind)))
    validator = _validator(kind)
    validator.validate(wire)
    for mangled in ({**wire, "schema": f"{kind}/99"}, {k: v for k, v in wire.items() if k != "run_id"}):
        assert not validator.is_valid(mangled)


def test_an_ack_and_a_batch_of_telemetry_validate() -> None:
    ack = Ack(
        command_id="c", command_kind="abort", run_id="r", attempt=0, rank=3, node="n",
        status=AckStatus.EXECUTED, ts=1.0,
    )  # fmt: skip
    _validator("ack").validate(orjson.loads(encode(ack)))
    records = [encode(build(kind)) for kind in sorted(SAMPLES) if kind in TELEMETRY]
    timing = build("step_timing")
    records.append(encode_step_timings([timing, timing.model_copy(update={"event_id": "e-2", "rank": 6})]))
    header = dict(run_id="run-a", node="node-001", world_size=64, producer_id="p", seq=0)
    batch = orjson.loads(encode_batch(header, records))
    _validator("batch").validate(batch)
    for record in batch["records"]:
        _validator(record["schema"].split("/")[0]).validate(record)
    assert batch["records"][-1]["schema"] == "step_timings/1"
    block = {**batch["records"][-1], "rank": [5, "six"]}
    assert not _validator("step_timings").is_valid(block)
    assert not _validator("batch").is_valid({**batch, "records": [*batch["records"][:-1], block]})


@pytest.mark.broker
def test_the_example_consumer_reads_the_derived_events(bootstrap: str, topics: TopicNames) -> None:
    kinds = ["straggler_flagged", "interruption", "goodput_report"]
    producer = Producer({"bootstrap.servers": bootstrap})
    for kind in kinds:
        producer.produce(topics.events, encode(build(kind)), key=b"run-a")
    assert producer.flush(10) == 0
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs/examples/consume_events.py"), "--bootstrap", bootstrap,
         "--topic", topics.events, "--max", str(len(kinds)), "--idle-timeout", "30"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [f"{k}/{ALL[k].VERSION}" for k in kinds]
    assert all("run run-a" in line for line in lines)
