"""The live half of the evaluation: a scenario through the real pipeline (simulator ->
Kafka -> faust processor -> Kafka), its detections read back from the events topic and
scored exactly like the pure core's."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaError

from ..broker.lag import wait_caught_up
from ..broker.security import client_config
from ..producers.simulator import Scenario
from ..producers.simulator.driver import run_simulation
from ..schemas import Derived, Envelope, decode, decode_batch
from ..schemas.codec import DERIVED
from ..stack import PROCESSOR_GROUP, Stack
from .evaluate import ScenarioScore, score, step_start_times


def _read(bootstrap: str, topic: str) -> list[bytes]:
    """Every record on `topic` up to its current end."""
    consumer = Consumer(
        client_config(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"evaluate-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
            }
        )
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.subscribe([topic])
        done: set[int] = set()
        values: list[bytes] = []
        deadline = time.monotonic() + 120
        while len(done) < len(partitions) and time.monotonic() < deadline:
            for msg in consumer.consume(5000, 0.5):
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        done.add(msg.partition() or 0)
                    continue
                values.append(msg.value() or b"")
        return values
    finally:
        consumer.close()


def run_live(scenario: Scenario, stack: Stack, secret: bytes, speed: float | None = None) -> ScenarioScore:
    run_id = f"eval-{scenario.name}-{uuid.uuid4().hex[:6]}"
    run_simulation(
        scenario, stack.bootstrap, stack.names, secret, speed=speed or scenario.live_speed, run_id=run_id
    )
    wait_caught_up(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry], timeout_s=120)
    time.sleep(1.0)  # outputs of the last records are published before the offset commits
    derived: list[Derived] = []
    for value in _read(stack.bootstrap, stack.names.events):
        record = decode(value, DERIVED)
        if isinstance(record, Derived) and record.run_id == run_id:
            derived.append(record)
    telemetry: list[Envelope] = []
    for value in _read(stack.bootstrap, stack.names.telemetry):
        batch = decode_batch(value)
        telemetry += [e for e in batch.events if e.run_id == run_id]
    telemetry.sort(key=lambda e: e.ts)
    return score(scenario.name, scenario.truth(), derived, step_start_times(telemetry), scenario.racks())
