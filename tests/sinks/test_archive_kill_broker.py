"""The archive writer SIGKILLed mid-batch and restarted (issue 7 scenario 4): the real
broker, the real `trainguard archive` process, a real archive on disk. A batch is visible
only once its mark is written, and a restarted writer rolls back what a killed one left
unmarked and resumes from the mark's offsets, so every event is STORED exactly once (the
files, not only the deduplicating views). Readers (`trainguard timeline`, a snapshot in
this process) work all along, while the writer writes (issue 19 item 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from trainguard.kafka.lag import group_lag, wait_caught_up
from trainguard.kafka.topics import TopicNames
from trainguard.schemas import encode, encode_batch
from trainguard.sinks.archive import archive_group, archived_topics
from trainguard.sinks.archive_store import open_snapshot, summary

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
    db, log = tmp_path / "archive", tmp_path / "archive.log"

    writer = start_writer(bootstrap, topics, db, log)
    deadline = time.monotonic() + 60
    while (lag := group_lag(bootstrap, group, names)) == total:  # wait for its first commit
        assert time.monotonic() < deadline and writer.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    seen_while_writing = summary(db)["raw_event"]  # another process reads while it writes
    report = subprocess.run(
        [sys.executable, "-m", "trainguard", "timeline", "--db", str(db)], capture_output=True, timeout=60
    )
    writer.send_signal(signal.SIGKILL)  # mid-way: some batches committed, the rest in flight
    writer.wait(10)
    assert 0 < lag < total, (lag, total)
    assert report.returncode == 0, report.stderr.decode()[-2000:]
    assert b"no interruptions recorded" in report.stdout
    assert 0 < seen_while_writing < len(events)

    writer = start_writer(bootstrap, topics, db, log)
    try:
        assert wait_caught_up(bootstrap, group, names, 90), log.read_text()[-2000:]
    finally:
        writer.terminate()
        writer.wait(30)
    con = open_snapshot(db)
    try:  # the files themselves, before the views' deduplication
        stored = con.execute("SELECT count(*), count(DISTINCT event_id) FROM _lake_raw_event").fetchall()[0]
        ids = {row[0] for row in con.execute("SELECT event_id FROM raw_event").fetchall()}
    finally:
        con.close()
    assert stored == (len(events), len(events))  # no row twice...
    assert ids == {e.event_id for e in events}  # ...and none missing
