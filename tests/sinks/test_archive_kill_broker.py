"""The archive writer SIGKILLed mid-batch and restarted (issue 7 scenario 4): the real
broker, the real `trainguard archive` process, a real DuckDB file. Offsets are committed
only after the rows are durable, and inserts are idempotent, so after the restart every
event is stored exactly once: no duplicate row, no missing row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from confluent_kafka import Producer

from trainguard.kafka.lag import group_lag, wait_caught_up
from trainguard.kafka.topics import TopicNames
from trainguard.schemas import encode, encode_batch
from trainguard.sinks.archive import archive_group, archived_topics

from ..processors.streams import Job

pytestmark = pytest.mark.broker


def start_writer(bootstrap: str, topics: TopicNames, db: Path, log: Path) -> subprocess.Popen[bytes]:
    prefix = topics.telemetry.removesuffix("trainguard.telemetry")
    command = [sys.executable, "-m", "trainguard", "archive", "--db", str(db), "--bootstrap", bootstrap,
               "--topic-prefix", prefix]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))


def test_a_writer_killed_mid_batch_and_restarted_stores_every_event_once(
    bootstrap: str, topics: TopicNames, tmp_path: Path
) -> None:
    job = Job(run_id="archive-kill", world_size=64, ranks_per_node=8).start().steps(400)
    events = job.events
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    header = dict(run_id=job.run_id, node="node-000", world_size=64, producer_id="archive-kill", seq=0)
    for i in range(0, len(events), 2):  # small records: several of the writer's 5,000-record polls
        batch = encode_batch({**header, "seq": i}, [encode(e) for e in events[i : i + 2]])
        producer.produce(topics.telemetry, key=job.run_id.encode(), value=batch)
    assert producer.flush(30) == 0
    group, names = archive_group(topics), archived_topics(topics)
    total = group_lag(bootstrap, group, names)
    db, log = tmp_path / "archive.duckdb", tmp_path / "archive.log"

    writer = start_writer(bootstrap, topics, db, log)
    deadline = time.monotonic() + 60
    while (lag := group_lag(bootstrap, group, names)) == total:  # wait for its first commit
        assert time.monotonic() < deadline and writer.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)  # mid-way: some batches committed, the rest in flight
    writer.wait(10)
    assert 0 < lag < total, (lag, total)

    writer = start_writer(bootstrap, topics, db, log)
    try:
        assert wait_caught_up(bootstrap, group, names, 90), log.read_text()[-2000:]
    finally:
        writer.terminate()
        writer.wait(30)
    with duckdb.connect(str(db), read_only=True) as con:
        stored = con.execute("SELECT count(*), count(DISTINCT event_id) FROM raw_event").fetchall()[0]
        ids = {row[0] for row in con.execute("SELECT event_id FROM raw_event").fetchall()}
    assert stored == (len(events), len(events))  # no row twice...
    assert ids == {e.event_id for e in events}  # ...and none missing
