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
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Producer

from harness.streams import Job
from trainguard.kafka.lag import group_lag, wait_caught_up
from trainguard.kafka.topics import TopicNames
from trainguard.schemas import encode, encode_batch
from trainguard.sinks.archive import archive_group, archived_topics
from trainguard.sinks.archive_store import open_snapshot, summary

from ..pipeline import free_port


def _physical_rows(db: Path) -> int:
    con = open_snapshot(db)
    try:
        return int(con.execute("SELECT count(*) FROM _lake_raw_event").fetchall()[0][0])
    finally:
        con.close()


def scrape(port: int) -> dict[str, float]:
    """The writer's /metrics as {'name{labels}': value} (labels as Prometheus sorts them)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            break
        except OSError:
            assert time.monotonic() < deadline, "the writer's metrics did not come up"
            time.sleep(0.2)
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


pytestmark = pytest.mark.broker


def start_writer(
    bootstrap: str, topics: TopicNames, db: Path, log: Path, metrics_port: int = 0
) -> subprocess.Popen[bytes]:
    prefix = topics.telemetry.removesuffix("trainguard.telemetry")
    command = [sys.executable, "-m", "trainguard", "archive", "--db", str(db), "--bootstrap", bootstrap,
               "--topic-prefix", prefix, "--metrics-port", str(metrics_port)]  # fmt: skip
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
    writer.send_signal(signal.SIGKILL)  # mid-way: some batches committed, the rest in flight
    writer.wait(10)
    assert 0 < lag < total, (lag, total)
    stored_before = _physical_rows(db)  # as of the killed writer's last mark

    port = free_port()
    writer = start_writer(bootstrap, topics, db, log, port)
    try:
        # Other processes read while the restarted writer holds the archive and writes.
        seen_while_writing = summary(db)["raw_event"]
        report = subprocess.run(
            [sys.executable, "-m", "trainguard", "timeline", "--db", str(db)], capture_output=True, timeout=60
        )
        assert report.returncode == 0, report.stderr.decode()[-2000:]
        assert b"no interruptions recorded" in report.stdout
        assert 0 < stored_before <= seen_while_writing <= len(events)
        assert writer.poll() is None, log.read_text()[-2000:]

        assert wait_caught_up(bootstrap, group, names, 90), log.read_text()[-2000:]
        # Its metrics (issue 19): what it stored, its last commit, its lag, its process.
        metrics = scrape(port)
        assert metrics['trainguard_archive_rows_total{table="raw_event"}'] == len(events) - stored_before
        assert metrics['trainguard_archive_rows_total{table="command"}'] == 0  # there from the start
        assert metrics['trainguard_archive_errors_total{stage="write"}'] == 0
        assert time.time() - metrics["trainguard_archive_last_commit_timestamp_seconds"] < 120
        assert metrics[f'trainguard_consumer_broker_up{{group="{group}",role="archive"}}'] == 1
        lag_series = [k for k in metrics if k.startswith("trainguard_consumer_lag_records{")]
        assert any(f'topic="{topics.telemetry}"' in k for k in lag_series), lag_series
        assert metrics["process_resident_memory_bytes"] > 0
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
