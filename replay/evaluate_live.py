"""The live half of the evaluation: a scenario through the real pipeline (simulator ->
Kafka -> faust processor -> Kafka), its detections read back from the events topic and
scored exactly like the pure core's."""

from __future__ import annotations

import time
import uuid

from ..broker.lag import wait_caught_up
from ..producers.simulator import Scenario
from ..producers.simulator.driver import run_simulation
from ..schemas import Derived, Envelope, decode, decode_batch
from ..schemas.codec import DERIVED
from ..stack import PROCESSOR_GROUP, Stack
from .evaluate import ScenarioScore, score, step_start_times
from .log import read_topic


def run_live(scenario: Scenario, stack: Stack, secret: bytes, speed: float | None = None) -> ScenarioScore:
    run_id = f"eval-{scenario.name}-{uuid.uuid4().hex[:6]}"
    run_simulation(
        scenario, stack.bootstrap, stack.names, secret, speed=speed or scenario.live_speed, run_id=run_id
    )
    wait_caught_up(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry], timeout_s=120)
    time.sleep(1.0)  # outputs of the last records are published before the offset commits
    derived: list[Derived] = []
    for _, _, value in read_topic(stack.bootstrap, stack.names.events):
        record = decode(value, DERIVED)
        if isinstance(record, Derived) and record.run_id == run_id:
            derived.append(record)
    telemetry: list[Envelope] = []
    for _, _, value in read_topic(stack.bootstrap, stack.names.telemetry):
        batch = decode_batch(value)
        telemetry += [e for e in batch.events if e.run_id == run_id]
    telemetry.sort(key=lambda e: e.ts)
    return score(scenario.name, scenario.truth(), derived, step_start_times(telemetry), scenario.racks())
