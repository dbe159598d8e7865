"""Can the simulator drive 16,384 ranks at 2 s/step in real time on a small machine?

Two modes, one markdown table row each:

* against a broker (``--bootstrap HOST:PORT``, or ``--start-broker`` for a local one in
  a temporary directory): runs the scenario for ``--seconds`` of wall clock through the
  real driver (one TelemetryShipper) into fresh topics, and reports sustained events/s,
  Kafka records/s, drops, the lag between an event's simulated moment and its hand-off
  to the shipper, and CPU (the simulator process; the broker's too when its pid is known);
* ``--no-broker``: the pure cost of generating and encoding the events (cluster state
  machine + the codec's per-event encode + per-node batch framing), as fast as possible,
  reported as the CPU share of one core that real time needs.

    python bench/bench_simulator.py --start-broker --seconds 60
    python bench/bench_simulator.py --no-broker --seconds 120
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.schemas import encode, encode_batch

HEADER = (
    "| mode | scenario | ranks | speed | wall s | events | events/s | records/s | dropped+failed "
    "| max lag ms | mean lag ms | real time | sim CPU % | broker CPU % |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scenario(name: str) -> Scenario:
    path = Path(name)
    return Scenario.load(path) if path.suffix in (".yaml", ".yml") else Scenario.builtin(name)


def bench_no_broker(scenario: Scenario, sim_seconds: float, flush_s: float = 1.0) -> str:
    """Generate `sim_seconds` of the scenario flat out, encoding and framing like the
    shipper: every event encoded, one batch per node per `flush_s` of simulated time."""
    start = 1_700_000_000.0
    cluster = SimulatedCluster(scenario, start, run_id="bench", id_prefix="b")
    tick = min(0.1, scenario.step_time_s / 4)
    events = nbytes = records = 0
    pending: dict[str, list[bytes]] = {}
    next_flush = start + flush_s
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    t = cluster.now
    while t < start + sim_seconds:
        t += tick
        batch = cluster.advance(t)
        events += len(batch)
        for event in batch:
            pending.setdefault(event.node, []).append(encode(event))
        if t >= next_flush:
            next_flush += flush_s
            for node, encoded in pending.items():
                header = {"run_id": "bench", "node": node, "world_size": scenario.world_size}
                nbytes += len(encode_batch({**header, "producer_id": "b", "seq": records}, encoded))
                records += 1
            pending = {}
    wall, cpu = time.perf_counter() - wall0, _cpu_s() - cpu0
    need = 100 * cpu / sim_seconds  # % of one core to keep real time
    print(
        f"# {events:,} events ({nbytes / events:.0f} B each as JSON) for {sim_seconds:g} simulated s "
        f"in {wall:.1f} s wall / {cpu:.1f} s CPU: {events / cpu:,.0f} events per CPU-second; "
        f"real time needs {need:.1f}% of one core",
        file=sys.stderr,
    )
    return (
        f"| no-broker | {scenario.name} | {scenario.world_size} | max | {wall:.1f} | {events:,} "
        f"| {events / sim_seconds:,.0f} (sim) | {records / sim_seconds:,.0f} (sim) | 0 | - | - "
        f"| x{sim_seconds / wall:.1f} | {need:.1f} (for real time) | - |"
    )


def bench_broker(
    scenario: Scenario, bootstrap: str, seconds: float, speed: float, broker_pid: int | None, keep: bool
) -> str:
    from trainguard.kafka.topics import delete_topics, ensure_topics, topic_names
    from trainguard.producers.simulator.driver import Progress, run_simulation

    prefix = f"bench{uuid.uuid4().hex[:6]}."
    ensure_topics(bootstrap, prefix=prefix)
    topics = topic_names(prefix)
    broker = psutil.Process(broker_pid) if broker_pid else None
    broker_cpu0 = sum(broker.cpu_times()[:2]) if broker else 0.0

    def report(p: Progress) -> None:
        if int(p.wall_s) % 10 == 0:
            print(
                f"# {p.wall_s:5.1f}s step {p.step} events {p.events:,} max lag {p.lag_s * 1000:.0f} ms",
                file=sys.stderr,
            )

    try:
        result = run_simulation(
            scenario, bootstrap, topics, None, speed=speed, max_seconds=seconds, progress=report
        )
    finally:
        broker_cpu = sum(broker.cpu_times()[:2]) - broker_cpu0 if broker else None
        if not keep:
            delete_topics(bootstrap, list(dataclasses.astuple(topics)))
    s = result.shipper
    wall = result.wall_s
    print(f"# shipper: {s}; steps completed {result.steps_completed}", file=sys.stderr)
    broker_pct = f"{100 * broker_cpu / wall:.0f}" if broker_cpu is not None else "-"
    return (
        f"| broker | {scenario.name} | {scenario.world_size} | {speed:g} | {wall:.1f} | {s.delivered:,} "
        f"| {s.delivered / wall:,.0f} | {s.batches_sent / wall:,.0f} | {s.dropped + s.failed} "
        f"| {result.max_lag_s * 1000:.0f} | {result.mean_lag_s * 1000:.0f} "
        f"| {'yes' if result.kept_real_time else 'NO'} | {100 * result.cpu_s / wall:.0f} | {broker_pct} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", default="healthy-16k", help="built-in name or YAML path")
    parser.add_argument("--seconds", type=float, default=60.0, help="wall s (simulated s: --no-broker)")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    parser.add_argument("--bootstrap", default=os.environ.get("TRAINGUARD_BOOTSTRAP"))
    parser.add_argument("--start-broker", action="store_true", help="start a local broker for the run")
    parser.add_argument("--broker-pid", type=int, default=None, help="pid of the broker, to report its CPU")
    parser.add_argument("--keep-topics", action="store_true")
    parser.add_argument("--no-broker", action="store_true")
    args = parser.parse_args()
    scenario = _scenario(args.scenario)
    print(HEADER)
    if args.no_broker:
        print(bench_no_broker(scenario, args.seconds), flush=True)
        return 0
    if args.start_broker:
        from harness.devtools.broker_jars import ensure_jars
        from harness.devtools.local_broker import LocalBroker

        ensure_jars()
        with tempfile.TemporaryDirectory(prefix="bench-kafka-") as tmp, LocalBroker(Path(tmp)) as broker:
            bootstrap = broker.bootstrap
            assert bootstrap is not None
            row = bench_broker(scenario, bootstrap, args.seconds, args.speed, broker.pid, args.keep_topics)
    elif args.bootstrap:
        pid = args.broker_pid
        row = bench_broker(scenario, args.bootstrap, args.seconds, args.speed, pid, args.keep_topics)
    else:
        parser.error("give --bootstrap, --start-broker or --no-broker")
    print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
