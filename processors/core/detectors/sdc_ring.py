"""The ring cross-rank check (seed R3, issue 14 item 2): every rank covered at every check.

At a check step every rank r computes its own microbatch and also recomputes the
microbatch of rank (r + offset) mod W with the same weights, and reports both values
(RingCheck). The edge r -> r + offset compares r's recomputation with r + offset's own
value. A device that is wrong the same way every time makes its own value wrong and
its recomputation of its neighbour wrong, so it fails BOTH edges it takes part in and is
named without a third rank; its neighbours each keep one passing edge. A lone failing
edge (a transient fault in one of the two computations, or two adjacent devices wrong
the same way) is bisected by the pair check's three-rank path (:mod:`.sdc_cross`) at this
ring's relative tolerance; a disagreement the third rank does not reproduce and that was
within reach of the noise tail of W comparisons is refuted there, not a rollback.

Each rank pays one extra microbatch per check, as in a pair check, but the whole job is
covered each time: a wrong device is found at the first check after its onset, one
interval at any world size (the rotating pair check needed W / 2 intervals).

The offset puts the neighbour on another node (a node's GPUs share a driver, a board
and often a fault) and rotates per check, so consecutive checks pair different nodes:
ranks_per_node x j for j = 1..nodes-1 in turn, skipping half the job (a ring of pairs
cannot tell which of two is wrong); on one node, 1..W-1 likewise.

Tolerance: edges compare different microbatches, so the gap is relative to the value.
It is z x 1.4826 x median |gap| over the passing edges of earlier checks (robust: the
two edges of a wrong device among W cannot move the median, and a failing edge is never
added), with z the larger of the policy's sigma and the normal quantile that keeps the
chance of any false edge among W under ``ring_false_edge_rate``. Until earlier checks
give ``cross_check_min_samples`` gaps, this check's own gaps join them; with fewer
still, the check is recorded and judges nothing (calibration).

Missing reports (a rank that died) never blame a neighbour: an edge needs both its
ends' reports, a rank is named only when both its edges were judged, and a ring that
is still incomplete ``ring_wait_steps`` job steps after its step and ``ring_wait_s`` after
its first report is judged on what it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from ....schemas import Command, Derived, Reason, ReasonCode, RingCheck, RunCrossRankCheck, SdcMismatch
from ..ids import derived_id
from ..outputs import node_of
from ..state import RunState
from .sdc_checks import mismatch, quarantine, third_rank, world_of
from .sdc_state import (
    MEDIAN_ABS_TO_SIGMA,
    PendingBisection,
    PendingRing,
    RingReport,
    SdcPolicy,
    SdcState,
    remember,
)

Output = Derived | Command

#: Lone failing edges bisected per check; more than this is not a few devices (the data,
#: the model, a software change) and is reported once, naming nobody.
MAX_BISECTIONS = 8


def ring_offset(world_size: int, ranks_per_node: int, k: int) -> int | None:
    """The k-th ring check's offset: a whole number of nodes, rotating over 1..nodes-1, so
    that every rank's neighbour is on another node (single node: 1..W-1). An offset of
    exactly half the job is skipped: it splits the ring into pairs, where a rank's two
    comparisons are with the same neighbour and cannot tell which of the two is wrong
    (with only two nodes, the ring gives up the other node instead). None under 2 ranks;
    two ranks are one such pair (a disagreement is bisected, and there is no third rank)."""
    if world_size < 2:
        return None
    if world_size == 2:
        return 1
    rpn = max(1, min(ranks_per_node, world_size))
    nodes = math.ceil(world_size / rpn)
    offsets = [rpn * j for j in range(1, nodes) if 2 * rpn * j != world_size]
    if not offsets:  # one node, or two full ones: any offset but half the job
        offsets = [o for o in range(1, world_size) if 2 * o != world_size]
    return offsets[k % len(offsets)]


@dataclass(frozen=True)
class _Cause:
    """What an SdcMismatch is derived from: the ring check as seen from one rank."""

    event_id: str
    step: int
    ts: float
    microbatch_id: str


def on_ring_check(state: SdcState, run: RunState, event: RingCheck, policy: SdcPolicy) -> list[Output]:
    """Collect one rank's report; judge the ring once every rank has reported."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    world = world_of(run)
    if not (0 <= event.rank < world and 0 <= event.peer_rank < world) or event.peer_rank == event.rank:
        return []  # a rank the run does not have, or not a ring edge: nothing to judge
    if ("ring", event.check_id, ()) in current.seen_checks:
        return []  # already judged: a late or redelivered report
    ring = current.rings.setdefault(event.check_id, PendingRing(event.step, first_ts=event.ts))
    ring.first_ts = min(ring.first_ts, event.ts)
    ring.step = min(ring.step, event.step)
    ring.reports.setdefault(
        event.rank, RingReport(event.own_value, event.peer_rank, event.peer_value, event.event_id, event.ts)
    )
    if len(ring.reports) < world:
        return []
    return _judge(state, run, event.check_id, policy)


def judge_due_rings(state: SdcState, run: RunState, step: int, ts: float, policy: SdcPolicy) -> list[Output]:
    """The job completed `step` at `ts`: rings still incomplete ``ring_wait_steps`` after
    their step and ``ring_wait_s`` after their first report are judged on the reports they
    have (by the events' steps and timestamps, not by the clock: pure)."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    due = [
        cid
        for cid, ring in current.rings.items()
        if step >= ring.step + policy.ring_wait_steps and ts >= ring.first_ts + policy.ring_wait_s
    ]
    outputs: list[Output] = []
    for check_id in due:
        outputs += _judge(state, run, check_id, policy)
    return outputs


def relative_gap(a: float, b: float) -> float:
    """|a - b| relative to b (absolute when b is 0); NaN when either is not finite."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan
    return abs(a - b) / abs(b) if b else abs(a - b)


def ring_tolerance(state: SdcState, policy: SdcPolicy, edges: int, gaps: list[float]) -> float | None:
    """The relative tolerance of a ring check with `edges` edges whose gaps are `gaps`
    (see the module doc), or None while calibrating."""
    earlier = state.ring_spread.values()
    if len(earlier) >= policy.cross_check_min_samples:
        pool = earlier
    else:
        pool = earlier + [g for g in gaps if math.isfinite(g)]
        if len(pool) < policy.cross_check_min_samples:
            return None
    pool.sort()
    median = pool[len(pool) // 2] if len(pool) % 2 else (pool[len(pool) // 2 - 1] + pool[len(pool) // 2]) / 2
    z = max(
        policy.cross_check_sigma, NormalDist().inv_cdf(1 - policy.ring_false_edge_rate / (2 * max(1, edges)))
    )
    return max(policy.cross_check_min_tolerance, z * MEDIAN_ABS_TO_SIGMA * median)


def _judge(state: SdcState, run: RunState, check_id: str, policy: SdcPolicy) -> list[Output]:
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    ring = current.rings.pop(check_id)
    remember(current.seen_checks, ("ring", check_id, ()))
    reports = ring.reports
    # edge r -> peer, keyed by its source r: r's recomputation against peer's own value
    gaps = {
        r: relative_gap(rep.peer_value, reports[rep.peer_rank].own)
        for r, rep in reports.items()
        if rep.peer_rank in reports
    }
    tolerance = ring_tolerance(state, policy, len(gaps), list(gaps.values()))
    if tolerance is None:  # calibrating: assume good hardware, judge nothing
        _sample(state, reports, list(gaps), policy)
        return []
    failing = {r for r, gap in gaps.items() if not gap <= tolerance}  # NaN fails
    source_of = {reports[r].peer_rank: r for r in gaps}  # edge target -> its source
    culprits = sorted(  # both edges failed, and they are with two different neighbours
        r for r in failing if source_of.get(r) in failing and source_of[r] != reports[r].peer_rank
    )
    named = set(culprits)
    lone = sorted(r for r in failing if r not in named and reports[r].peer_rank not in named)
    passing = [r for r in gaps if r not in failing]
    # vouched: a passing comparison, and no failing one that a named device does not explain
    doubtful = named | set(lone) | {reports[r].peer_rank for r in lone}
    state.vouch(sorted(({*passing} | {reports[r].peer_rank for r in passing}) - doubtful), ring.step)
    _sample(state, reports, passing, policy)
    ts = max(rep.ts for rep in reports.values())
    outputs: list[Output] = []
    for rank in culprits:
        outputs += _culprit(state, run, check_id, ring, rank, source_of[rank], gaps, tolerance, ts)
    if lone:
        outputs += _bisect(state, run, check_id, ring, lone, gaps, tolerance, ts)
    return outputs


def _sample(state: SdcState, reports: dict[int, RingReport], sources: list[int], policy: SdcPolicy) -> None:
    """Passing edges are good-hardware samples: relative gaps for the ring's tolerance,
    absolute ones for the three-rank bisection's (at most a window's worth per check)."""
    for r in sources[: policy.cross_check_window]:
        rep = reports[r]
        own = reports[rep.peer_rank].own
        gap = relative_gap(rep.peer_value, own)
        if math.isfinite(gap):
            state.ring_spread.add(gap, policy.cross_check_window)
            state.spread.add(abs(rep.peer_value - own), policy.cross_check_window)


def _culprit(
    state: SdcState,
    run: RunState,
    check_id: str,
    ring: PendingRing,
    rank: int,
    before: int,
    gaps: dict[int, float],
    tolerance: float,
    ts: float,
) -> list[Output]:
    after = ring.reports[rank].peer_rank
    node = node_of(run, rank)
    state.mismatches += 1
    cause = _Cause(derived_id("ring_check", run.run_id, check_id, rank), ring.step, ts, f"{check_id}/r{rank}")
    verified = state.cross_watermark(rank)
    since = f"step {verified}" if verified >= 0 else "never in this run"
    text = (
        f"ring check {check_id} at step {ring.step}: rank {rank} on {node or '?'} disagrees with both "
        f"ring neighbours: rank {before} recomputed its microbatch {gaps[before]:.3g} away from its own "
        f"value, and its recomputation of rank {after}'s is {gaps[rank]:.3g} away (relative; tolerance "
        f"{tolerance:.3g}). Wrong the same way in both, it is a deterministically wrong device, named "
        f"without a third rank; the last cross-rank check that covered it passed {since}"
    )
    found = mismatch(
        run,
        cause,
        method="ring",
        rank=rank,
        node=node,
        code=ReasonCode.CROSS_RANK_MISMATCH,
        text=text,
        tolerance=tolerance,
        deviation=min(gaps[before], gaps[rank]),
        caused_by=[ring.reports[rank].event_id, ring.reports[before].event_id],
    )
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    return [found, *quarantine(current, run, found)]


def _bisect(
    state: SdcState,
    run: RunState,
    check_id: str,
    ring: PendingRing,
    lone: list[int],
    gaps: dict[int, float],
    tolerance: float,
    ts: float,
) -> list[Output]:
    """Lone failing edges: the pair check's three-rank bisection on the edge's microbatch
    (the target's), once each; too many, or no third rank, names nobody."""
    current = state.for_attempt(run.attempt, run.resumed_from_step)
    world = world_of(run)
    if len(lone) > MAX_BISECTIONS:
        state.suspect(ring.step)
        text = (
            f"ring check {check_id} at step {ring.step}: {len(lone)} comparisons failed without a "
            f"device failing both of its own (tolerance {tolerance:.3g}): not a few wrong devices, "
            "nobody can be named"
        )
        return [
            _nobody(state, run, check_id, ring, text, tolerance, ts, [ring.reports[r].event_id for r in lone])
        ]
    outputs: list[Output] = []
    for source in lone:
        target = ring.reports[source].peer_rank
        third = third_rank(world, run.ranks_per_node, [source, target])
        where = (
            f"ring check {check_id} at step {ring.step}: rank {source}'s recomputation of rank {target}'s "
            f"microbatch is {gaps[source]:.3g} away from rank {target}'s own (relative; tolerance "
            f"{tolerance:.3g}), and neither failed its other comparison"
        )
        event_id = ring.reports[source].event_id
        if third is None:
            state.suspect(ring.step)
            text = f"{where}; no third rank to bisect"
            outputs.append(
                _nobody(state, run, f"{check_id}/r{target}", ring, text, tolerance, ts, [event_id])
            )
            continue
        microbatch = f"{check_id}/r{target}"
        excess = gaps[source] / tolerance
        current.bisecting[microbatch] = PendingBisection(event_id, ring.step, excess, tolerance)
        state.hold(ring.step)
        reason = Reason(
            code=ReasonCode.CROSS_RANK_MISMATCH,
            text=f"{where}: one of them is lying; bisecting with rank {third} on "
            f"{node_of(run, third) or '?'}",
        )
        outputs.append(
            RunCrossRankCheck(
                command_id=derived_id("run_cross_rank_check", event_id),
                run_id=run.run_id,
                attempt=run.attempt,
                ranks=[source, target, third],
                issued_ts=ts,
                reason=reason,
                caused_by=[event_id, ring.reports[target].event_id],
                step=max(0, ring.step),
                microbatch_id=microbatch,
                batch_rank=target,  # the edge's microbatch: the target's batch at the ring's step
            )
        )
    return outputs


def _nobody(
    state: SdcState,
    run: RunState,
    key: str,
    ring: PendingRing,
    text: str,
    tolerance: float,
    ts: float,
    caused_by: list[str],
) -> SdcMismatch:
    state.mismatches += 1
    cause = _Cause(derived_id("ring_check", run.run_id, key, "nobody"), ring.step, ts, key)
    return mismatch(
        run,
        cause,
        method="ring",
        rank=-1,
        node="",
        code=ReasonCode.CROSS_RANK_MISMATCH,
        text=text,
        tolerance=tolerance,
        caused_by=caused_by[:64],
    )
