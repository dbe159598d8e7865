"""The backtest's cost model: what a decision that differs between two policies is worth,
in seconds of the whole job (multiply by the world size for GPU-seconds).

A backtest replays recorded telemetry, so it is open loop: the ranks' later reports do
not react to a decision the candidate policy made and the recorded run did not (an
evicted straggler stays slow in the recording). The model therefore prices each
difference by its first-order effect, from quantities measured in the recording
(:class:`RunFacts`), and says which rule it applied:

- **Eviction** of a straggler whose slowdown is s (throughput loss f = 1 - 1/s, the
  core's straggler_cost): evicting at t_c instead of t_b saves f x (t_b - t_c) of job
  time; an eviction made by one policy only also costs that policy one restart R. A
  straggler never evicted costs f until the end of its straggle (its last flagged step
  in the recording), or of the run.
- **Checkpoint interval** T: the seed's §6 overhead rate C/T + T/(2M) per second of run,
  with C and M measured; the saving is the integral over the run of the baseline's rate
  minus the candidate's, each policy's interval following its own IntervalUpdates.
- **Hang detection**: detecting the same hang Δ seconds sooner saves Δ (the whole job is
  stalled until the watchdog fires).
- **Rollback target**: rolling back to a checkpoint k steps newer saves k steps of work
  (k x the median step), at the risk the policy accepted.
- **Capacity** (elastic training, issue 45: a node lost with no spare ready): the shared
  rule's terms (trainguard/common/elastic.py) with what the recording measured. A loss the
  recording waited out for `waited` seconds (detection to training again at full size)
  had its replacement `waited - R` after it; shrinking to W'/W of the world would have
  lost shrink + (1 - W'/W) x that time and half a checkpoint interval + grow instead. A
  loss the recording shrank for, grown back `grown` seconds after it: waiting would have
  lost (grown - half an interval) + R instead of the shrink, the time at W' and the grow
  that the recording measured.
- **Drain** (failure prediction, issue 46: replay/prediction_backtest.py): a drain that
  takes a node out before its failure in the recording saves that failure's R and lost
  work, less the drain's C and swap; one whose failure struck before the boundary is
  worth nothing; one of a node that never failed costs C and the swap.
- Everything else that differs (pages, quarantines, self-check schedules, ...) is listed
  with no modelled cost: a page costs a human's attention, not job time, and a
  quarantine's worth depends on failures the recording does not contain.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..common.elastic import shrink_loss_s
from ..schemas import InterruptionRecovered, IntervalUpdate
from .decoded import LogColumns


@dataclass(frozen=True)
class RunFacts:
    """What the recording measured, the inputs of every cost rule."""

    world_size: int
    start_ts: float
    end_ts: float
    step_s: float  # median total step time
    checkpoint_s: float  # C: median blocking time of a checkpoint
    restart_s: float  # R: median recovery time (or the policy's default when none)
    mtbf_s: float  # M: as the core estimated it at the end of the baseline replay

    @property
    def elapsed_s(self) -> float:
        return max(0.0, self.end_ts - self.start_ts)


def measure(
    log: LogColumns,
    recovered: Sequence[InterruptionRecovered],
    mtbf_s: float,
    default_restart_s: float,
) -> RunFacts:
    """RunFacts from what the backtest kept of the recording's decoded telemetry (its
    step timings as columns) and the baseline's recoveries."""
    blocking = log.blocking_s
    seen = len(log) > 0 or bool(blocking)
    restarts = [r.restart_s for r in recovered]
    return RunFacts(
        world_size=log.world_size,
        start_ts=log.first_ts if seen else 0.0,
        end_ts=log.last_ts if seen else 0.0,
        step_s=log.median_step_s(),
        checkpoint_s=statistics.median(blocking) if blocking else 0.0,
        restart_s=statistics.median(restarts) if restarts else default_restart_s,
        mtbf_s=mtbf_s,
    )


def eviction_saving(
    facts: RunFacts,
    straggler_cost: float,
    baseline_at: float | None,
    candidate_at: float | None,
    straggle_end: float,
) -> float:
    """Seconds the candidate saves against the baseline on one straggler (negative: it
    loses). `*_at`: when each policy evicts (None: never); until then the job runs at
    1 - straggler_cost of its speed, until `straggle_end` at the latest."""

    def cost(at: float | None) -> float:
        slow_until = straggle_end if at is None else min(at, straggle_end)
        return straggler_cost * max(0.0, slow_until - facts.start_ts) + (
            facts.restart_s if at is not None else 0.0
        )

    return cost(baseline_at) - cost(candidate_at)


def overhead_rate(facts: RunFacts, interval_s: float) -> float:
    """The seed's C/T + T/2M: the fraction of run time checkpoints and lost work cost."""
    if interval_s <= 0 or facts.mtbf_s <= 0:
        return 0.0
    return facts.checkpoint_s / interval_s + interval_s / (2.0 * facts.mtbf_s)


def interval_schedule(updates: Sequence[IntervalUpdate], initial_s: float) -> list[tuple[float, float]]:
    """(from_ts, interval_s) pieces: the initial interval, then each update in order."""
    pieces = [(float("-inf"), initial_s)]
    for u in sorted(updates, key=lambda u: u.ts):
        pieces.append((u.ts, u.interval_s))
    return pieces


def interval_saving(
    facts: RunFacts, baseline: list[tuple[float, float]], candidate: list[tuple[float, float]]
) -> float:
    """Integral over the run of overhead_rate(baseline T) - overhead_rate(candidate T)."""
    cuts = sorted({facts.start_ts, facts.end_ts, *(t for t, _ in baseline + candidate)})
    cuts = [t for t in cuts if facts.start_ts <= t <= facts.end_ts]

    def at(schedule: list[tuple[float, float]], t: float) -> float:
        return [s for start, s in schedule if start <= t][-1]

    total = 0.0
    for a, b in zip(cuts, cuts[1:], strict=False):
        mid = (a + b) / 2
        total += (overhead_rate(facts, at(baseline, mid)) - overhead_rate(facts, at(candidate, mid))) * (
            b - a
        )
    return total


def detection_saving(baseline_at: float | None, candidate_at: float | None) -> float:
    """A hang detected sooner saves the difference (None: not detected, no saving modelled)."""
    if baseline_at is None or candidate_at is None:
        return 0.0
    return baseline_at - candidate_at


def rollback_saving(facts: RunFacts, baseline_step: int, candidate_step: int) -> float:
    """Rolling back to a newer checkpoint re-does fewer steps."""
    return (candidate_step - baseline_step) * facts.step_s


def waited_saving(
    waited_s: float, restart_s: float, fraction: float, shrink_s: float, grow_s: float, boundary_s: float
) -> float:
    """A loss the recording waited out (`waited_s`, detection to the first step at full
    size) that the candidate shrinks to `fraction` of the world for: the seconds of the
    whole job shrinking saves (negative: it loses)."""
    eta = max(0.0, waited_s - restart_s)
    return waited_s - shrink_loss_s(fraction, eta, shrink_s, grow_s, boundary_s)


def shrunk_saving(shrunk_cost_s: float, grown_after_s: float, restart_s: float, boundary_s: float) -> float:
    """A loss the recording shrank for at a measured cost (`shrunk_cost_s`: the shrink, the
    width lost at W', the grow), grown back `grown_after_s` after it, that the candidate
    waits out: the replacement came about half an interval before the grow-back; waiting
    saves the shrink's cost and loses that wait and a restart (negative: it loses)."""
    eta = max(0.0, grown_after_s - boundary_s)
    return shrunk_cost_s - (eta + restart_s)
