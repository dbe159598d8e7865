"""The live half of the evaluation: a scenario through the real pipeline (simulator ->
Kafka -> faust processor -> Kafka), its detections read back from the events topic, its
commands from the commands topic, and scored exactly like the pure core's. Records from
ranks outside the world size: those the telemetry topic holds are the ones sent, those
the dead-letter topic holds for the run are the ones rejected."""

from __future__ import annotations

import time
import uuid

from trainguard.kafka.lag import wait_caught_up
from trainguard.producers.simulator import Scenario
from trainguard.producers.simulator.driver import run_simulation
from trainguard.replay.log import read_topic
from trainguard.schemas import Command, Derived, Envelope, Rejected, decode, decode_batch
from trainguard.schemas.codec import COMMANDS, DERIVED, TELEMETRY

from ..scoring.evaluate import ScenarioScore, score, step_start_times
from .stack import PROCESSOR_GROUP, Stack


def run_live(scenario: Scenario, stack: Stack, secret: bytes, speed: float | None = None) -> ScenarioScore:
    run_id = f"eval-{scenario.name}-{uuid.uuid4().hex[:6]}"
    run_simulation(
        scenario, stack.bootstrap, stack.names, secret, speed=speed or scenario.live_speed, run_id=run_id
    )
    wait_caught_up(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry], timeout_s=120)
    time.sleep(1.0)  # outputs of the last records are published before the offset commits
    derived: list[Derived | Command] = []
    for _, _, value in read_topic(stack.bootstrap, stack.names.events):
        record = decode(value, DERIVED)
        if isinstance(record, Derived) and record.run_id == run_id:
            derived.append(record)
    for _, _, value in read_topic(stack.bootstrap, stack.names.commands):
        command = decode(value, COMMANDS)
        if isinstance(command, Command) and command.run_id == run_id:
            derived.append(command)
    world = scenario.world_size
    telemetry: list[Envelope] = []
    sent = 0
    for _, _, value in read_topic(stack.bootstrap, stack.names.telemetry):
        batch = decode_batch(value, world_size=world)
        telemetry += [e for e in batch.events if e.run_id == run_id]
        if batch.header is not None and batch.header.run_id == run_id:
            sent += sum(1 for r in batch.rejections if r.reason == "rank_out_of_range")
    rejected = 0
    for _, _, value in read_topic(stack.bootstrap, stack.names.deadletter):
        try:
            event = decode(value, TELEMETRY)
        except Rejected:
            continue
        if isinstance(event, Envelope) and event.run_id == run_id and event.rank >= world:
            rejected += 1
    telemetry.sort(key=lambda e: e.ts)
    return score(
        scenario.name,
        scenario.truth(),
        derived,
        step_start_times(telemetry),
        scenario.racks(),
        scenario.expect,
        world,
        (sent, rejected),
    )
