"""The LIVE processor at a 16,384-rank run: sustained events/s and end-to-end latency.

    .venv/bin/python bench/bench_live.py                      # paced at 5x real time, 240 sim s
    .venv/bin/python bench/bench_live.py --speed 1            # at real time
    .venv/bin/python bench/bench_live.py --drain              # as fast as possible: max events/s
    .venv/bin/python bench/bench_live.py --sim-seconds 60     # a short run

Answers two questions about ONE processor (``python -m trainguard process``, a faust
worker in its own process, started with a fresh local Kafka broker by
harness.devtools.stack.local_stack):
  1. how many telemetry events/s it sustains, as a multiple of the run's real-time event
     rate (issue 3's target: 5x a 16,384-rank run at 2 s/step; live-16k's real-time rate
     is ~16,900 events/s, so ~85,000 events/s), and
  2. the end-to-end latency of a telemetry record, from its Kafka CreateTime (the produce
     call) until the processor has processed it and its outputs are delivered, while the
     load runs at `--speed` x real time (target: p99 < 1 s at 5x).

How. The scenario's telemetry (default bench/scenarios/live-16k.yaml: 16,384 ranks, 2 s
per step, every event kind, a thermal straggler from step 5 and a grad spike at step 60)
is generated OPEN LOOP before anything starts (the processor's commands are not executed),
and packed as the shipper packs it: one Kafka record per node per simulated second (its
flush interval), `encode_batch` with the shipper's header fields, keyed by `record_key`.
About 3.6 MB of record values per simulated second are held in memory (~0.9 GB for the
default 250 s). Then the stack starts; the first `--warmup` simulated seconds are produced
at once and the bench waits until the processor has committed them (its consumer is up,
the run known). The measured part follows:
  paced   the records of simulated second s are produced at wall time
          start + s / speed, spread evenly over that 1/speed slice (2,048 unsynchronised
          node shippers, not one burst), so the load is `speed` x real time
  drain   everything produced as fast as possible; the processor's rate is read while
          it works through the backlog (from when the producer has finished, until 95%
          of the events are processed), so it is measured saturated, without the
          producer competing for the CPU

Reported (one markdown row; notes on stderr):
  produced ev/s     events produced / produce time
  processed ev/s    trainguard_events_processed_total delta / window: paced, the produce
                    window (equal to produced ev/s when the processor keeps up, its
                    ceiling when it does not); drain, the saturated window
  x real time       processed ev/s / the scenario's real-time event rate (paced: at most
                    `speed`; the processor's ceiling shows only when it falls behind)
  raw consume       the same records read again by aiokafka alone (bench/raw_consume.py),
                    nothing decoded, the fastest of RAW_READS reads: this machine's client limit
  no-op faust       the same records through a faust agent that does nothing
                    (bench/faust_consume.py) on the processor's transport
                    (processors/eager_delivery.py); stderr also gives faust's own
  processor CPU %   of one core, over the same window (psutil)
  max lag records   consumer group lag of trainguard-processor on the telemetry topic,
                    sampled every second (committed offsets: faust commits every 1 s or
                    1,000 records, so ~1 s of records shows even when it keeps up)
  latency p50/p99   from the processor's histograms trainguard_record_latency_seconds
                    (every telemetry record) and trainguard_decision_latency_seconds
                    (records that caused a decision), scraped before the measured part
                    and after every measured record was processed; quantiles are
                    linearly interpolated inside the bucket that holds them (so they
                    are exact only to the bucket width; ">B": beyond the last finite
                    bound B). In drain mode they are backlog waits, not a latency
                    figure, and shown as "-".
  decisions         records that caused derived events or commands (decision histogram count)
  delivery errors   records librdkafka failed or did not deliver (must be 0)
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from confluent_kafka import KafkaError, Message, Producer
from raw_consume import cpu_s as cpu_s_self
from raw_consume import faust_consume, high_watermarks, raw_consume

from harness.devtools.broker_config import free_ports
from harness.devtools.stack import (
    PROCESSOR_GROUP,
    Stack,
    builtin_policy,
    local_stack,
    scrape,
    start_processor,
)
from trainguard.kafka.lag import group_lag
from trainguard.kafka.topics import partition_count
from trainguard.producers.rank.shipper import PRODUCER_DEFAULTS, pack
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.schemas import Envelope
from trainguard.schemas.auth import SECRET_ENV
from trainguard.schemas.sharding import DEFAULT_SHARD_RANKS, shard_count, shard_size, telemetry_partition

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "live-16k.yaml"
PROCESSED = "trainguard_events_processed_total"
RECORD_LATENCY = "trainguard_record_latency_seconds"
DECISION_LATENCY = "trainguard_decision_latency_seconds"
#: Reads of the raw-consume baseline; the fastest is the limit reported.
RAW_READS = 3
#: The no-op faust baselines (bench/faust_consume.py); the table shows the processor's.
TRANSPORTS = {"stock": "faust's transport", "eager": "the processor's eager transport"}
HEADER = (
    "| mode | ranks | workers | speed | wall s | events | records | produced ev/s | processed ev/s "
    "| x real time | raw consume ev/s | of raw | no-op faust ev/s | of no-op faust | processor CPU % "
    "| max lag records "
    "| record latency p50/p99 s | decisions "
    "| decision latency p50/p99 s | delivery errors |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"
)


# --------------------------------------------------------------------------- load


@dataclass
class Load:
    run_id: str
    world_size: int
    shards: int
    #: (flush window, shard, key, value) in produce order; a window's records are contiguous.
    records: list[tuple[int, int, bytes, bytes]]
    #: Telemetry events in each simulated second.
    events: list[int]


def generate(
    scenario: Scenario,
    seconds: int,
    run_id: str,
    flush_sim_s: int,
    shard_ranks: int,
    columnar: bool = True,
    id_prefix: str | None = None,
) -> Load:
    """The scenario's telemetry for `seconds` simulated seconds (SimulatedCluster.advance
    every 0.5 s, as bench_core does), packed exactly as a shipper packs it
    (producers.shipper.pack: one record per (shard, node) per flush) with one flush every
    `flush_sim_s` simulated seconds: at --speed k, k simulated seconds are one wall second,
    the flush interval of a shipper with its default settings."""
    start = 1_000.0
    cluster = SimulatedCluster(scenario, start, run_id=run_id, id_prefix=id_prefix)
    producer_id = f"bench-live-{uuid.uuid4().hex[:12]}"
    size = shard_size(scenario.world_size, shard_ranks)
    load = Load(run_id, scenario.world_size, shard_count(scenario.world_size, size), [], [])
    pending: list[Envelope] = []
    seq = 0
    for second in range(seconds):
        events = cluster.advance(start + second + 0.5) + cluster.advance(start + second + 1.0)
        load.events.append(len(events))
        pending += events
        if (second + 1) % flush_sim_s == 0 or cluster.done or second == seconds - 1:
            window = second // flush_sim_s
            for record in pack(pending, run_id, scenario.world_size, size, producer_id, seq, columnar):
                load.records.append((window, record.shard, record.key, record.value))
                seq = record.seq + 1
            pending = []
        if cluster.done:
            break
    return load


# --------------------------------------------------------------------------- produce


class Sender:
    """A librdkafka producer with the shipper's settings that never drops: a full local
    queue waits (poll) instead."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.partitions = partition_count(bootstrap, topic)
        config = {**PRODUCER_DEFAULTS, "bootstrap.servers": bootstrap, "log.connection.close": False}
        self.producer = Producer(config)
        self.delivered = 0
        self.errors = 0

    def _done(self, err: KafkaError | None, _msg: Message) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.errors += 1

    def send(self, key: bytes, value: bytes, partition: int) -> None:
        while True:
            try:
                self.producer.produce(
                    self.topic, key=key, value=value, partition=partition, on_delivery=self._done
                )
                return
            except BufferError:
                self.producer.poll(0.01)

    def flush(self, timeout_s: float) -> int:
        """Wait for delivery; the number of records still undelivered."""
        return int(self.producer.flush(timeout_s))


Records = list[tuple[int, int, bytes, bytes]]


def produce_paced(sender: Sender, load: Load, records: Records, flush_sim_s: int, speed: float) -> None:
    """Flush window w at start + w * flush_sim_s / speed, its records spread evenly over
    that slice (thousands of unsynchronised node shippers, not one burst)."""
    start = time.monotonic()
    first = records[0][0]
    slice_s = flush_sim_s / speed
    for window, group in itertools.groupby(records, key=lambda r: r[0]):
        batch = list(group)
        for i, (_, shard, key, value) in enumerate(batch):
            due = start + (window - first + i / len(batch)) * slice_s
            while (delay := due - time.monotonic()) > 0.001:
                sender.producer.poll(delay)  # serves delivery reports while it waits
            sender.send(key, value, telemetry_partition(load.run_id, shard, load.shards, sender.partitions))
        sender.producer.poll(0)


def produce_all(sender: Sender, load: Load, records: Records) -> None:
    for i, (_, shard, key, value) in enumerate(records):
        sender.send(key, value, telemetry_partition(load.run_id, shard, load.shards, sender.partitions))
        if i % 1000 == 0:
            sender.producer.poll(0)


# --------------------------------------------------------------------------- measure


@dataclass
class Workers:
    """The processor workers of one consumer group: the stack's, plus the extra ones this
    bench starts. Their metrics are summed (histogram buckets add up across workers)."""

    stack: Stack
    extra: list[tuple[subprocess.Popen[bytes], str, Path]] = field(default_factory=list)

    @property
    def all(self) -> list[tuple[subprocess.Popen[bytes], str, Path]]:
        return [(self.stack.processor, self.stack.metrics_url, self.stack.processor_log), *self.extra]

    def scrape_each(self) -> list[dict[str, float]]:
        return [scrape(url) for _, url, _ in self.all]

    def scrape(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for metrics in self.scrape_each():
            for name, value in metrics.items():
                total[name] = total.get(name, 0.0) + value
        return total

    def check_alive(self) -> None:
        for proc, _, log in self.all:
            if proc.poll() is not None:
                raise RuntimeError(f"a processor exited:\n{log.read_text(errors='replace')[-3000:]}")

    def cpu_s(self) -> list[float]:
        return [cpu_s(psutil.Process(proc.pid)) for proc, _, _ in self.all]

    def stop_extra(self) -> None:
        for proc, _, _ in self.extra:
            proc.terminate()
        for proc, _, _ in self.extra:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(frozen=True)
class Sample:
    t: float
    lag: int
    processed: float
    processor_cpu_s: float


@dataclass
class Sampler:
    """Every `interval_s`: the processor group's lag, its processed-events counter, its CPU."""

    workers: Workers
    interval_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        stack = self.workers.stack
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval_s
            try:
                lag = group_lag(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry])
                processed = self.workers.scrape().get(PROCESSED, 0.0)
                self.samples.append(Sample(time.monotonic(), lag, processed, sum(self.workers.cpu_s())))
            except Exception as exc:  # a slow scrape must not end the run; the gap shows
                print(f"# sampler: {exc!r}", file=sys.stderr)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def buckets(metrics: dict[str, float], name: str) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name` by upper bound (+Inf included)."""
    prefix = f'{name}_bucket{{le="'
    out: dict[float, float] = {}
    for key, value in metrics.items():
        if key.startswith(prefix):
            le = key[len(prefix) :].split('"', 1)[0]
            out[math.inf if le == "+Inf" else float(le)] = value
    return out


def quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile of what histogram `name` observed between two scrapes, linearly
    interpolated inside its bucket; inf when it lies beyond the last finite bound."""
    old = buckets(before, name)
    cumulative = sorted((le, count - old.get(le, 0.0)) for le, count in buckets(after, name).items())
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank and count > below:
            return math.inf if math.isinf(le) else lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return math.inf


def latencies(before: dict[str, float], after: dict[str, float], name: str) -> str:
    """'p50 / p99' in seconds; '>B' when beyond the histogram's last finite bound B."""
    last = max((le for le in buckets(after, name) if not math.isinf(le)), default=math.inf)
    out = []
    for q in (0.5, 0.99):
        value = quantile(before, after, name, q)
        out.append("-" if value is None else f">{last:g}" if math.isinf(value) else f"{value:.3f}")
    return " / ".join(out)


def wait_processed(workers: Workers, base: dict[str, float], records: int, timeout_s: float) -> float | None:
    """Until the record-latency histogram has counted `records` more records than at `base`
    (each is observed once its outputs are delivered); the time, or None on timeout."""
    want = base.get(f"{RECORD_LATENCY}_count", 0.0) + records
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if workers.scrape().get(f"{RECORD_LATENCY}_count", 0.0) >= want:
            return time.monotonic()
        workers.check_alive()
        time.sleep(0.5)  # each scrape costs the processor a little
    return None


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith(prefix) and after[k] != before.get(k, 0.0)
    }


# --------------------------------------------------------------------------- bench


def bench(args: argparse.Namespace) -> str:
    scenario = Scenario.load(args.scenario)
    if args.stats_every_rank:
        scenario = scenario.model_copy(update={"stats_every_rank": True})
    run_id = f"bench-live-{uuid.uuid4().hex[:8]}"
    flush = args.flush_sim_s or (1 if args.drain else max(1, round(args.speed)))
    warm_windows = -(-args.warmup // flush)
    began = time.monotonic()
    load = generate(scenario, warm_windows * flush + args.sim_seconds, run_id, flush, args.shard_ranks)
    warmup = [r for r in load.records if r[0] < warm_windows]
    measured = [r for r in load.records if r[0] >= warm_windows]
    sim_s = len(load.events) - warm_windows * flush
    if sim_s <= 0 or not measured:
        raise SystemExit(f"{scenario.name} ended before the measured part (after {len(load.events)} s)")
    events = sum(load.events[warm_windows * flush :])
    real_rate = events / sim_s
    shards = len({r[1] for r in load.records})
    print(
        f"# generated {sum(load.events):,} events in {len(load.records):,} records "
        f"({sum(len(r[3]) for r in load.records) / 2**20:,.0f} MiB, {shards} shard(s), one record per "
        f"(shard, node) per {flush} simulated s) in {time.monotonic() - began:.0f} s; measured: {events:,} "
        f"events over {sim_s} simulated s = {real_rate:,.0f} events/s in real time",
        file=sys.stderr,
    )

    secret_env = {SECRET_ENV: secrets.token_hex(24)}
    policy = args.policy or builtin_policy("evaluate")
    with (
        tempfile.TemporaryDirectory(prefix="bench-live-") as tmp,
        local_stack(Path(tmp), policy, free_ports(1)[0], secret_env=secret_env) as stack,
    ):
        workers = Workers(stack)
        try:
            for i, port in enumerate(free_ports(args.workers - 1) if args.workers > 1 else []):
                log = Path(tmp) / f"processor-{i + 2}.log"
                workers.extra.append((*start_processor(stack.bootstrap, policy, port, log, secret_env), log))
            return measure(args, workers, load, warmup, measured, events, real_rate, flush)
        finally:
            workers.stop_extra()


def measure(
    args: argparse.Namespace,
    workers: Workers,
    load: Load,
    warmup: Records,
    measured: Records,
    events: int,
    real_rate: float,
    flush: int,
) -> str:
    stack = workers.stack
    assert stack.broker.pid is not None
    broker = psutil.Process(stack.broker.pid)
    sender = Sender(stack.bootstrap, stack.names.telemetry)
    produce_all(sender, load, warmup)
    sender.flush(60)
    if not wait_warm(workers, len(warmup), timeout_s=180):
        raise RuntimeError(f"the processors did not take the warm-up:\n{stack.processor_log_tail()}")

    starts = high_watermarks(stack.bootstrap, stack.names.telemetry)
    sampler = Sampler(workers)
    before_each = workers.scrape_each()
    before = workers.scrape()
    t0, proc0, broker0, self0 = time.monotonic(), workers.cpu_s(), cpu_s(broker), cpu_s_self()
    sampler.start()
    if args.drain:
        produce_all(sender, load, measured)
    else:
        produce_paced(sender, load, measured, flush, args.speed)
    t_produced = time.monotonic()
    at_end = workers.scrape()
    proc_end, broker_end, self_end = workers.cpu_s(), cpu_s(broker), cpu_s_self()
    errors = sender.flush(60)  # undelivered
    errors += sender.errors
    del sender  # librdkafka's client goes before the broker does
    caught_up = wait_processed(workers, before, len(measured), args.catch_up_timeout)
    sampler.stop()
    after_each = workers.scrape_each()
    after = workers.scrape()
    workers.check_alive()
    # The limit is the fastest of a few reads: one alone swung 165x-577x real time between
    # sittings of this machine (CPU-bound at ~95% every time).
    topic = stack.names.telemetry
    raws = [raw_consume(stack.bootstrap, topic, starts, len(measured)) for _ in range(RAW_READS)]
    raw = min(raws, key=lambda r: r["wall_s"])
    noop = {name: faust_consume(stack.bootstrap, topic, name) for name in TRANSPORTS}

    produce_s = t_produced - t0
    samples = sampler.samples
    if args.drain:
        processed, wall, proc_cpu_s = drain_window(samples, before[PROCESSED], events, t_produced)
        window_note = f"saturated window {wall:.1f} s"
        wall_s = (caught_up or time.monotonic()) - t0
    else:
        processed, wall = at_end[PROCESSED] - before[PROCESSED], produce_s
        proc_cpu_s = sum(proc_end) - sum(proc0)
        window_note = f"produce window {wall:.1f} s"
        wall_s = produce_s
    rate = processed / wall

    max_lag = max((s.lag for s in samples), default=0)
    decisions = after.get(f"{DECISION_LATENCY}_count", 0.0) - before.get(f"{DECISION_LATENCY}_count", 0.0)
    record_lat = "-" if args.drain else latencies(before, after, RECORD_LATENCY)
    decision_lat = "-" if args.drain else latencies(before, after, DECISION_LATENCY)
    share = [
        a.get(PROCESSED, 0.0) - b.get(PROCESSED, 0.0) for a, b in zip(after_each, before_each, strict=True)
    ]
    per_worker = " + ".join(f"{100 * x / max(1.0, sum(share)):.0f}%" for x in share)
    cpu_each = " + ".join(f"{100 * (e - b) / produce_s:.0f}" for e, b in zip(proc_end, proc0, strict=True))
    broker_pct, bench_pct = 100 * (broker_end - broker0) / produce_s, 100 * (self_end - self0) / produce_s

    catch_up = f"{caught_up - t_produced:.1f} s" if caught_up is not None else "NOT within the timeout"
    print(
        f"# {window_note}; processed {processed:,.0f} events ({per_worker} by worker); caught up "
        f"{catch_up} after the last produce; CPU % over the produce window: processors {cpu_each}, "
        f"broker {broker_pct:.0f}, bench {bench_pct:.0f}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
        file=sys.stderr,
    )
    for prefix in ("trainguard_commands_total", "trainguard_interruptions_total", "trainguard_dead_letters"):
        for name, count in delta(before, after, prefix).items():
            print(f"# {name} +{count:g}", file=sys.stderr)
    raw_rate = events / raw["wall_s"]
    reads = ", ".join(f"{r['wall_s']:.2f}" for r in raws)
    print(
        f"# raw consume of the same {raw['records']:,.0f} records (aiokafka, one process, nothing decoded): "
        f"{raw['wall_s']:.2f} s, {raw_rate:,.0f} events/s = {raw_rate / real_rate:.0f}x real time, "
        f"CPU {100 * raw['cpu_s'] / raw['wall_s']:.0f}% (the fastest of {len(raws)} reads: {reads} s); "
        f"the processors reach {rate / raw_rate:.1%} of it",
        file=sys.stderr,
    )
    per_record = events / len(measured)
    faust_rate = {name: per_record * r["records"] / r["wall_s"] for name, r in noop.items()}
    for name, result in noop.items():
        print(
            f"# faust consume (a no-op agent, one process, {TRANSPORTS[name]}): "
            f"{result['records']:,.0f} records in "
            f"{result['wall_s']:.2f} s = {1e6 * result['wall_s'] / result['records']:.0f} us a record, "
            f"{faust_rate[name]:,.0f} events/s at {per_record:.1f} events a record = "
            f"{faust_rate[name] / real_rate:.0f}x real time, "
            f"CPU {100 * result['cpu_s'] / result['wall_s']:.0f}%; "
            f"the processors reach {rate / faust_rate[name]:.1%} of it",
            file=sys.stderr,
        )
    eager_rate = faust_rate["eager"]  # the processor's own transport: the table's baseline
    verdict = f"# targets: x real time {rate / real_rate:.1f}"
    if not args.drain:
        p99 = quantile(before, after, RECORD_LATENCY, 0.99)
        ok = p99 is not None and p99 < 1
        verdict += f"; record latency p50 / p99 {record_lat} s (p99 < 1 s: {'yes' if ok else 'no'})"
    print(verdict, file=sys.stderr)
    return (
        f"| {'drain' if args.drain else 'paced'} | {load.world_size} | {len(workers.all)} "
        f"| {'max' if args.drain else f'{args.speed:g}'} | {wall_s:.1f} | {events:,} | {len(measured):,} "
        f"| {events / produce_s:,.0f} | {rate:,.0f} | {rate / real_rate:.1f} "
        f"| {raw_rate:,.0f} ({raw_rate / real_rate:.0f}x) | {rate / raw_rate:.1%} "
        f"| {eager_rate:,.0f} ({eager_rate / real_rate:.0f}x) | {rate / eager_rate:.1%} "
        f"| {100 * proc_cpu_s / wall:.0f} | {max_lag:,} | {record_lat} | {decisions:,.0f} "
        f"| {decision_lat} | {errors} |"
    )


def wait_warm(workers: Workers, records: int, timeout_s: float) -> bool:
    """The processor has processed the warm-up and committed it (its consumer is settled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack = workers.stack
        done = workers.scrape().get(f"{RECORD_LATENCY}_count", 0.0) >= records
        if done and group_lag(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry]) == 0:
            return True
        workers.check_alive()
        time.sleep(0.5)
    return False


def drain_window(
    samples: list[Sample], base: float, events: int, produced_at: float
) -> tuple[float, float, float]:
    """Events processed, seconds and processor CPU seconds over the saturated window: from
    the first sample after the producer finished to the last one before 95% of the events
    were processed (from one second after the start when that leaves under 3 s)."""
    busy = [s for s in samples if s.processed < base + 0.95 * events]
    window = [s for s in busy if s.t >= produced_at]
    if len(window) < 2 or window[-1].t - window[0].t < 3:
        window = [s for s in busy if s.t >= samples[0].t + 1] if samples else []
    if len(window) < 2:
        raise RuntimeError("too few samples while the processor was saturated: raise --sim-seconds")
    first, last = window[0], window[-1]
    return last.processed - first.processed, last.t - first.t, last.processor_cpu_s - first.processor_cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", type=Path, default=SCENARIO, help="scenario YAML")
    parser.add_argument("--sim-seconds", type=int, default=240, help="simulated seconds measured")
    parser.add_argument("--warmup", type=int, default=10, help="simulated seconds before, not measured")
    parser.add_argument("--speed", type=float, default=5.0, help="x real time (paced mode)")
    parser.add_argument("--drain", action="store_true", help="produce as fast as possible instead")
    parser.add_argument(
        "--policy", type=Path, default=None, help="default: processors/policies/evaluate.yaml"
    )
    parser.add_argument("--workers", type=int, default=1, help="processor workers (one consumer group)")
    parser.add_argument(
        "--shard-ranks",
        type=int,
        default=DEFAULT_SHARD_RANKS,
        help="a run over this many ranks is cut into shards of this size (schemas/sharding.py)",
    )
    parser.add_argument(
        "--flush-sim-s",
        type=int,
        default=0,
        help="simulated seconds per record flush; default: --speed (one flush per wall second, a "
        "shipper's default), 1 with --drain",
    )
    parser.add_argument(
        "--stats-every-rank", action="store_true", help="every rank reports finite step stats too"
    )
    parser.add_argument("--catch-up-timeout", type=float, default=300.0, help="s after the last produce")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the broker and processor
    row = bench(args)
    print(HEADER)
    print(row)
    print(f"\n`{shlex.join(['python', 'bench/bench_live.py', *sys.argv[1:]])}`")


if __name__ == "__main__":
    main()
