"""RankAgent and NodeAgents against an in-memory sink (no broker)."""

from __future__ import annotations

import math
import time

from trainguard.producers.rank.agent import NodeAgents, RankAgent
from trainguard.producers.rank.shipper import ShipperConfig, ShipperStats, TelemetryShipper
from trainguard.schemas import (
    NO_STEP,
    CheckpointValidated,
    CheckpointWritten,
    Envelope,
    GpuHealth,
    Heartbeat,
    RankExit,
    SdcSelfCheck,
    StepStats,
    StepTiming,
    decode,
    encode,
)


class ListSink:
    """Shipper stand-in for unit tests: keeps what is submitted."""

    def __init__(self) -> None:
        self.events: list[Envelope] = []
        self.stats = ShipperStats(dropped=2, failed=3)

    def submit(self, event: Envelope) -> bool:
        self.events.append(event)
        return True


def agent(sink: ListSink, rank: int = 3) -> RankAgent:
    return RankAgent(sink, "run-a", attempt=1, rank=rank, node="node-7", clock=lambda: 1234.5)


def test_step_emits_timing_then_stats() -> None:
    sink = ListSink()
    a = agent(sink)
    a.step(10, compute_s=0.8, total_s=1.0)
    a.step(11, compute_s=0.7, total_s=1.1, loss=2.5, grad_norm=0.3)
    kinds = [type(e) for e in sink.events]
    assert kinds == [StepTiming, StepTiming, StepStats]
    timing, stats = sink.events[1], sink.events[2]
    assert isinstance(timing, StepTiming) and isinstance(stats, StepStats)
    assert (timing.compute_s, timing.total_s, timing.step) == (0.7, 1.1, 11)
    assert (stats.loss, stats.grad_norm, stats.finite) == (2.5, 0.3, True)
    for e in sink.events:
        assert (e.run_id, e.attempt, e.rank, e.node, e.ts) == ("run-a", 1, 3, "node-7", 1234.5)
    assert a.last_step == 11


def test_event_ids_are_unique_and_increasing() -> None:
    sink = ListSink()
    a, b = agent(sink, rank=0), agent(sink, rank=1)
    for i in range(100):
        a.step(i, 0.1, 0.2, loss=1.0, grad_norm=1.0)
        b.step(i, 0.1, 0.2)
    ids = [e.event_id for e in sink.events]
    assert len(set(ids)) == len(ids)
    counters = [int(e.event_id.rsplit("-", 1)[1]) for e in sink.events if e.rank == 0]
    assert counters == sorted(counters) and counters[0] == 0 and counters[-1] == 199


def test_non_finite_loss_or_grad_norm_is_flagged() -> None:
    sink = ListSink()
    a = agent(sink)
    a.step(1, 0.1, 0.2, loss=math.nan, grad_norm=1.0)
    a.step(2, 0.1, 0.2, loss=1.0, grad_norm=math.inf)
    a.step(3, 0.1, 0.2, loss=1.0)  # grad norm not measured: None, finite covers the loss
    stats = [e for e in sink.events if isinstance(e, StepStats)]
    assert [s.finite for s in stats] == [False, False, True]
    assert stats[2].grad_norm is None
    # Non-finite values survive the wire (they are the signal).
    back = decode(encode(stats[0]))
    assert isinstance(back, StepStats) and math.isnan(back.loss) and not back.finite


def test_invalid_values_are_counted_not_raised() -> None:
    sink = ListSink()
    a = agent(sink)
    a.step(5, compute_s=-0.1, total_s=1.0)  # a clock step backwards must not crash training
    a.step(6, compute_s=math.nan, total_s=1.0)
    assert a.invalid == 2
    assert sink.events == []
    assert a.last_step == 6


def test_other_events() -> None:
    sink = ListSink()
    a = agent(sink)
    a.heartbeat()
    a.step(4, 0.1, 0.2)
    a.heartbeat()
    a.gpu_health(temperature_c=71.0, ecc_uncorrected=0)
    a.self_check(4, "mb-4", "aa", "ab")
    a.checkpoint_written(4, "file:///c/4", shards=2, digest="d", nbytes=10, blocking_s=0.1, write_s=1.0)
    a.checkpoint_validated(4, "file:///c/4", last_verified_step=3)
    a.exit(exit_code=1, stack_signature="allreduce")
    a.heartbeat()  # after exit: nothing
    kinds = [type(e) for e in sink.events]
    assert kinds == [
        Heartbeat,
        StepTiming,
        Heartbeat,
        GpuHealth,
        SdcSelfCheck,
        CheckpointWritten,
        CheckpointValidated,
        RankExit,
    ]
    beats = [e for e in sink.events if isinstance(e, Heartbeat)]
    assert [h.step for h in beats] == [NO_STEP, 4]
    gpu = sink.events[3]
    assert isinstance(gpu, GpuHealth) and gpu.present and gpu.temperature_c == 71.0
    check = sink.events[4]
    assert isinstance(check, SdcSelfCheck) and not check.passed
    assert sink.events[5].step == 4
    assert a.invalid == 0


def test_drops_reads_the_shipper_counters() -> None:
    assert agent(ListSink()).drops == 5


def test_node_agents_beat_every_interval() -> None:
    now = [0.0]
    beats = NodeAgents(heartbeat_interval_s=5.0, monotonic=lambda: now[0])
    sink = ListSink()
    ranks = [beats.add(agent(sink, rank=r)) for r in range(4)]
    ranks[2].step(9, 0.1, 0.2)
    sink.events.clear()
    for t in (0.0, 1.0, 4.9, 5.0, 6.0, 10.5):
        now[0] = t
        beats.on_flush()
    hb = [e for e in sink.events if isinstance(e, Heartbeat)]
    assert len(hb) == 12  # rounds at t=0, 5.0 and 10.5
    assert {e.rank: e.step for e in hb} == {0: NO_STEP, 1: NO_STEP, 2: 9, 3: NO_STEP}
    ranks[1].exit(exit_code=0)
    beats.remove(ranks[3])
    sink.events.clear()
    now[0] = 20.0
    beats.on_flush()
    assert sorted(e.rank for e in sink.events) == [0, 2]


def test_heartbeats_flow_from_the_shipper_thread_while_training_is_stuck() -> None:
    """A real shipper (its broker unreachable: only its thread matters here) beats for an
    agent whose training thread is blocked, as in a hung collective."""
    beats = NodeAgents(heartbeat_interval_s=0.05)
    config = ShipperConfig("127.0.0.1:9", "unused", flush_interval_s=0.02)
    shipper = TelemetryShipper(config, "run-a", world_size=8, on_flush=beats.on_flush)
    try:
        a = beats.add(RankAgent(shipper, "run-a", 0, rank=3, node="n"))
        a.step(41, 0.1, 0.2)
        before = shipper.stats.submitted
        time.sleep(0.5)  # the training thread is stuck; nothing calls the agent
        assert shipper.stats.submitted - before >= 4
    finally:
        stats = shipper.close(timeout_s=0.5)
    assert stats.delivered == 0
    assert stats.submitted == stats.dropped + stats.failed
