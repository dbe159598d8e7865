"""A consumer of trainguard's derived events, written against the published contract only
(docs/contract/: the AsyncAPI document and a JSON Schema per kind), not trainguard's code:
what a pager, a dashboard or a scheduler in another stack would do.

    python docs/examples/consume_events.py --bootstrap 127.0.0.1:9092
    python docs/examples/consume_events.py --bootstrap ... --topic t1.trainguard.events --max 10

Prints one line per event: its schema, run, the fields every event has, and the reason a
decision gives. Each record is validated against its kind's JSON Schema when the
`jsonschema` package is installed. A record of a kind or version this consumer does not
know is reported and skipped, never fatal (the stream's versions evolve, docs/streams.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer

CONTRACT = Path(__file__).resolve().parents[1] / "contract"


def load_schemas(contract: Path) -> dict[str, dict[str, Any]]:
    """'kind/version' -> its JSON Schema, from the contract's files."""
    schemas = {}
    for path in sorted((contract / "schemas").glob("*.json")):
        schema = json.loads(path.read_text())
        schemas[schema["title"]] = schema
    return schemas


def describe(event: dict[str, Any]) -> str:
    reason = event.get("reason") or {}
    text = f" - {reason.get('code')}: {reason.get('text')}" if reason else ""
    return (
        f"{event['schema']:28s} run {event.get('run_id')} attempt {event.get('attempt')} "
        f"rank {event.get('rank')} step {event.get('step')}{text}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", default="trainguard.events")
    parser.add_argument("--group", default=f"events-example-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--max", type=int, default=0, help="stop after this many events (0: never)")
    parser.add_argument(
        "--idle-timeout", type=float, default=0.0, help="stop after this long with nothing new"
    )
    args = parser.parse_args()

    schemas = load_schemas(CONTRACT)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None  # type: ignore[assignment]
    consumer = Consumer(
        {"bootstrap.servers": args.bootstrap, "group.id": args.group, "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([args.topic])
    seen, idle = 0, 0.0
    try:
        while not args.max or seen < args.max:
            msg = consumer.poll(1.0)
            if msg is None:
                idle += 1.0
                if args.idle_timeout and idle >= args.idle_timeout:
                    break
                continue
            idle = 0.0
            if msg.error():
                print(f"consumer error: {msg.error()}", file=sys.stderr)
                continue
            event = json.loads(msg.value())
            schema = schemas.get(event.get("schema", ""))
            if schema is None:  # a newer version than this contract: skip, do not crash
                print(f"skipped {event.get('schema')!r}: not in this contract", file=sys.stderr)
                continue
            if jsonschema is not None:
                jsonschema.validate(event, schema)
            print(describe(event), flush=True)
            seen += 1
    finally:
        consumer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
