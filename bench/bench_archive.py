"""Archive throughput: Kafka -> archive events/s, the archive side alone, its size, and a
reader's query on it; against the live rate of a 16,384-rank run.

The numbers, so that a slow result can be placed:
  decode   decode_batch on the telemetry values (pydantic validation), no Kafka, no archive;
  write    Archive.write of decoded events (payload JSON, Arrow, Delta commits per table and
           the batch mark) into a fresh root, in batches as large as the writer's;
  kafka    ArchiveWriter.run_until_caught_up over a telemetry topic holding the events in
           per-node batches (consume, decode, write, commit), into another fresh root;
  bytes    the first root's size per event after compaction, and per day at the live rate
           of a 16,384-rank run (LIVE_16K_EVENTS_S);
  query    seconds for a reader's `SELECT kind, count(*) FROM raw_event GROUP BY kind` on it
           (a snapshot; the views deduplicate by event_id);
  batch    milliseconds per small batch (8 events) once 200 are stored: the commit cost a
           writer pays on a quiet topic, where each poll is a batch (`--small-batches 0`: skip).

    python bench/bench_archive.py --bootstrap 127.0.0.1:9092 --events 1000000

Without --bootstrap a local broker is started in a temporary directory (and stopped).
Prints a markdown table row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
from confluent_kafka import Producer

from trainguard.kafka.topics import delete_topics, ensure_topics, topic_names
from trainguard.schemas import decode_batch, encode_batch
from trainguard.sinks.archive import Archive, ArchiveWriter, summary
from trainguard.sinks.archive_store import open_snapshot

RUN = "bench-run"
T0 = 1_700_000_000.0
#: Events/s a 16,384-rank run with 2 s steps emits (step timings, heartbeats, GPU health and
#: the derived events): bench/bench_live.py's stream, 41,569 events/s drained at 3.9x real
#: time (docs/benchmarks.md, issue 20's measurement).
LIVE_16K_EVENTS_S = 10_660.0


@dataclasses.dataclass(frozen=True)
class Shape:
    events: int
    ranks: int
    ranks_per_node: int
    steps_per_batch: int

    @property
    def events_per_batch(self) -> int:
        return self.ranks_per_node * self.steps_per_batch


def batches(shape: Shape) -> Iterator[bytes]:
    """Telemetry values: one node's step timings over `steps_per_batch` steps, as a shipper sends them."""
    nodes = shape.ranks // shape.ranks_per_node
    emitted, seq, first_step = 0, 0, 0
    while emitted < shape.events:
        for node in range(nodes):
            records = []
            for step in range(first_step, first_step + shape.steps_per_batch):
                for rank in range(node * shape.ranks_per_node, (node + 1) * shape.ranks_per_node):
                    records.append(
                        orjson.dumps(
                            {
                                "schema": "step_timing/1",
                                "event_id": f"{RUN}:{rank}:{step}",
                                "run_id": RUN,
                                "attempt": 0,
                                "rank": rank,
                                "node": f"n{node:04d}",
                                "step": step,
                                "ts": T0 + step * 2.0 + rank * 1e-4,
                                "compute_s": 1.5 + rank * 1e-5,
                                "total_s": 2.0,
                            }
                        )
                    )
            header = {
                "run_id": RUN,
                "node": f"n{node:04d}",
                "world_size": shape.ranks,
                "producer_id": f"p{node}",
            }
            yield encode_batch({**header, "seq": seq}, records)
            emitted += len(records)
            if emitted >= shape.events:
                return
        seq += 1
        first_step += shape.steps_per_batch


def bench_decode_and_insert(shape: Shape, db: Path, records_per_write: int) -> tuple[float, float, int]:
    """(decode events/s, insert events/s, events) with the decode and the write timed separately."""
    decode_s = insert_s = 0.0
    total = 0
    with Archive(db) as archive:
        chunk: list[bytes] = []
        for value in [*batches(shape), None]:
            if value is not None:
                chunk.append(value)
            if chunk and (value is None or len(chunk) == records_per_write):
                t0 = time.perf_counter()
                events = [e for raw in chunk for e in decode_batch(raw).events]
                t1 = time.perf_counter()
                archive.write(events)
                insert_s += time.perf_counter() - t1
                decode_s += t1 - t0
                total += len(events)
                chunk = []
    assert summary(db)["raw_event"] == total
    return total / decode_s, total / insert_s, total


def compacted_bytes(db: Path) -> int:
    """The root's bytes once its small files are merged and the replaced ones vacuumed."""
    with Archive(db) as archive:
        archive.maintain({}, vacuum_hours=0)
    return sum(f.stat().st_size for f in db.rglob("*") if f.is_file())


def small_batch_ms(db: Path, count: int) -> float:
    """Mean ms of Archive.write for the last 100 of `count` batches of 8 events (a node's
    record of one step each, as on a quiet topic where every poll is a batch)."""
    times = []
    with Archive(db) as archive:
        for raw in batches(Shape(8 * count, 8, 8, 1)):
            events = decode_batch(raw).events
            t0 = time.perf_counter()
            archive.write(events)
            times.append(time.perf_counter() - t0)
    last = times[-100:]
    return 1000 * sum(last) / len(last)


def query_seconds(db: Path) -> float:
    t0 = time.perf_counter()
    with contextlib.closing(open_snapshot(db)) as con:
        con.execute("SELECT kind, count(*) FROM raw_event GROUP BY kind").fetchall()
    return time.perf_counter() - t0


def produce(bootstrap: str, topic: str, shape: Shape) -> tuple[int, float]:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "compression.type": "lz4",
            "enable.idempotence": True,
            "queue.buffering.max.kbytes": 256 * 1024,
        }  # fmt: skip
    )
    count = 0
    t0 = time.perf_counter()
    for value in batches(shape):
        while True:
            try:
                producer.produce(topic, value, key=RUN.encode())
                break
            except BufferError:
                producer.poll(0.05)
        count += 1
        producer.poll(0)
    if producer.flush(120):
        raise RuntimeError("records left unsent after 120 s")
    return count, time.perf_counter() - t0


def bench_kafka(bootstrap: str, shape: Shape, db: Path) -> tuple[float, float, int]:
    """(events/s, records/s, records) for the writer draining a topic that already holds the events."""
    prefix = f"bench{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, prefix=prefix)
    topics = topic_names(prefix)
    try:
        records, produce_s = produce(bootstrap, topics.telemetry, shape)
        print(f"produced {records} records ({shape.events} events) in {produce_s:.1f} s")
        with ArchiveWriter(bootstrap, topics, db, group_id=f"{prefix}archive") as writer:
            t0 = time.perf_counter()
            stats = writer.run_until_caught_up(timeout_s=1800)
            elapsed = time.perf_counter() - t0
        assert stats.rows["raw_event"] == shape.events, stats
        print(f"writer: {stats.consumed} records in {stats.batches} transactions, {elapsed:.1f} s")
        return shape.events / elapsed, stats.consumed / elapsed, records
    finally:
        delete_topics(bootstrap, topics.all())


@contextlib.contextmanager
def broker(bootstrap: str | None, workdir: Path) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    from harness.devtools.broker_jars import ensure_jars
    from harness.devtools.local_broker import LocalBroker

    ensure_jars()
    local = LocalBroker(workdir / "kafka")
    try:
        yield local.start()
    finally:
        local.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: start a local broker)")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument(
        "--steps-per-batch", type=int, default=8, help="steps per node batch (flush interval)"
    )
    parser.add_argument("--skip-kafka", action="store_true")
    parser.add_argument("--small-batches", type=int, default=300, help="small batches to time (0: skip)")
    args = parser.parse_args()
    shape = Shape(args.events, args.ranks, args.ranks_per_node, args.steps_per_batch)
    with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp:
        work = Path(tmp)
        # The writer consumes up to 5000 records per transaction; write the same amount here.
        decode_rate, insert_rate, events = bench_decode_and_insert(shape, work / "insert", 5000)
        query_s = query_seconds(work / "insert")
        per_event = compacted_bytes(work / "insert") / events
        batch_ms = small_batch_ms(work / "small", args.small_batches) if args.small_batches else float("nan")
        kafka_rate = records_rate = float("nan")
        if not args.skip_kafka:
            with broker(args.bootstrap, work) as bootstrap:
                kafka_rate, records_rate, _ = bench_kafka(bootstrap, shape, work / "kafka")
    per_day_gib = per_event * LIVE_16K_EVENTS_S * 86_400 / 2**30
    columns = ["events", "events/record", "decode ev/s", "archive write ev/s", "Kafka→archive ev/s"]
    columns += ["records/s", "× 16k-rank live rate", "bytes/event", "GiB/day at 16k ranks", "query s"]
    columns += ["ms per 8-event batch"]
    values = [f"{events:,}", str(shape.events_per_batch), f"{decode_rate:,.0f}", f"{insert_rate:,.0f}"]
    values += [f"{kafka_rate:,.0f}", f"{records_rate:,.0f}", f"{kafka_rate / LIVE_16K_EVENTS_S:.2f}"]
    values += [f"{per_event:.0f}", f"{per_day_gib:,.0f}", f"{query_s:.2f}", f"{batch_ms:.0f}"]
    print()
    print("| " + " | ".join(columns) + " |")
    print("|" + " ---: |" * len(columns))
    print("| " + " | ".join(values) + " |")


if __name__ == "__main__":
    main()
