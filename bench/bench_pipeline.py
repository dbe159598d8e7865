"""The live pipeline, produce to archive: how many events/s does it sustain end to end?

Each run starts everything fresh in a temporary directory: a local Kafka broker, the
processor (``python -m trainguard process``, a faust worker, in its own process), the
DuckDB archive writer (a thread here), and the simulator (``run_simulation``, whose
actuator executes the processor's signed commands). It runs the scenario for a bounded
wall time, then waits until the processor's consumer group has committed everything on
the telemetry topic and the archive holds every delivered telemetry event, and reports:

  events         telemetry events the shipper delivered to Kafka
  e2e ev/s       events archived / (last archived - first produced), wall clock
  records/s      Kafka records (one per node per flush) the shipper sent per second
  proc/arch s    seconds after the producer stopped until the processor had committed
                 everything (faust commits every 1 s) / the archive held every event
  CPU %          of one core, from the first produce until both caught up: the processor,
                 the broker, and this process (simulator + actuator + archive writer)

and checks the pipeline did its job: the demo's injected crash and hang must appear in the
archive's timeline on the right nodes; a healthy run must show no interruption.

    python bench/bench_pipeline.py --scenario demo            # to completion, ~100 s
    python bench/bench_pipeline.py --scenario 1k --seconds 60 # healthy-1k.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from harness.devtools.broker_config import free_ports
from harness.devtools.stack import local_stack
from trainguard.kafka.lag import group_lag
from trainguard.kafka.topics import TopicNames
from trainguard.producers.simulator import Scenario
from trainguard.producers.simulator.driver import Progress, run_simulation
from trainguard.schemas.auth import SECRET_ENV
from trainguard.sinks.archive import ArchiveWriter, timeline

GROUP = "trainguard-processor"
POLICY = Path(__file__).resolve().parents[1] / "processors" / "policies" / "demo.yaml"
ALIASES = {"1k": "healthy-1k"}
HEADER = (
    "| scenario | ranks | speed | sim wall s | events | produced ev/s | e2e ev/s | records/s "
    "| dropped+failed | proc lag at stop | proc catch-up s | arch catch-up s | processor CPU % "
    "| broker CPU % | bench CPU % | interruptions | check |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


@dataclass
class Pipeline:
    bootstrap: str
    names: TopicNames
    secret: bytes
    writer: ArchiveWriter
    processor: subprocess.Popen[bytes]
    processor_log: Path
    broker_pid: int
    archiver: threading.Thread
    stop_archiver: threading.Event

    def archived(self) -> int:
        """Telemetry events in the archive: raw_event also holds the processor's derived events (on
        the events topic) and the ticks it writes into the telemetry topic while a hang is pending."""
        sql = "SELECT count(*) FROM raw_event WHERE topic = ? AND kind <> 'tick'"
        with contextlib.closing(self.writer.archive.cursor()) as con:
            return int(con.execute(sql, [self.names.telemetry]).fetchall()[0][0])

    def check_processor(self) -> None:
        if self.processor.poll() is not None:
            tail = self.processor_log.read_text()[-3000:]
            raise RuntimeError(f"the processor exited ({self.processor.returncode}):\n{tail}")

    def finish_archive(self) -> None:
        """Stop the writer thread, then archive what the topics hold now (acks, derived events)."""
        self.stop_archiver.set()
        self.archiver.join(timeout=60)
        self.writer.run_until_caught_up(timeout_s=60)


@contextlib.contextmanager
def pipeline(workdir: Path, policy: Path) -> Iterator[Pipeline]:
    """Broker, processor (harness.devtools.stack) and archive writer, started fresh; all stopped on
    exit, errors included."""
    secret = secrets.token_hex(24)
    stop = threading.Event()
    with local_stack(workdir, policy, free_ports(1)[0], secret_env={SECRET_ENV: secret}) as stack:
        assert stack.broker.pid is not None
        writer = ArchiveWriter(stack.bootstrap, stack.names, workdir / "bench-archive")
        archiver = threading.Thread(target=writer.run, args=(stop,), name="archive", daemon=True)
        archiver.start()
        try:
            yield Pipeline(
                stack.bootstrap,
                stack.names,
                secret.encode(),
                writer,
                stack.processor,
                stack.processor_log,
                stack.broker.pid,
                archiver,
                stop,
            )
        finally:
            stop.set()
            archiver.join(timeout=60)
            if not archiver.is_alive():
                writer.close()


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench(scenario: Scenario, seconds: float | None, speed: float, policy: Path) -> tuple[str, bool]:
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp, pipeline(Path(tmp), policy) as p:
        procs = {"processor": psutil.Process(p.processor.pid), "broker": psutil.Process(p.broker_pid)}
        first: list[float] = []  # monotonic time of the simulation's first tick

        def report(progress: Progress) -> None:
            if not first:
                first.append(time.monotonic() - progress.wall_s)
                cpu0.update({name: _cpu_s(proc) for name, proc in procs.items()}, bench=_self_cpu_s())
            if int(progress.wall_s) % 10 == 0:
                print(
                    f"# {progress.wall_s:5.1f}s step {progress.step} attempt {progress.attempt} "
                    f"({progress.phase}) events {progress.events:,}",
                    file=sys.stderr,
                )

        cpu0: dict[str, float] = {}
        result = run_simulation(
            scenario, p.bootstrap, p.names, p.secret, speed=speed, max_seconds=seconds, progress=report
        )
        stopped = time.monotonic()
        p.check_processor()
        delivered = result.shipper.delivered
        lag_at_stop = group_lag(p.bootstrap, GROUP, [p.names.telemetry])
        processor_at = archive_at = None
        while processor_at is None or archive_at is None:
            now = time.monotonic()
            if now - stopped > 600:
                raise TimeoutError(
                    f"not caught up 600 s after the producer stopped ({p.archived():,} archived)"
                )
            if archive_at is None and p.archived() >= delivered:
                archive_at = now
            if processor_at is None and group_lag(p.bootstrap, GROUP, [p.names.telemetry]) == 0:
                processor_at = now
            time.sleep(0.1)
        window = max(processor_at, archive_at) - first[0]
        cpu = {name: _cpu_s(proc) - cpu0[name] for name, proc in procs.items()}
        cpu["bench"] = _self_cpu_s() - cpu0["bench"]
        p.check_processor()
        archived = p.archived()
        p.finish_archive()
        rows = timeline(p.writer.archive)

    for row in rows:
        print(
            f"# interruption {row['cause']} on {row['node']} rank {row['rank']}: lost {row['lost_steps']} "
            f"steps, restart {row['restart_seconds'] or 0:.1f} s, detected by {row['detected_by']}",
            file=sys.stderr,
        )
    expected = [(t.kind, t.node) for t in scenario.truth() if t.kind in ("crash", "hang")]
    found = [(str(r["cause"]), r["node"]) for r in rows]
    ok = all(e in found for e in expected) if expected else not found
    s = result.shipper
    print(
        f"# shipper {s}; {result.steps_completed} steps, {result.attempts} attempt(s), "
        f"{result.commands_executed} commands executed; simulator max lag {result.max_lag_s * 1000:.0f} ms; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
        file=sys.stderr,
    )
    e2e = archived / (archive_at - first[0])
    row = (
        f"| {scenario.name} | {scenario.world_size} | {speed:g} | {result.wall_s:.1f} | {delivered:,} "
        f"| {delivered / result.wall_s:,.0f} | {e2e:,.0f} | {s.batches_sent / result.wall_s:,.0f} "
        f"| {s.dropped + s.failed} | {lag_at_stop:,} rec | {processor_at - stopped:.1f} "
        f"| {archive_at - stopped:.1f} | {100 * cpu['processor'] / window:.0f} "
        f"| {100 * cpu['broker'] / window:.0f} | {100 * cpu['bench'] / window:.0f} "
        f"| {', '.join(f'{c}@{n}' for c, n in found) or 'none'} | {'ok' if ok else 'FAILED'} |"
    )
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", default="demo", help="demo, 1k (healthy-1k), a built-in or a YAML")
    parser.add_argument("--seconds", type=float, default=None, help="wall s (default: demo 0 = all, else 60)")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    parser.add_argument("--policy", type=Path, default=POLICY)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the broker and processor
    name = ALIASES.get(args.scenario, args.scenario)
    path = Path(name)
    scenario = Scenario.load(path) if path.suffix in (".yaml", ".yml") else Scenario.builtin(name)
    seconds = args.seconds if args.seconds is not None else (0 if scenario.name == "demo" else 60)
    row, ok = bench(scenario, seconds or None, args.speed, args.policy)
    print(HEADER)
    print(row)
    print(f"\n`{shlex.join(['python', 'bench/bench_pipeline.py', *sys.argv[1:]])}`")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
