"""The public contract of trainguard's streams, generated from the code that defines them:
an AsyncAPI 3.0 document for the topics, their keys and headers, and one JSON Schema per
record kind at its current version, from the pydantic models (schemas/).

`trainguard contract --write docs/contract` writes them; tests/kafka/test_contract.py fails
when the committed files and the models disagree, so a consumer in another language can
trust docs/contract/ as the wire format. docs/streams.md explains them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainguard import __version__

from ..schemas import Record
from ..schemas.codec import ACKS, BATCH_RECORDS, COMMANDS, DERIVED, UPCASTERS, Batch, RejectReason
from . import topics

SCHEMA_DIR = "schemas"
_JSON_SCHEMA = "https://json-schema.org/draft/2020-12/schema"


def schema_file(cls: type[Record]) -> str:
    return f"{SCHEMA_DIR}/{cls.KIND}.v{cls.VERSION}.json"


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
        "$id": f"trainguard:{cls.schema_name()}",
        "title": cls.schema_name(),
        "description": (cls.__doc__ or "").strip(),
        "type": "object",
        "properties": properties,
        "required": required,
    }
    if "$defs" in body:
        out["$defs"] = body["$defs"]
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
            "payload": {"$ref": schema_file(cls)},
            "bindings": {"kafka": {"key": {"type": "string", "description": key}}},
        }
    return messages


_RUN_KEY = "the run_id: a run's records stay on one partition, in order"
_TELEMETRY_KEY = "the run_id, or run_id#shard for a run cut into shards (schemas/sharding.py)"


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the topics (default names; a --topic-prefix prepends)."""
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
                    "topicConfiguration": dict(sorted(spec.config.items())),
                }
            },
        }

    telemetry = _messages({"batch": Batch}, _TELEMETRY_KEY)
    telemetry["batch"]["summary"] += (
        " Its `records` are telemetry records, each one of: " + ", ".join(sorted(BATCH_RECORDS)) + "."
    )
    telemetry_records = _messages(BATCH_RECORDS, _TELEMETRY_KEY)
    derived = _messages(DERIVED, _RUN_KEY)
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
            "bindings": {"kafka": {"key": {"type": "string", "description": "the source position"}}},
        }
    }
    channels = {
        "telemetry": channel(
            topics.TELEMETRY,
            "One record per node and flush: a batch of the node's ranks' events.",
            telemetry,
        ),
        "events": channel(
            topics.EVENTS, "What the processors derived: detections, interruptions, reports.", derived
        ),
        "commands": channel(topics.COMMANDS, "Signed (HMAC-SHA256, a key per run) and idempotent.", commands),
        "acks": channel(topics.ACKS, "One per rank and command: executed, refused or failed.", acks),
        "deadletter": channel(topics.DEADLETTER, "Nothing is dropped silently.", dead_letter),
        "runs": channel(topics.RUNS, "Reserved: created, nothing publishes to it yet.", {}),
    }
    operations = {
        "shipTelemetry": ("send", "telemetry", "Ranks and launchers ship telemetry."),
        "consumeEvents": ("receive", "events", "Dashboards, pagers and schedulers consume derived events."),
        "sendCommands": ("send", "commands", "Processors (and the run API) send commands."),
        "receiveCommands": ("receive", "commands", "Rank actuators execute the commands of their run."),
        "sendAcks": ("send", "acks", "Rank actuators acknowledge each command."),
        "consumeDeadLetters": ("receive", "deadletter", "Operators inspect rejected records."),
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
                    {"$ref": f"#/channels/{chan}/messages/{kind}"} for kind in channels[chan]["messages"]
                ],
            }
            for name, (action, chan, summary) in operations.items()
        },
        "components": {
            "messages": {**telemetry, **telemetry_records, **derived, **commands, **acks, **dead_letter}
        },
    }


def rendered() -> dict[str, str]:
    """Every contract file's text, by its path under docs/contract/."""
    files = {"asyncapi.json": asyncapi(), **json_schemas()}
    return {path: json.dumps(doc, indent=2, sort_keys=False) + "\n" for path, doc in files.items()}
