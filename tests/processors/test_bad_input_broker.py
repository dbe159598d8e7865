"""Bad input at volume through the real broker, processor and archive writer (issue 7
scenario 7): a 16-rank job with a crash and a restart, its telemetry mixed with about
200 bad records (malformed bytes, bad events inside good batches: retyped fields,
non-finite timestamps, unknown and old schema versions, unknown kinds, ranks out of
range, other runs' events, oversized fields), redelivered batches at new offsets, a
batch with a null key, a batch that claims another world size, and late events of the
attempt before the restart. Every bad record lands in the dead-letter topic with its
reason and original bytes; every good event is processed once; the processor never
crashes; and the oracle (harness/scoring/oracle.py) holds."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, Message, Producer

from harness.devtools.stack import builtin_policy, scrape
from harness.scoring.oracle import check
from harness.streams import Job
from trainguard.kafka.lag import wait_caught_up
from trainguard.processors.core.policy import load_policy
from trainguard.replay.log import read_recording
from trainguard.schemas import Interruption, StepTiming, encode, encode_batch
from trainguard.sinks.archive import archive_group, archived_topics

from ..pipeline import Processor, running_processor
from ..readers import TopicReader

pytestmark = pytest.mark.broker

SECRET = "bad-input-test-secret-0123456789"
POLICY = builtin_policy("demo")
WORLD = 16


@pytest.fixture
def pipeline(bootstrap: str, tmp_path: Path) -> Iterator[Processor]:
    with running_processor(bootstrap, POLICY, SECRET, tmp_path / "processor.log") as processor:
        yield processor


@contextmanager
def archiving(processor: Processor, db: Path) -> Iterator[None]:
    """`trainguard archive` on the pipeline's topics while the block runs; stopped after
    it (DuckDB lets no other process open the file while the writer holds it). No /metrics:
    its default port may be another test's writer's, on another worker."""
    command = [sys.executable, "-m", "trainguard", "archive", "--db", str(db),
               "--bootstrap", processor.bootstrap, "--topic-prefix", processor.prefix,
               "--metrics-port", "0"]  # fmt: skip
    with (db.parent / "archive.log").open("wb") as log:
        archiver = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        yield
    finally:
        archiver.terminate()
        archiver.wait(30)


def mangle(rng: random.Random, event: dict[str, Any], run_id: str) -> tuple[dict[str, Any], str]:
    """One bad event made from a good one, and the rejection reason it must get."""
    bad = {**event, "event_id": f"bad-{uuid.uuid4().hex[:12]}"}
    how = rng.choice(["retype", "ts", "version_new", "version_old", "kind", "rank", "run", "oversized"])
    if how == "retype":
        bad["step"] = "one hundred"
        return bad, "invalid_fields"
    if how == "ts":
        bad["ts"] = rng.choice(["Infinity", "NaN"])
        return bad, "non_finite"
    if how == "version_new":
        bad["schema"] = bad["schema"].split("/")[0] + "/9"
        return bad, "unknown_version"
    if how == "version_old":
        bad["schema"] = bad["schema"].split("/")[0] + "/0"
        return bad, "unknown_version"
    if how == "kind":
        bad["schema"] = "fan_speed/1"
        return bad, "unknown_kind"
    if how == "rank":
        bad["rank"] = rng.randrange(WORLD, 100_000)
        return bad, "rank_out_of_range"
    if how == "run":
        bad["run_id"] = f"{run_id}-other"
        return bad, "run_mismatch"
    bad["node"] = "n" * 5000
    return bad, "invalid_fields"


def test_bad_records_at_volume_are_dead_lettered_and_nothing_good_is_lost(
    pipeline: Processor, tmp_path: Path
) -> None:
    processor, db = pipeline, tmp_path / "archive"
    with archiving(processor, db):
        t0 = time.monotonic()
        acknowledged, expected_dead, garbage, stale_sent, good, run_id = produce_mixed(processor)
        produced_s = time.monotonic() - t0
        check_dead_letters(processor, expected_dead, garbage)
        recording = read_recording(processor.bootstrap, processor.names, run_id)
        check_processed(processor, len(good) + stale_sent)
        interruptions = [d for d in recording.derived if isinstance(d, Interruption)]
        assert [(i.cause.value, i.rank) for i in interruptions] == [("crash", 5)]  # from good events only
        # The writer commits an offset only once its rows are durable: no lag, all archived.
        assert wait_caught_up(
            processor.bootstrap, archive_group(processor.names), archived_topics(processor.names), 60
        ), (db.parent / "archive.log").read_text()[-3000:]
    # The oracle: nothing lost, one decision per id, replay = live, archive = log, rank order.
    report = check(recording, load_policy(str(POLICY)), acknowledged=acknowledged, archive=db)
    assert report.ok, str(report)
    bad = len(expected_dead) + len(garbage)
    print(f"\n{len(good)} good events and {bad} bad records produced in {produced_s:.2f} s\n{report}")


def produce_mixed(
    processor: Processor,
) -> tuple[set[str], dict[str, str], list[bytes], int, list[dict[str, Any]], str]:
    """The job's telemetry mixed with bad input; what was acknowledged, which bad events
    must be dead-lettered with which reason, the whole garbage records, how many late
    events of the old attempt were sent, the good events, the run id."""
    rng = random.Random(7)
    run_id = f"bad-{uuid.uuid4().hex[:8]}"
    job = Job(run_id=run_id, world_size=WORLD, ranks_per_node=4).start().steps(40)
    job.exit(5, signal=9)
    before_restart = len(job.events)
    job.restart(resumed_from_step=30).steps(30)
    good = [orjson.loads(encode(e)) for e in job.events]
    # A rank that missed the restart goes on reporting attempt 0's steps: valid events (in
    # order for that rank), ignored by the core as stale.
    template = next(orjson.loads(encode(e)) for e in job.events[:before_restart] if isinstance(e, StepTiming))
    stale = [{**template, "event_id": f"stale-{n}", "step": 41 + n, "ts": template["ts"] + 100 + n}
             for n in range(40)][::-1]  # fmt: skip
    stale_sent = 0

    acknowledged: set[str] = set()
    expected_dead: dict[str, str] = {}  # event_id (or a record's marker) -> reason
    garbage: list[bytes] = []
    producer = Producer({"bootstrap.servers": processor.bootstrap, "enable.idempotence": True})

    def delivered(err: KafkaError | None, msg: Message, ids: tuple[str, ...]) -> None:
        if err is None:
            acknowledged.update(ids)

    def send(
        items: list[dict[str, Any]], world: int = WORLD, null_key: bool = False, good_ids: tuple = ()
    ) -> None:
        header = dict(run_id=run_id, node="node-000", world_size=world, producer_id="bad-input", seq=0)
        value = encode_batch(header, [orjson.dumps(i) for i in items])
        producer.produce(processor.names.telemetry, key=None if null_key else run_id.encode(), value=value,
                         on_delivery=lambda err, msg, ids=good_ids: delivered(err, msg, ids))  # fmt: skip

    restart_at = next(i for i, e in enumerate(good) if e["attempt"] == 1)
    for i in range(0, len(good), 24):
        chunk = good[i : i + 24]
        batch = list(chunk)
        for _ in range(rng.randrange(0, 8)):  # bad events inside good batches
            bad, reason = mangle(rng, rng.choice(chunk), run_id)
            batch.insert(rng.randrange(len(batch) + 1), bad)
            expected_dead[bad["event_id"]] = reason
        send(batch, good_ids=tuple(e["event_id"] for e in chunk))
        if rng.random() < 0.3:  # a whole record of garbage between batches
            junk = rng.choice(
                [b"\x00\xff" + rng.randbytes(40), b"[1,2,3]", b'{"schema": 7}', b'{"schema": "batch/1"}']
            )
            garbage.append(junk)
            producer.produce(processor.names.telemetry, key=run_id.encode(), value=junk)
        if rng.random() < 0.2:  # the same batch again, at a new offset
            send(chunk)
        if i >= restart_at and stale:  # late events of the previous attempt
            send([stale.pop()])
            stale_sent += 1
    # A redelivered batch with a null key (another partition), and one claiming 1,024 ranks
    # whose out-of-range ranks are still judged against the run's registered 16.
    send(good[:24], null_key=True)
    wide = {**good[-1], "event_id": "wide-world", "rank": 512}
    send([wide], world=1024)
    expected_dead["wide-world"] = "rank_out_of_range"
    assert producer.flush(30) == 0
    return acknowledged, expected_dead, garbage, stale_sent, good, run_id


def check_dead_letters(processor: Processor, expected_dead: dict[str, str], garbage: list[bytes]) -> None:
    """Every bad event with its reason, every garbage record byte for byte."""
    reader = TopicReader(processor.bootstrap, processor.names.deadletter)
    dead = reader.until(lambda s: len(s) >= len(expected_dead) + len(garbage), 120)
    reader.settle(2.0)
    reader.close()
    by_id: dict[str, str] = {}
    whole: list[bytes] = []
    for d in dead:
        try:
            obj = orjson.loads(d.value)
        except orjson.JSONDecodeError:
            obj = None
        event_id = obj.get("event_id") if isinstance(obj, dict) else None
        if event_id in expected_dead:
            by_id[event_id] = d.headers["reason"].decode()
        else:
            whole.append(d.value)
    assert by_id == expected_dead
    assert sorted(whole) == sorted(garbage)


def check_processed(processor: Processor, expected: int) -> None:
    """Every good event folded once (redeliveries are counted as duplicates instead)."""
    metrics: dict[str, float] = {}
    for _ in range(60):
        metrics = scrape(processor.metrics_url)
        if metrics.get("trainguard_events_processed_total", 0) >= expected:
            break
        time.sleep(0.5)
    time.sleep(1.0)
    metrics = scrape(processor.metrics_url)
    assert metrics["trainguard_events_processed_total"] == expected
    assert metrics["trainguard_duplicate_events_total"] > 0
