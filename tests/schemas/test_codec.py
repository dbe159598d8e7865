"""Every record kind round-trips through the one codec; every rejection has its reason."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from trainguard.schemas import (
    GpuHealth,
    RankExit,
    Record,
    RejectReason,
    RunStarted,
    auth,
    decode,
    decode_batch,
    encode,
    encode_batch,
)
from trainguard.schemas.base import Reason, ReasonCode
from trainguard.schemas.codec import ALL, COMMANDS, TELEMETRY, UPCASTERS, Rejected, decode_obj
from trainguard.schemas.commands import Abort, Ack, AckStatus, Rollback, RunCrossRankCheck

ENVELOPE: dict[str, Any] = dict(
    event_id="e-1", run_id="run-a", attempt=2, rank=5, node="node-001", step=120, ts=1.8e9
)
REASON = Reason(code=ReasonCode.OPERATOR, text="test")
COMMAND: dict[str, Any] = dict(command_id="c-1", run_id="run-a", attempt=2, issued_ts=1.8e9, reason=REASON)

# One realistic instance of every kind on the wire.
SAMPLES: dict[str, dict[str, Any]] = {
    "run_started": dict(world_size=64, ranks_per_node=8, nodes=[f"node-{i:03d}" for i in range(8)]),
    "heartbeat": dict(phase="allreduce"),
    "step_timing": dict(compute_s=1.41, total_s=2.02),
    "step_stats": dict(loss=2.31, grad_norm=0.84, finite=True),
    "sdc_self_check": dict(microbatch_id="mb-7", digest_first="ab", digest_second="ab"),
    "cross_rank_check": dict(microbatch_id="mb-7", ranks=[1, 9], values=[0.125, 0.1250001]),
    "ring_check": dict(check_id="ring-a0-s10000", own_value=512.25, peer_rank=17, peer_value=731.5),
    "gpu_health": dict(
        present=True,
        temperature_c=71.0,
        sm_clock_mhz=1980,
        power_capped=False,
        memory_temperature_c=82.0,
        sm_clock_max_mhz=1980,
        memory_clock_mhz=2619,
        power_w=612.5,
        power_limit_w=700.0,
        throttle_reasons=["sw_thermal_slowdown"],
        ecc_corrected_total=12,
        ecc_uncorrected_total=0,
        nvlink_crc_errors=3,
        remapped_rows_correctable=2,
        remapped_rows_uncorrectable=0,
        remap_pending=False,
        remap_failed=False,
        xid_errors=1,
        last_xid=63,
        pcie_replays=0,
    ),
    "node_excluded": dict(
        failures=3,
        window_days=30.0,
        runs=["run-a", "run-b"],
        reason=dict(code="lemon_node", text="3 failures in 30 days"),
    ),
    "node_self_test_result": dict(
        passed=False,
        tests=["gemm", "collective"],
        failed_tests=["gemm"],
        purpose="quarantine",
        command_id="c-7",
        devices=8,
        wall_s=6.8,
        reason=Reason(code=ReasonCode.NODE_SELF_TEST_FAILED, text="gemm wrong on local rank 1"),
    ),
    "checkpoint_written": dict(
        checkpoint_step=100, uri="file:///c/100", shards=8, digest="d", bytes=10, blocking_s=0.4, write_s=5
    ),
    "checkpoint_validated": dict(checkpoint_step=100, uri="file:///c/100", last_verified_step=100),
    "checkpoint_failed": dict(checkpoint_step=100, uri="file:///c/100", error="ENOSPC"),
    "rank_exit": dict(signal=9, stack_signature="collective:allreduce", job_step=136),
    "restart_phases": dict(
        interrupted_attempt=2,
        cause="crash",
        phases={"detect": 0.4, "reschedule": 1.2, "process_start": 2.5, "checkpoint_load": 0.8},
        resumed_from_step=120,
    ),
    "tick": {},
    "straggler_flagged": dict(
        reason=REASON, robust_z=4.2, slowdown=1.21, consecutive_steps=100, onset_step=20
    ),
    "straggler_cleared": dict(reason=REASON, flagged_steps=340),
    "straggler_diagnosed": dict(
        reason=REASON, diagnosis="environmental", action="alert_facilities", evidence={"rack_median_c": 91.0}
    ),
    "ranks_missing": dict(reason=REASON, ranks=[3, 9]),
    "grad_spike": dict(reason=REASON, grad_norm=93.0, threshold=8.4, anomalies=2),
    "mtbf_update": dict(
        reason=REASON,
        mtbf_s=11_160.0,
        ci_low_s=7_000.0,
        ci_high_s=19_000.0,
        prior_mtbf_s=178_000.0,
        interruptions=9,
        exposure_s=100_440.0,
        by_cause={"crash": 7, "hang": 2},
        rate_1h=1.0,
        baseline_rate_per_h=0.32,
    ),
    "hang_detected": dict(reason=REASON, last_step=119, stalled_s=95.0, timeout_s=90.0),
    "sdc_mismatch": dict(
        reason=REASON, method="cross_rank", microbatch_id="mb-7", tolerance=1e-6, deviation=0.2
    ),
    "interruption": dict(
        reason=REASON,
        interruption_id="i-1",
        cause="crash",
        detected_by="rank_exit",
        lost_steps=20,
        last_checkpoint_step=100,
    ),
    "interruption_recovered": dict(
        reason=REASON,
        interruption_id="i-1",
        restart_s=312.5,
        resumed_attempt=3,
        phases={"detect": 0.0, "reschedule": 150.0, "startup": 162.5},
        lost_s=410.0,
        world_size=16_384,
        gpu_hours=3288.2,
    ),
    "quarantine": dict(reason=REASON, run_ids_affected=["run-a"]),
    "quarantine_released": dict(reason=REASON, quarantine_id="q-1"),
    "page": dict(reason=REASON, rule="same_node_twice", evidence=["i-1", "i-2"]),
    "interval_update": dict(reason=REASON, mtbf_s=11_160.0, checkpoint_cost_s=30.0, interval_s=818.0),
    "goodput_report": dict(
        reason=REASON,
        window_s=3600.0,
        elapsed_s=3600.0,
        checkpoint_s=132.0,
        lost_s=410.0,
        restart_s=600.0,
        straggler_s=0.0,
        goodput=0.683,
        interruptions=1,
    ),
    "failure_predicted": dict(
        reason=REASON,
        probability=0.42,
        horizon_s=3600.0,
        signals=["ecc_corrected: 310/h on rank 27, the fleet's 99.9th 6/h"],
        evidence=14.2,
    ),
    "drain_decision": dict(
        reason=REASON,
        decision="drain",
        probability=0.42,
        horizon_s=3600.0,
        restart_s=600.0,
        lost_work_s=900.0,
        drain_cost_s=35.0,
        expected_saving_s=595.0,
        within_s=300.0,
    ),
    "eviction_decision": dict(
        reason=REASON,
        decision="evict",
        slowdown=1.25,
        straggler_cost=0.2,
        p_healthy=0.8,
        restart_s=600.0,
        benefit=0.16,
        payback_s=3750.0,
        horizon_s=21_600.0,
        evictions_resolved=3,
        evictions_unresolved=1,
    ),
    "group_compute_times": dict(
        shard=1,
        groups=["rack:rack-08", "rack:rack-09"],
        medians=[1.402, 1.471],
        counts=[128, 127],
        health={"rack:rack-09": {"median_temp_c": 91.2, "hot_share": 0.94, "nodes_reporting": 16.0}},
    ),
    "group_slowdown_flagged": dict(
        reason=REASON,
        group="rack-09",
        group_kind="rack",
        members=[f"node-{i:04d}" for i in range(144, 160)],
        slowdown=1.05,
        threshold=0.03,
        consecutive_steps=50,
        onset_step=100,
        diagnosis="environmental",
        action="alert_facilities",
        evidence={"median_temp_c": 91.2},
    ),
    "group_slowdown_cleared": dict(reason=REASON, group="rack-09", flagged_steps=120),
    "checkpoint_rejected": dict(
        checkpoint_step=119,
        uri="file:///c/119",
        error="digest mismatch in shard __2_0.distcp",
        resumed_from_step=99,
    ),
    "resume_rejected": dict(reason=REASON, checkpoint_step=119, resumed_from_step=99, interruption_id="i-1"),
}
COMMAND_SAMPLES: dict[str, dict[str, Any]] = {
    "checkpoint_now": {},
    "set_checkpoint_interval": dict(interval_s=818.0),
    "abort": dict(stack_dump=True),
    "skip_update": dict(step=121),
    "run_self_check": dict(step=130, ranks=[3]),
    "run_cross_rank_check": dict(
        step=10_000, ranks=[3, 4100, 17], microbatch_id="ring-a0-s10000/r4100", batch_rank=4100
    ),
    "evict_rank": dict(rank=5),
    "quarantine_node": dict(node="node-001"),
    "run_node_self_test": dict(node="node-001", ranks=[8, 9], tests=["gemm"]),
    "resume_from": dict(checkpoint_step=100, uri="file:///c/100"),
    "rollback": dict(checkpoint_step=100, uri="file:///c/100"),
    "run_ring_check": dict(step=10_000, check_id="ring-a0-s10000", offset=8),
    "pause_run": dict(step=4711),
    "release_node": dict(node="node-012"),
    "interruption_decided": dict(interruption_id="interruption-4e13"),
    "drain_node": dict(node="node-012", within_s=300.0),
}


def build(kind: str) -> Record:
    cls = ALL[kind]
    if kind in COMMAND_SAMPLES:
        return cls(**COMMAND, **COMMAND_SAMPLES[kind])
    return cls(**ENVELOPE, **SAMPLES[kind])


def test_samples_cover_every_registered_kind() -> None:
    assert set(SAMPLES) | set(COMMAND_SAMPLES) | {"ack", "batch"} == set(ALL)


@pytest.mark.parametrize("kind", sorted([*SAMPLES, *COMMAND_SAMPLES]))
def test_round_trip(kind: str) -> None:
    record = build(kind)
    raw = encode(record)
    assert orjson.loads(raw)["schema"] == f"{kind}/{type(record).VERSION}"
    assert decode(raw) == record


def test_ack_round_trip() -> None:
    ack = Ack(
        command_id="c", command_kind="abort", run_id="r", attempt=0, rank=3, node="n",
        status=AckStatus.DUPLICATE, ts=1.0,
    )  # fmt: skip
    assert decode(encode(ack)) == ack


def test_non_finite_loss_survives_the_wire() -> None:
    stats = ALL["step_stats"](**ENVELOPE, loss=math.nan, grad_norm=math.inf, finite=False)
    back = decode(encode(stats))
    assert math.isnan(back.loss) and math.isinf(back.grad_norm) and not back.finite


def reject(raw: bytes, registry: dict[str, type[Record]] = ALL) -> Rejected:
    with pytest.raises(Rejected) as info:
        decode(raw, registry)
    return info.value


def with_(kind: str, **changes: Any) -> bytes:
    obj = orjson.loads(encode(build(kind)))
    obj.update(changes)
    return orjson.dumps(obj)


@pytest.mark.parametrize(
    ("raw", "reason", "words"),
    [
        (b"\xff\xfe not json", RejectReason.MALFORMED, "JSON"),
        (b"[1, 2]", RejectReason.NOT_AN_OBJECT, "list"),
        (b'{"event_id": "x"}', RejectReason.MISSING_SCHEMA, "schema"),
        (b'{"schema": "heartbeat/one"}', RejectReason.MISSING_SCHEMA, "integer version"),
        (b'{"schema": "fan_speed/1"}', RejectReason.UNKNOWN_KIND, "fan_speed"),
        (with_("heartbeat", schema="heartbeat/7"), RejectReason.UNKNOWN_VERSION, "newer"),
        (with_("heartbeat", schema="heartbeat/0"), RejectReason.UNKNOWN_VERSION, "no upcaster"),
        (with_("step_timing", compute_s="fast"), RejectReason.INVALID_FIELDS, "compute_s"),
        (with_("step_timing", attempt=-1), RejectReason.INVALID_FIELDS, "attempt"),
        (with_("heartbeat", colour="blue"), RejectReason.INVALID_FIELDS, "colour"),
        (with_("step_timing", total_s="Infinity"), RejectReason.NON_FINITE, "total_s"),
        (b'{"schema":"heartbeat/1","pad":"' + b"x" * 1_100_000 + b'"}', RejectReason.OVERSIZED, "limit"),
    ],
)
def test_each_rejection_reason(raw: bytes, reason: RejectReason, words: str) -> None:
    rejected = reject(raw)
    assert rejected.reason == reason and words in rejected.detail and rejected.raw == raw


def test_command_on_the_telemetry_topic_is_the_wrong_record_type() -> None:
    rejected = reject(encode(build("abort")), TELEMETRY)
    assert rejected.reason == RejectReason.WRONG_RECORD_TYPE


def test_older_version_is_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """heartbeat/0 had `host` where /1 has `node`: the upcaster renames it."""

    def v0_to_v1(body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        body["node"] = body.pop("host")
        return body

    monkeypatch.setitem(UPCASTERS, ("heartbeat", 0), v0_to_v1)
    old = {**ENVELOPE, "schema": "heartbeat/0", "host": ENVELOPE["node"]}
    del old["node"]
    assert decode_obj(old) == build("heartbeat").model_copy(update={"phase": ""})  # then /1 -> /2


def test_a_heartbeat_1_reads_as_a_heartbeat_2_of_unknown_phase() -> None:
    old = {**ENVELOPE, "schema": "heartbeat/1"}
    beat = decode_obj(old)
    assert beat == build("heartbeat").model_copy(update={"phase": ""}) and beat.phase == ""  # type: ignore[attr-defined]
    decoded = decode_batch(batch([orjson.dumps(old)]))
    assert [e.phase for e in decoded.events] == [""] and not decoded.rejections  # type: ignore[attr-defined]


def batch(records: list[bytes], world_size: int = 8, run_id: str = "run-a") -> bytes:
    header = dict(run_id=run_id, node="node-001", world_size=world_size, producer_id="p", seq=0)
    return encode_batch(header, records)


def test_batch_keeps_good_records_around_bad_ones_each_with_its_reason() -> None:
    good = [encode(build("heartbeat")), encode(build("step_timing"))]
    bad_rank = with_("heartbeat", rank=8, event_id="e-2")
    other_run = with_("heartbeat", run_id="run-b", event_id="e-3")
    bad_version = with_("heartbeat", schema="heartbeat/9", event_id="e-4")
    decoded = decode_batch(batch([good[0], bad_rank, other_run, bad_version, good[1]]))
    assert [e.KIND for e in decoded.events] == ["heartbeat", "step_timing"]
    assert [r.reason for r in decoded.rejections] == [
        RejectReason.RANK_OUT_OF_RANGE,
        RejectReason.RUN_MISMATCH,
        RejectReason.UNKNOWN_VERSION,
    ]
    assert orjson.loads(decoded.rejections[0].raw)["rank"] == 8  # original record kept


def test_registered_world_size_overrides_the_batch_header() -> None:
    decoded = decode_batch(batch([encode(build("heartbeat"))], world_size=64), world_size=4)
    assert decoded.events == [] and decoded.rejections[0].reason == RejectReason.RANK_OUT_OF_RANGE


def test_malformed_batch_is_rejected_whole_with_its_bytes() -> None:
    raw = b'{"schema":"batch/1","run_id":"r","records":[{'
    decoded = decode_batch(raw)
    assert decoded.events == [] and decoded.rejections[0].reason == RejectReason.MALFORMED
    assert decoded.rejections[0].raw == raw


def test_lone_event_is_accepted_on_the_telemetry_topic() -> None:
    decoded = decode_batch(encode(build("heartbeat")), world_size=8)
    assert decoded.header is None and decoded.events == [build("heartbeat")]


# --------------------------------------------------------------------------- signing

KEY = auth.run_key(b"0123456789abcdef0123456789abcdef", "run-a")


def test_signed_command_verifies_and_survives_the_wire() -> None:
    command = auth.sign(build("rollback"), KEY)
    back = decode(encode(command), COMMANDS)
    assert isinstance(back, Rollback) and auth.verify(back, KEY)


@pytest.mark.parametrize(
    "tamper",
    [
        {"attempt": 3},
        {"ranks": [0]},
        {"run_id": "run-b"},
        {"checkpoint_step": 1},
    ],
)
def test_tampered_command_fails_verification(tamper: dict[str, Any]) -> None:
    command = auth.sign(build("rollback"), KEY)
    assert not auth.verify(command.model_copy(update=tamper), KEY)


def test_forged_command_and_other_runs_key_fail() -> None:
    forged = auth.sign(build("abort"), auth.run_key(b"not-the-secret-not-the-secret!!", "run-a"))
    assert not auth.verify(forged, KEY)
    other = auth.sign(build("abort"), auth.run_key(b"0123456789abcdef0123456789abcdef", "run-b"))
    assert not auth.verify(other, KEY)
    assert isinstance(forged, Abort)


def test_secret_comes_from_env_or_file_and_short_ones_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert auth.load_master_secret({"TRAINGUARD_SECRET": "s" * 32}) == b"s" * 32
    path = auth.write_secret_file(tmp_path / "secret")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(auth.load_master_secret({"TRAINGUARD_SECRET_FILE": str(path)})) == 64
    with pytest.raises(auth.SecretError, match="shorter"):
        auth.load_master_secret({"TRAINGUARD_SECRET": "short"})
    with pytest.raises(auth.SecretError, match="TRAINGUARD_SECRET"):
        auth.load_master_secret({})


def test_a_run_started_of_version_1_is_upcast_with_no_placement_groups() -> None:
    body = {"schema": "run_started/1", **ENVELOPE, **SAMPLES["run_started"]}
    event = decode(orjson.dumps(body))
    assert isinstance(event, RunStarted) and event.placement_groups == {}


def test_a_gpu_health_of_version_1_is_upcast_with_the_v2_readings_unknown() -> None:
    v1 = dict(present=True, temperature_c=71.0, sm_clock_mhz=1980, power_capped=False, ecc_corrected=2)
    event = decode(orjson.dumps({"schema": "gpu_health/1", **ENVELOPE, **v1}))
    assert isinstance(event, GpuHealth) and event.temperature_c == 71.0 and event.ecc_corrected == 2
    assert (
        event.throttle_reasons is None
        and event.memory_temperature_c is None
        and event.nvlink_crc_errors is None
    )


def test_a_rank_exit_of_version_1_is_upcast_with_the_job_step_unknown() -> None:
    body = {"schema": "rank_exit/1", **ENVELOPE, "signal": 9}
    event = decode(orjson.dumps(body))
    assert isinstance(event, RankExit) and event.job_step == -1 and event.signal == 9


def test_a_rank_exit_of_version_2_is_upcast_as_no_lost_peer() -> None:
    body = {"schema": "rank_exit/2", **ENVELOPE, "exit_code": 1, "job_step": 40}
    event = decode(orjson.dumps(body))
    assert isinstance(event, RankExit) and event.peer_lost is False and event.job_step == 40


def test_a_cross_rank_check_command_of_version_1_is_upcast_with_no_batch_rank() -> None:
    body = {"schema": "run_cross_rank_check/1", **COMMAND, "reason": REASON.model_dump(mode="json")}
    command = decode(orjson.dumps({**body, "step": 100, "ranks": [3, 4, 5], "microbatch_id": "mb-100"}))
    assert isinstance(command, RunCrossRankCheck) and command.batch_rank is None
    assert (command.step, command.ranks, command.microbatch_id) == (100, [3, 4, 5], "mb-100")


def test_a_shards_failure_prediction_decodes_alone_on_the_telemetry_topic() -> None:
    """A shard forwards its FailurePredicted to shard 0 as a lone record on the telemetry
    topic (processors/core/decisions/drain.py decides there); any other derived record alone there is
    refused as an unknown kind."""
    from trainguard.schemas import decode_batch, encode

    predicted = build("failure_predicted")
    decoded = decode_batch(encode(predicted))
    assert decoded.events == [predicted] and not decoded.rejections
    other = decode_batch(encode(build("drain_decision")))
    assert not other.events and other.rejections
