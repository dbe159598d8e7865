"""The policy core's throughput on one core: events/s through every detector.

    .venv/bin/python bench/bench_core.py --scenario control-16k --events 600000

Generates a scenario's telemetry with the simulator (16,384 ranks at 2 s/step by
default: step timings, step stats, heartbeats, GPU health, checkpoints), packs it into
per-node batches as the shipper does, and times two things in this process:
  core     engine.step over already-decoded events (detectors only)
  driver   CoreDriver.handle over the Kafka record values (decode + core + signing),
           which is what the faust worker does per record
and reports events/s and the multiple of the scenario's real-time event rate.
Prints a markdown table row.
"""

from __future__ import annotations

import argparse
import time

from trainguard.processors.core import CorePolicy, CoreState, step
from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.schemas import Envelope, encode, encode_batch


def generate(scenario: Scenario, count: int) -> tuple[list[Envelope], float]:
    cluster = SimulatedCluster(scenario, 1_000.0, run_id="bench")
    events: list[Envelope] = []
    t = 1_000.0
    while len(events) < count and not cluster.done:
        t += 0.5
        events += cluster.advance(t)
    return events, t - 1_000.0


def batches(scenario: Scenario, events: list[Envelope], per_record: int = 256) -> list[bytes]:
    by_node: dict[str, list[Envelope]] = {}
    for event in events:
        by_node.setdefault(event.node, []).append(event)
    values = []
    for node, group in by_node.items():
        for i in range(0, len(group), per_record):
            header = dict(run_id="bench", node=node, world_size=scenario.world_size, producer_id="b", seq=i)
            values.append(encode_batch(header, [encode(e) for e in group[i : i + per_record]]))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", default="control-16k")
    parser.add_argument("--events", type=int, default=600_000)
    args = parser.parse_args()
    scenario = Scenario.builtin(args.scenario)
    events, sim_s = generate(scenario, args.events)
    values = batches(scenario, events)
    real_rate = len(events) / sim_s

    state, policy = CoreState(), CorePolicy()
    start = time.process_time()
    for event in events:
        step(state, event, policy)
    core_s = time.process_time() - start

    driver = CoreDriver(CorePolicy(), b"bench-secret-0123456789abcdef")
    start = time.process_time()
    for value in values:
        driver.handle(value)
    driver_s = time.process_time() - start

    print(f"{len(events):,} events over {sim_s:.0f} simulated s ({real_rate:,.0f} events/s in real time)")
    print("\n| scenario | ranks | events | core ev/s | core x real time | driver ev/s | driver x real time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {scenario.name} | {scenario.world_size} | {len(events):,} | {len(events) / core_s:,.0f} | "
        f"{len(events) / core_s / real_rate:.1f} | {len(events) / driver_s:,.0f} | "
        f"{len(events) / driver_s / real_rate:.1f} |"
    )


if __name__ == "__main__":
    main()
