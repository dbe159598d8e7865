"""Where a sharded run's events go (schemas/sharding.py) and the batch header that says so."""

from __future__ import annotations

import orjson

from trainguard.processors.core.state import RunState
from trainguard.schemas import (
    GpuHealth,
    Heartbeat,
    RankExit,
    RunStarted,
    SdcSelfCheck,
    StepStats,
    StepTiming,
    decode_batch,
    encode,
)
from trainguard.schemas.sharding import (
    owned_ranks,
    route,
    shard_count,
    shard_size,
    telemetry_key,
    telemetry_partition,
)

WORLD = 65_536
SIZE = shard_size(WORLD, 16_384)
BASE = dict(run_id="run-big", attempt=0, node="node-2100", step=7, ts=1_000.0)


def test_a_run_that_fits_one_shard_is_not_sharded() -> None:
    assert shard_size(16_384, 16_384) == 0 and shard_size(16_385, 16_384) == 16_384
    assert shard_count(16_384, 0) == 1 and shard_count(WORLD, SIZE) == 4
    assert owned_ranks(0, 0, 100) == range(100)


def test_shards_are_contiguous_rank_ranges_covering_the_world_once() -> None:
    shards = shard_count(WORLD, SIZE)
    covered = [r for k in range(shards) for r in owned_ranks(k, SIZE, WORLD)]
    assert covered == list(range(WORLD))
    # a last, partial shard
    assert owned_ranks(2, 16_384, 40_000) == range(32_768, 40_000)


def test_per_rank_streams_follow_their_rank_and_run_level_reports_go_to_shard_0() -> None:
    rank = 16_384 * 2 + 5
    per_rank = [
        Heartbeat(event_id="h", rank=rank, **BASE),
        StepTiming(event_id="t", rank=rank, compute_s=1.0, total_s=1.2, **BASE),
        StepStats(event_id="s", rank=rank, loss=1.0, grad_norm=1.0, finite=True, **BASE),
        GpuHealth(event_id="g", rank=rank, present=True, temperature_c=70.0, **BASE),
    ]
    for event in per_rank:
        assert tuple(route(event, WORLD, SIZE)) == (2,), event.KIND
    exit_ = RankExit(event_id="x", rank=rank, exit_code=1, **BASE)
    check = SdcSelfCheck(
        event_id="c", rank=rank, microbatch_id="m", digest_first="a", digest_second="b", **BASE
    )
    assert tuple(route(exit_, WORLD, SIZE)) == (0,) and tuple(route(check, WORLD, SIZE)) == (0,)
    nodes = [f"node-{i:04d}" for i in range(WORLD // 8)]
    started = RunStarted(event_id="r", rank=-1, world_size=WORLD, ranks_per_node=8, nodes=nodes, **BASE)
    assert tuple(route(started, WORLD, SIZE)) == (0, 1, 2, 3)  # every shard needs the world


def test_a_runs_shards_spread_evenly_so_either_assignment_splits_them_fairly() -> None:
    for run_id in ("run-big", "run-other", "run-third"):
        placed = [telemetry_partition(run_id, k, 4, 6) for k in range(4)]
        assert len(set(placed)) == 4  # no two shards share a partition when P >= S
        ranges = [sum(p < 3 for p in placed), sum(p >= 3 for p in placed)]  # workers own 0-2 / 3-5
        every_other = [sum(p % 2 == 0 for p in placed), sum(p % 2 == 1 for p in placed)]
        assert ranges == [2, 2] and every_other == [2, 2], (run_id, placed)
    # more shards than partitions: every partition gets its share
    placed = [telemetry_partition("run-big", k, 12, 6) for k in range(12)]
    assert sorted(placed.count(p) for p in range(6)) == [2] * 6
    assert telemetry_key("run-big", 0) == b"run-big" and telemetry_key("run-big", 3) == b"run-big#3"


def test_a_version_1_batch_is_read_as_one_unsharded_shard() -> None:
    event = Heartbeat(event_id="h", rank=3, **BASE)
    header = dict(run_id="run-big", node="node-2100", world_size=8, producer_id="p", seq=0)
    raw = orjson.dumps({"schema": "batch/1", **header, "records": [orjson.loads(encode(event))]})
    decoded = decode_batch(raw)
    assert decoded.header is not None and (decoded.header.shard, decoded.header.shard_ranks) == (0, 0)
    assert decoded.events == [event] and decoded.rejections == []


def test_the_cores_shard_state_owns_the_ranks_routed_to_its_shard() -> None:
    """processors/core/state.py computes a shard's ranks itself (compiled, per event):
    the same ranks owned_ranks routes there, and none while the world size is unknown."""
    assert RunState("r", world_size=None, shard=1, shard_ranks=16).owned() is None
    for world in (1, 15, 16, 17, 4096, 5000):
        for per_shard in (0, 16, 1024):
            for shard in range(shard_count(world, per_shard) if per_shard else 1):
                run = RunState("r", world_size=world, shard=shard, shard_ranks=per_shard)
                assert run.owned() == owned_ranks(shard, per_shard, world), (world, per_shard, shard)
