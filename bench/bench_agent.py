"""Cost of one RankAgent.step() call, as the training loop sees it.

    .venv/bin/python bench/bench_agent.py --bootstrap 127.0.0.1:9092

Prints one markdown table row per setting: the agent alone (an in-memory sink: pydantic
validation and id generation), a real TelemetryShipper delivering to the broker given by
--bootstrap (its topics are created under the prefix "bench." unless --topic names one),
the same with a 1 ms sleep between calls (closer to a training loop, which leaves the
GIL to the shipper thread while the GPU works; back-to-back calls make the agent compete
with the shipper thread for the GIL), and a real shipper whose broker is unreachable
(queue full, oldest events dropped). Each
step() call emits two events (StepTiming and StepStats). Times are per call, measured
with perf_counter_ns around each call (the timer adds ~0.1 µs).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from trainguard.producers.rank.agent import EventSink, RankAgent
from trainguard.producers.rank.shipper import ShipperConfig, TelemetryShipper
from trainguard.schemas import Envelope

UNREACHABLE = "127.0.0.1:9"  # the discard port: connection refused


class NullSink:
    def submit(self, event: Envelope) -> bool:
        return True


def measure(sink: EventSink, calls: int, pause_s: float = 0.0) -> list[int]:
    """Per-call durations (ns); with `pause_s`, the loop sleeps between calls as a real
    training step does (releasing the GIL to the shipper thread meanwhile)."""
    agent = RankAgent(sink, "bench-run", attempt=0, rank=0, node="bench-node")
    for step in range(1000):  # warm-up
        agent.step(step, compute_s=0.5, total_s=0.6, loss=2.0, grad_norm=1.0)
    durations = [0] * calls
    clock = time.perf_counter_ns
    for i in range(calls):
        start = clock()
        agent.step(i, compute_s=0.5, total_s=0.6, loss=2.0, grad_norm=1.0)
        durations[i] = clock() - start
        if pause_s:
            time.sleep(pause_s)
    return durations


def row(setting: str, durations: list[int], note: str = "") -> str:
    ordered = sorted(durations)
    mean = statistics.fmean(durations) / 1000
    p50 = ordered[len(ordered) // 2] / 1000
    p99 = ordered[int(0.99 * len(ordered))] / 1000
    worst = ordered[-1] / 1000
    return f"| {setting} | {len(durations):,} | {mean:.2f} | {p50:.2f} | {p99:.2f} | {worst:,.0f} | {note} |"


def shipper_row(
    setting: str, bootstrap: str, topic: str, calls: int, close_s: float, pause_s: float = 0.0
) -> str:
    shipper = TelemetryShipper(ShipperConfig(bootstrap, topic), "bench-run", world_size=1, name="bench")
    durations = measure(shipper, calls, pause_s)
    stats = shipper.close(timeout_s=close_s)
    note = f"delivered {stats.delivered:,}, dropped {stats.dropped:,}, failed {stats.failed:,}"
    return row(setting, durations, note)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", help="a Kafka broker, HOST:PORT (omit to skip the delivering row)")
    parser.add_argument("--topic", help="telemetry topic to use as is (default: create bench.* topics)")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--paced-calls", type=int, default=5_000, help="calls of the 1 ms-paced row")
    args = parser.parse_args()

    print(
        f"RankAgent.step() cost, 2 events per call; Python {platform.python_version()}, {platform.machine()}"
    )
    print()
    print("| setting | calls | mean µs | p50 µs | p99 µs | max µs | shipper counters |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    print(row("agent alone (null sink)", measure(NullSink(), args.calls)), flush=True)
    if args.bootstrap:
        topic = args.topic
        if topic is None:
            from trainguard.kafka.topics import ensure_topics, topic_names

            ensure_topics(args.bootstrap, prefix="bench.")
            topic = topic_names("bench.").telemetry
        print(shipper_row("shipper, broker up", args.bootstrap, topic, args.calls, close_s=30), flush=True)
        paced = shipper_row(
            "shipper, broker up, 1 ms between calls", args.bootstrap, topic, args.paced_calls, 30, 0.001
        )
        print(paced, flush=True)
    print(
        shipper_row("shipper, broker unreachable", UNREACHABLE, "bench", args.calls, close_s=0.5), flush=True
    )


if __name__ == "__main__":
    main()
