"""The progress watchdog (hang detector).

A hang is "no completed step for step_timeout" while the process is alive
(heartbeats still arrive), never "the process is gone" (seed §7).
Stall is measured per rank on the rank's own clock: the ts of its latest heartbeat
minus the ts of its latest completed step, both stamped by the same emitter, so
clock skew between hosts cannot fake or hide a hang.
"""

from __future__ import annotations

import math

from ..policy import HangPolicy
from ..state import RankState, RunPhase, RunState


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def step_timeout_s(run: RunState, policy: HangPolicy) -> float:
    """3x p99 of recent step times, clamped to [floor, ceiling]; the default until enough data."""
    if len(run.step_times) < policy.min_samples:
        return policy.default_timeout_s
    raw = policy.p99_multiplier * p99(list(run.step_times))
    return min(policy.ceiling_s, max(policy.floor_s, raw))


def stall_s(rank: RankState, now_ts: float) -> float:
    return 0.0 if rank.progress_ts is None else max(0.0, now_ts - rank.progress_ts)


def is_hung(run: RunState, rank: RankState, now_ts: float, policy: HangPolicy) -> float | None:
    """The timeout that was exceeded, or None. Only a live, non-exited rank can show a hang,
    and none while ranks' deaths of a lost peer are being judged (peer_loss.py: the attempt
    has ended; a survivor still stalled in its collective is part of that)."""
    if rank.exited or run.pending_hang is not None or run.pending_crash is not None:
        return None
    stalled = stall_s(rank, now_ts)
    if stalled <= min(policy.floor_s, policy.default_timeout_s, policy.startup_timeout_s):
        return None  # below every timeout this policy can give: skip the p99 (hot path)
    if run.phase == RunPhase.TRAINING and rank.last_step >= 0:
        timeout = step_timeout_s(run, policy)
    elif run.phase in (RunPhase.STARTING, RunPhase.TRAINING):
        timeout = policy.startup_timeout_s
    else:
        return None
    return timeout if stalled > timeout else None
