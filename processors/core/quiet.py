"""A heartbeat that changes a few clocks and decides nothing, folded without the core's
dispatcher, with exactly the state ``engine.step`` leaves (issue 20).

A 16,384-rank run's node flush holds 8 heartbeats for 40 step timings; through ``step``
each costs the whole dispatch (dedupe, clocks, the kind chain, the watchdog, the
failure-rate and goodput checks, the consequences of no output) to move a rank's clocks.
A heartbeat is *quiet* when the run is steady (block.steady: training on its coordinator,
nothing pending or open), the heartbeat is of the run's attempt, from a known rank this
shard watches, not seen before, and neither moves the goodput clock to a report, nor the
exposure to a failure-rate check, nor shows a stall past the smallest timeout the policy
can give. Anything else, or any doubt, goes through ``step``. Pure like the rest of the
core. The driver uses it where it folds blocks as columns (CoreDriver.columnar), so the
equivalence tests (the library and a recorded run, both ways) cover it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...schemas import Heartbeat
from .baseline import observe
from .block import steady
from .goodput import advance
from .watchdog import stall_s

if TYPE_CHECKING:
    from .policy import CorePolicy
    from .state import RunState


def fold_quiet_heartbeat(
    run: RunState | None, event: Heartbeat, policy: CorePolicy, hint: int | None
) -> bool:
    """Fold `event` if it is quiet (True); else change nothing (False: fold it with step)."""
    if run is None or not steady(run):
        return False
    size = run.world_size or hint
    rank_id, ts = event.rank, event.ts
    if not size or not 0 <= rank_id < size or event.attempt != run.attempt or event.event_id in run.seen:
        return False
    rank = run.ranks.get(rank_id)
    if rank is None or rank.exited:
        return False
    if run.shard_ranks and (owned := run.owned()) is not None and rank_id not in owned:
        return False
    goodput, exposure = run.goodput, run.baseline
    # The same comparisons, written the same way, as goodput.reports and baseline.on_time.
    clock = ts if ts > goodput.clock else goodput.clock  # type: ignore[operator]
    if clock - goodput.last_report_ts >= policy.goodput.report_every_s:  # type: ignore[operator]
        return False
    if not max(exposure.end_ts, ts) < exposure.checked_end_ts + policy.baseline.check_every_s:
        return False
    hang = policy.hang
    if stall_s(rank, ts) > min(hang.floor_s, hang.default_timeout_s, hang.startup_timeout_s):
        return False  # the watchdog would judge it (is_hung)
    # What step does with it, in its order.
    seen = run.seen
    seen[event.event_id] = None
    if len(seen) > policy.dedupe_window:
        seen.popitem(last=False)
    if run.first_ts is None or ts < run.first_ts:
        run.first_ts = ts
    if ts > run.last_ts:
        run.last_ts = ts
    advance(goodput, ts, False, policy.goodput)
    if ts > rank.last_seen_ts:
        rank.last_seen_ts = ts
    if rank.progress_ts is None:
        rank.progress_ts = ts
    if event.phase and ts >= rank.phase_ts:
        rank.phase, rank.phase_ts = event.phase, ts
    observe(exposure, run, ts)
    return True
