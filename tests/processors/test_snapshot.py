"""Snapshots of a partition's core state (processors/snapshot.py): a core restored from a
snapshot decides exactly what the uninterrupted core decides, and a snapshot that is
not a processor's (bad signature, tampered, other version) is refused before unpickling."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import zlib

import pytest

from harness.straggler_streams import HealthFault, Slow, SyncJob
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.core.state import CoreState
from trainguard.processors.driver import CoreDriver
from trainguard.processors.snapshot import (
    Snapshot,
    SnapshotError,
    decode_snapshot,
    encode_snapshot,
    snapshot_key,
)
from trainguard.schemas import encode

SECRET = b"snapshot-test-secret-0123456789"
KEY = snapshot_key(SECRET)


def job_records() -> list[bytes]:
    """A run whose later decisions depend on early state: a slow streak across the
    snapshot point, then a crash and a restart."""
    job = SyncJob(run_id="run-snap", world_size=16, ranks_per_node=4, nodes_per_rack=2,
                  slow=[Slow(5, 1.8, from_step=10)])  # fmt: skip
    job.start().steps(150)
    job.exit(2, signal=9)
    job.restart(resumed_from_step=100).steps(20)
    return [encode(e) for e in job.events]


def decisions(driver: CoreDriver, records: list[bytes]) -> list[str]:
    out = []
    for value in records:
        result = driver.handle(value)
        out += [f"{d.KIND}:{d.event_id}" for d in result.derived]
        out += [f"{c.KIND}:{c.command_id}:{c.signature}" for c in result.commands]
    return out


def test_a_core_restored_from_a_snapshot_decides_what_the_uninterrupted_core_decides() -> None:
    records = job_records()
    cut = 16 * 60  # mid-streak: rank 5 is flagged after 100 slow steps, around step 110
    whole = CoreDriver(CorePolicy(), SECRET)
    expected = decisions(whole, records)
    assert any(d.startswith("straggler_flagged") for d in expected)
    assert any(d.startswith("interruption") for d in expected)

    first = CoreDriver(CorePolicy(), SECRET)
    before = decisions(first, records[:cut])
    value = encode_snapshot(Snapshot("telemetry", 0, cut, 1.0, first.state.runs), KEY)
    restored = decode_snapshot(value, KEY)
    assert (restored.partition, restored.offset) == (0, cut)
    second = CoreDriver(CorePolicy(), SECRET, state=CoreState(runs=restored.runs))
    assert before + decisions(second, records[cut:]) == expected


def test_a_snapshot_keeps_the_dedupe_window_and_the_gpu_readings_exactly() -> None:
    """The two parts a snapshot writes in its own form (issue 20: JSON, not pickled item by
    item) come back equal: the dedupe window in its order (the oldest id is evicted first),
    each GPU's recent readings with their window's length, and the run's other state."""
    job = SyncJob(run_id="run-snap", world_size=16, ranks_per_node=4, nodes_per_rack=2).start()
    for _ in range(6):
        job.steps(5).health([HealthFault("thermal", rank=3), HealthFault("link", node=job.node(9))])
    driver = CoreDriver(CorePolicy(), SECRET)
    decisions(driver, [encode(e) for e in job.events])
    run = driver.state.runs["run-snap"]
    assert run.health.readings and len(run.seen) > 100
    restored = decode_snapshot(encode_snapshot(Snapshot("telemetry", 0, 1, 1.0, driver.state.runs), KEY), KEY)
    again = restored.runs["run-snap"]
    assert list(again.seen) == list(run.seen) and type(again.seen) is type(run.seen)
    assert again.health.readings == run.health.readings
    for node, gpus in run.health.readings.items():
        for rank, recent in gpus.items():
            assert again.health.readings[node][rank].maxlen == recent.maxlen
            assert all(type(r) is type(recent[0]) for r in again.health.readings[node][rank])
    assert pickle.dumps(again.ranks) == pickle.dumps(run.ranks)
    assert pickle.dumps(again.straggler) == pickle.dumps(run.straggler)


def snapshot_bytes() -> bytes:
    driver = CoreDriver(CorePolicy(), SECRET)
    decisions(driver, job_records()[:200])
    return encode_snapshot(Snapshot("telemetry", 3, 200, 1.0, driver.state.runs), KEY)


def test_another_secret_a_flipped_byte_and_garbage_are_refused() -> None:
    value = snapshot_bytes()
    with pytest.raises(SnapshotError, match="bad signature"):
        decode_snapshot(value, snapshot_key(b"another-secret-0123456789abcdef"))
    tampered = bytearray(value)
    tampered[-10] ^= 0x01
    with pytest.raises(SnapshotError, match="bad signature"):
        decode_snapshot(bytes(tampered), KEY)
    with pytest.raises(SnapshotError, match="not a trainguard snapshot"):
        decode_snapshot(b"\x80\x04garbage", KEY)


def test_a_snapshot_of_another_code_version_is_refused() -> None:
    driver = CoreDriver(CorePolicy(), SECRET)
    snapshot = Snapshot("telemetry", 0, 0, 1.0, driver.state.runs, code_version="0.0.0-old")
    with pytest.raises(SnapshotError, match="0.0.0-old"):
        decode_snapshot(encode_snapshot(snapshot, KEY), KEY)


def test_a_signed_payload_that_is_not_a_snapshot_is_refused() -> None:
    body = zlib.compress(pickle.dumps({"not": "a snapshot"}))
    value = b"TGS1" + hmac.new(KEY, body, hashlib.sha256).digest() + body
    with pytest.raises(SnapshotError, match="not a Snapshot"):
        decode_snapshot(value, KEY)


def test_a_snapshot_whose_classes_moved_is_refused_not_fatal() -> None:
    # A snapshot taken before a state class moved to another module (same version
    # string, other code): unpickling cannot find the class. The processor must refuse
    # it and rebuild from the log, not crash-loop on every restart.
    driver = CoreDriver(CorePolicy(), SECRET)
    for value in job_records()[:200]:
        driver.handle(value)
    body = pickle.dumps(Snapshot("telemetry", 0, 0, 1.0, driver.state.runs), protocol=pickle.HIGHEST_PROTOCOL)
    moved = body.replace(b"trainguard.processors.core.state", b"trainguard.processors.core.stat3")
    assert moved != body
    compressed = zlib.compress(moved)
    value = b"TGS1" + hmac.new(KEY, compressed, hashlib.sha256).digest() + compressed
    with pytest.raises(SnapshotError, match="written by other code"):
        decode_snapshot(value, KEY)
