"""The public contract of trainguard's streams, generated from the code that defines them:
an AsyncAPI 3.0 document for the topics, their keys and headers, and one JSON Schema per
record kind at its current version, from the pydantic models (schemas/).

`trainguard contract --write docs/contract` writes them; tests/kafka/test_contract.py fails
when the committed files and the models disagree, so a consumer in another language can
trust docs/contract/ as the wire format, and tests/kafka/test_asyncapi.py has the official
AsyncAPI parser (tools/asyncapi/) accept the document. docs/streams.md explains them.

Every message is on the channel of the topic that carries it: the telemetry topic carries
batches, and also lone telemetry records (a single-record producer, the processors' ticks
and what a shard forwards to its run's shard 0: predictions and stragglers); a batch's
`records` are each one of the telemetry record schemas or a columnar block of step timings
(`step_timings`, inside batches only). The payloads are JSON Schema 2020-12, which each
message's `schemaFormat` says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainguard import __version__

from ..schemas import Record
from ..schemas.codec import (
    ACKS,
    BATCH_RECORDS,
    COMMANDS,
    DERIVED,
    LONE_RECORDS,
    TELEMETRY,
    UPCASTERS,
    Batch,
    RejectReason,
)
from . import topics

SCHEMA_DIR = "schemas"
_JSON_SCHEMA = "https://json-schema.org/draft/2020-12/schema"
#: A message's payload format (AsyncAPI 3.0 Multi Format Schema Object): JSON Schema 2020-12.
#: The AsyncAPI parser has no parser registered for it: it resolves the payload, warns, and
#: leaves the schema to a 2020-12 validator (tests/kafka/test_asyncapi.py uses jsonschema's).
SCHEMA_FORMAT = "application/schema+json;version=2020-12"
#: The Kafka bindings' version (https://github.com/asyncapi/bindings/tree/master/kafka).
KAFKA_BINDING = "0.5.0"


def schema_name(cls: type[Record]) -> str:
    """The schema's file name, and its `$id`: a reference between schemas is relative."""
    return f"{cls.KIND}.v{cls.VERSION}.json"


def schema_file(cls: type[Record]) -> str:
    return f"{SCHEMA_DIR}/{schema_name(cls)}"


def json_schema(cls: type[Record]) -> dict[str, Any]:
    """The record's JSON as on the wire: the model's fields plus the "schema" key."""
    body = cls.model_json_schema(mode="serialization")
    properties = {
        "schema": {
            "const": cls.schema_name(),
            "description": "kind/version; older versions of the kind are upcast by readers",
        },
        **body.get("properties", {}),
    }
    required = ["schema", *body.get("required", [])]
    out: dict[str, Any] = {
        "$schema": _JSON_SCHEMA,
        "$id": schema_name(cls),
        "title": cls.schema_name(),
        "description": (cls.__doc__ or "").strip(),
        "type": "object",
        "properties": properties,
        "required": required,
    }
    if "$defs" in body:
        out["$defs"] = body["$defs"]
    if cls is Batch:  # `records: list[Any]` in the model: each is one of the batch's kinds
        items = [{"$ref": schema_name(BATCH_RECORDS[kind])} for kind in sorted(BATCH_RECORDS)]
        properties["records"] = {**properties["records"], "items": {"oneOf": items}}
    return out


def json_schemas() -> dict[str, dict[str, Any]]:
    """Every record kind's schema, by its file name under docs/contract/."""
    classes: list[type[Record]] = [
        Batch,
        *BATCH_RECORDS.values(),
        *DERIVED.values(),
        *COMMANDS.values(),
        *ACKS.values(),
    ]
    return {schema_file(cls): json_schema(cls) for cls in classes}


def _older_versions() -> dict[str, list[int]]:
    older: dict[str, list[int]] = {}
    for kind, version in sorted(UPCASTERS):
        older.setdefault(kind, []).append(version)
    return older


def _messages(registry: Mapping[str, type[Record]], key: str) -> dict[str, Any]:
    older = _older_versions()
    messages = {}
    for kind, cls in registry.items():
        accepted = ", ".join(f"{kind}/{v}" for v in older.get(kind, []))
        note = f" Readers also accept {accepted} (upcast)." if accepted else ""
        messages[kind] = {
            "name": kind,
            "title": cls.schema_name(),
            "summary": ((cls.__doc__ or "").strip().split("\n\n")[0]).replace("\n", " ") + note,
            "contentType": "application/json",
            "payload": {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": schema_file(cls)}},
            "bindings": _key_binding(key),
        }
    return messages


def _key_binding(description: str) -> dict[str, Any]:
    return {"kafka": {"key": {"type": "string", "description": description}, "bindingVersion": KAFKA_BINDING}}


def topic_configuration(config: Mapping[str, str]) -> dict[str, Any]:
    """A topic's configuration as the Kafka channel binding types it: `cleanup.policy` a
    list, numbers integers (a broker takes them as strings: topics.py keeps them so)."""
    out: dict[str, Any] = {}
    for name, value in sorted(config.items()):
        if name == "cleanup.policy":
            out[name] = value.split(",")
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            out[name] = value
    return out


_RUN_KEY = "the run_id: a run's records stay on one partition, in order"
_TELEMETRY_KEY = "the run_id, or run_id#shard for a run cut into shards (schemas/sharding.py)"
_FORWARD_KEY = (
    "the run_id; on the telemetry topic, where a shard's worker forwards its predictions and"
    " stragglers to the run's shard 0, the telemetry key (schemas/sharding.py)"
)


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the topics (default names; a --topic-prefix prepends).
    The runs and snapshots topics are not in it: nothing publishes to the first yet, and
    the second is the processors' own state (topics.py)."""
    specs = {spec.name: spec for spec in topics.TOPICS}

    def channel(name: str, description: str, messages: dict[str, Any]) -> dict[str, Any]:
        spec = specs[name]
        return {
            "address": name,
            "description": f"{spec.purpose}. {description}",
            "messages": {kind: {"$ref": f"#/components/messages/{kind}"} for kind in messages},
            "bindings": {
                "kafka": {
                    "partitions": spec.partitions,
                    "topicConfiguration": topic_configuration(spec.config),
                    "bindingVersion": KAFKA_BINDING,
                }
            },
        }

    batch = _messages({"batch": Batch}, _TELEMETRY_KEY)
    batch["batch"]["summary"] += (
        " Its `records` are each one of the telemetry records ("
        + ", ".join(sorted(BATCH_RECORDS))
        + "); `step_timings`, a columnar block of step timings, comes inside batches only."
    )
    telemetry = _messages(TELEMETRY, _TELEMETRY_KEY)
    for message in telemetry.values():
        message["summary"] += " Alone on the topic too (a single-record producer)."
    derived = _messages(DERIVED, _RUN_KEY)
    lone_derived = sorted(set(LONE_RECORDS) - set(TELEMETRY))  # forwarded to the run's shard 0
    for kind in lone_derived:
        derived[kind]["bindings"] = _key_binding(_FORWARD_KEY)
    commands = _messages(COMMANDS, _RUN_KEY)
    acks = _messages(ACKS, _RUN_KEY)
    dead_letter = {
        "dead_letter": {
            "name": "dead_letter",
            "title": "dead letter",
            "summary": "The bytes of a record a processor could not accept, as they arrived.",
            "contentType": "application/octet-stream",
            "payload": {"type": "string", "format": "binary"},
            "headers": {
                "type": "object",
                "properties": {
                    "reason": {"type": "string", "enum": [r.value for r in RejectReason]},
                    "detail": {"type": "string", "description": "what was wrong, at most 1,000 bytes"},
                    "source": {"type": "string", "description": "topic:partition:offset it came from"},
                },
                "required": ["reason", "detail", "source"],
            },
            "bindings": _key_binding("the source position"),
        }
    }
    on_telemetry = {**batch, **telemetry, **{kind: derived[kind] for kind in lone_derived}}
    channels = {
        "telemetry": channel(
            topics.TELEMETRY,
            "One record per node and flush: a batch of the node's ranks' events; a lone record"
            " is accepted too.",
            on_telemetry,
        ),
        "events": channel(
            topics.EVENTS, "What the processors derived: detections, interruptions, reports.", derived
        ),
        "commands": channel(topics.COMMANDS, "Signed (HMAC-SHA256, a key per run) and idempotent.", commands),
        "acks": channel(topics.ACKS, "One per rank and command: executed, refused or failed.", acks),
        "deadletter": channel(topics.DEADLETTER, "Nothing is dropped silently.", dead_letter),
    }
    every = None  # the channel's every message
    operations: dict[str, tuple[str, str, str, list[str] | None]] = {
        "shipTelemetry": ("send", "telemetry", "Ranks and launchers ship telemetry.", [*batch, *telemetry]),
        "forwardToCoordinator": (
            "send",
            "telemetry",
            "Processors write ticks, and a shard's failure predictions and stragglers (flagged, "
            "diagnosed, cleared) to the run's shard 0, which decides the drain and the eviction.",
            [TELEMETRY["tick"].KIND, *lone_derived],
        ),
        "processTelemetry": ("receive", "telemetry", "Processors consume the telemetry.", every),
        "consumeEvents": (
            "receive",
            "events",
            "Dashboards, pagers and schedulers consume derived events.",
            every,
        ),
        "sendCommands": ("send", "commands", "Processors (and the run API) send commands.", every),
        "receiveCommands": (
            "receive",
            "commands",
            "Rank actuators execute the commands of their run.",
            every,
        ),
        "sendAcks": ("send", "acks", "Rank actuators acknowledge each command.", every),
        "consumeDeadLetters": ("receive", "deadletter", "Operators inspect rejected records.", every),
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "trainguard streams",
            "version": __version__,
            "description": "The Kafka topics trainguard reads and writes: JSON records with a "
            '"schema": "kind/version" key. docs/streams.md explains keys, ordering, versions.',
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": {
            name: {
                "action": action,
                "channel": {"$ref": f"#/channels/{chan}"},
                "summary": summary,
                "messages": [
                    {"$ref": f"#/channels/{chan}/messages/{kind}"}
                    for kind in (channels[chan]["messages"] if kinds is None else kinds)
                ],
            }
            for name, (action, chan, summary, kinds) in operations.items()
        },
        "components": {"messages": {**batch, **telemetry, **derived, **commands, **acks, **dead_letter}},
    }


def rendered() -> dict[str, str]:
    """Every contract file's text, by its path under docs/contract/."""
    files = {"asyncapi.json": asyncapi(), **json_schemas()}
    return {path: json.dumps(doc, indent=2, sort_keys=False) + "\n" for path, doc in files.items()}
