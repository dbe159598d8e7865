"""How one run's telemetry is spread over partitions, so that several workers share a
run too large for one (a 65,536-rank run emits ~74,000 events/s).

A run of up to `shard_ranks` ranks is one shard: all its telemetry goes to one
partition and one worker sees everything, in order. A larger run is cut into
contiguous rank ranges of `shard_ranks` (shard k owns ranks [k·S, (k+1)·S)); with S a
multiple of the ranks per node and of the rack size, a node and a rack never straddle
two shards, so the per-node batch and the rack's median temperature (diagnosis) stay
whole. Shard k of S goes to partition (crc32(run_id) + k·P // S) mod P: a run's shards take
partitions spread evenly from a stable hash of the run id, which spreads them over
the workers of the group.

Which events go where (`route`):
  per-rank streams (step timing, heartbeat, GPU health, step stats)  -> the rank's shard
  the run's start (world size, racks)                                -> every shard
  everything else (rank exits and their stack signatures, SDC check
  results, checkpoints, ticks)                                       -> shard 0

Shard 0 is the run's coordinator: it alone makes run-level decisions (hang watchdog
and verdict, crash, interruptions, SDC checks and their schedule, non-finite abort,
grad-spike skip, MTBF). The other shards run the per-rank detectors (straggler and its
diagnosis) on their ranks and forward to shard 0 the rare report that needs a
run-level decision (a non-finite loss). A hang stalls every rank of a synchronous job,
so shard 0 sees it on its own ranks; every rank's exit and stack signature is routed
to shard 0, so the odd stack is found among all ranks, as in an unsharded run.
"""

from __future__ import annotations

import zlib

from .base import Envelope
from .events import GpuHealth, Heartbeat, RunStarted, StepStats, StepTiming

#: Ranks per shard by default: one worker holds a 16,384-rank run at > 5x real time.
DEFAULT_SHARD_RANKS = 16_384

#: Event kinds that follow their rank; the rest go to the coordinator (shard 0).
PER_RANK_KINDS: tuple[type[Envelope], ...] = (StepTiming, Heartbeat, GpuHealth, StepStats)


def shard_size(world_size: int, shard_ranks: int = DEFAULT_SHARD_RANKS) -> int:
    """Ranks per shard, or 0 when the run is not sharded (it fits one shard)."""
    return shard_ranks if 0 < shard_ranks < world_size else 0


def shard_count(world_size: int, size: int) -> int:
    return 1 if size == 0 else -(-world_size // size)


def shard_of(rank: int, size: int) -> int:
    return 0 if size == 0 or rank < 0 else rank // size


def owned_ranks(shard: int, size: int, world_size: int) -> range:
    """The ranks shard `shard` owns (all of them when the run is not sharded)."""
    if size == 0:
        return range(world_size)
    return range(shard * size, min(world_size, (shard + 1) * size))


def route(event: Envelope, world_size: int, size: int) -> range | tuple[int]:
    """The shards that must see `event` (see the module docstring)."""
    if size == 0:
        return (0,)
    if isinstance(event, RunStarted):
        return range(shard_count(world_size, size))
    if isinstance(event, PER_RANK_KINDS):
        return (min(shard_of(event.rank, size), shard_count(world_size, size) - 1),)
    return (0,)


def telemetry_partition(run_id: str, shard: int, shards: int, partitions: int) -> int:
    """The partition of a run's shard: from a stable hash of the run id (crc32, the same in
    every process and language, unlike Python's hash(); for shard 0 it is also where
    librdkafka's default partitioner puts the key `run_id`), the shards spread evenly
    over the partitions. Evenly, not consecutively: a consumer group assigns a worker
    either a range of partitions or every n-th one, and an even spread splits a run's
    shards fairly under both."""
    return (zlib.crc32(run_id.encode()) + shard * partitions // max(1, shards)) % partitions


def telemetry_key(run_id: str, shard: int) -> bytes:
    """The record key: the run id, with the shard for shards past the first."""
    return run_id.encode() if shard == 0 else f"{run_id}#{shard}".encode()


def run_of_key(key: bytes | None) -> str:
    """The run id of a telemetry record key (`run` or `run#shard`, telemetry_key)."""
    return (key or b"").decode(errors="replace").partition("#")[0]
