"""The raw-consume baseline of bench_live.py (issue 20): how fast ONE process of this
machine can merely fetch the same telemetry records, with the client the processor uses
(aiokafka, under faust) and the processor's fetch size. Nothing is decoded or folded, so
this is the limit a processor worker could reach here, and bench_live reports its own
rate as a ratio to it.

    .venv/bin/python bench/raw_consume.py BOOTSTRAP TOPIC PARTITION:START:END ...

Reads each partition from START up to END (exclusive), then prints one JSON line:
records, bytes, wall_s (first fetch to last record), cpu_s (this process).
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as Partition

from trainguard.kafka.topics import partition_count

#: The processor's consumer_max_fetch_size (processors/app.py).
FETCH_BYTES = 8 * 1024 * 1024


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def consume(bootstrap: str, topic: str, ranges: dict[int, tuple[int, int]]) -> dict[str, float]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        max_partition_fetch_bytes=FETCH_BYTES,
        fetch_max_bytes=max(FETCH_BYTES, 50 * 1024 * 1024),
    )
    await consumer.start()
    try:
        partitions = {TopicPartition(topic, p): span for p, span in ranges.items() if span[1] > span[0]}
        consumer.assign(list(partitions))
        for tp, (start, _) in partitions.items():
            consumer.seek(tp, start)
        records = size = 0
        left = set(partitions)
        t0, cpu0 = time.perf_counter(), cpu_s()
        while left:
            batches = await consumer.getmany(*left, timeout_ms=1000, max_records=10_000)
            for tp, messages in batches.items():
                end = partitions[tp][1]
                for message in messages:
                    if message.offset < end:
                        records += 1
                        size += len(message.value or b"")
                if messages and messages[-1].offset >= end - 1:
                    left.discard(tp)
        wall_s = time.perf_counter() - t0
        return {"records": records, "bytes": size, "wall_s": wall_s, "cpu_s": cpu_s() - cpu0}
    finally:
        await consumer.stop()


def high_watermarks(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition's next offset."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-consume-{uuid.uuid4().hex[:8]}"})
    try:
        return {
            p: consumer.get_watermark_offsets(Partition(topic, p), timeout=10)[1]
            for p in range(partition_count(bootstrap, topic))
        }
    finally:
        consumer.close()


def raw_consume(bootstrap: str, topic: str, starts: dict[int, int], records: int) -> dict[str, float]:
    """The raw-consume baseline (bench/raw_consume.py) over the records produced since
    `starts`, in its own process, with the processors idle (caught up)."""
    ends = high_watermarks(bootstrap, topic)
    spans = [f"{p}:{starts.get(p, 0)}:{end}" for p, end in ends.items()]
    done = subprocess.run(
        [sys.executable, __file__, bootstrap, topic, *spans], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"the raw consume failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    if result["records"] < records:  # ticks and forwards are extra records; fewer is a bug
        raise RuntimeError(f"the raw consume read {result['records']:,.0f} of {records:,} records")
    return result


def faust_consume(bootstrap: str, topic: str, transport: str = "stock") -> dict[str, float]:
    """The faust-consume baseline (bench/faust_consume.py): every record of the topic
    through a faust agent that does nothing, in its own process, on faust's own transport
    (`stock`) or the processor's (`eager`)."""
    records = sum(high_watermarks(bootstrap, topic).values())
    script = Path(__file__).with_name("faust_consume.py")
    with tempfile.TemporaryDirectory(prefix="faust-consume-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(script), bootstrap, topic, str(records), str(out), transport]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if not out.exists():
            raise RuntimeError(f"the faust consume failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result: dict[str, float] = json.loads(out.read_text())
    return result


def main(argv: list[str]) -> int:
    bootstrap, topic, *spans = argv
    ranges = {}
    for span in spans:
        partition, start, end = map(int, span.split(":"))
        ranges[partition] = (start, end)
    print(json.dumps(asyncio.run(consume(bootstrap, topic, ranges))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
