"""Failure prediction, the detector (issue 46, seed §9.6): each node's failure precursors
against the fleet's own noise, turned into P(the node fails within the horizon).

Every GPU's health report folds into per-signal increments, bucketed by evaluation
(:func:`observe`: counters that only grow, flags that turn true, levels). Every
``check_every_s`` of event time (:func:`on_time`) each node is judged per signal:

- **against measured noise and its own past**: the fleet's per-GPU rate, share of active
  buckets and dispersion, smoothed (the policy's background the prior and the floor), and
  the node's own usual rate (a chronic steady count is not failing);
- **two tests per counter**: active buckets (a count the noise makes rare, p <= 1e-3) more
  often than the fleet's share allows (a binomial tail: a burst is one bucket, a failing
  part many), or the window's volume with each bucket capped at its active level; a level
  by its residual against the fleet at the same time, risen and now above its own usual;
- **a derived threshold**: the false alarms asked for per node-day shared over the
  signals, tests and evaluations (Bonferroni), the signal still going (its silence since
  the last count plausible at its window's rate: sparse XIDs are), and
  ``persist_checks`` evaluations in a row;
- **calibration**: P = 1 - (1 - p0) x prod(1 - q_s), p0 the node's share of the run's
  failure rate over the horizon, q_s a Beta prior per signal updated with the run's
  outcomes (a failure of the node within the horizon: hit; none: miss; drained: not counted).

The statistics are hazard_stats.py's, the fleet's noise hazard_fleet.py's. The output,
FailurePredicted, says each signal's numbers. It is made where the GPUs' reports are
seen (any shard); the drain is shard 0's decision (drain.py). Pure: time is the events' ts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ....schemas import RUN_LEVEL_RANK, FailurePredicted, Reason, ReasonCode
from ..ids import derived_id
from .hazard_fleet import NodeCounts, capped, fleet_noise, window_counts
from .hazard_levels import level_spread
from .hazard_state import (
    COUNTERS,
    DAY_S,
    FLAGS,
    LEVELS,
    SIGNALS,
    Episode,
    GpuTrack,
    HazardState,
    OwnRate,
    PredictionPolicy,
    hardware_xid,
)
from .hazard_stats import (
    ACTIVE_P,
    active_level,
    binomial_surprise,
    decayed_add,
    normal_surprise,
    still_going,
    tail_surprise,
)

#: Throttle reasons that count as a hardware slowdown report.
_HW_SLOWDOWN = frozenset({"hw_slowdown", "hw_power_brake_slowdown"})
#: A node is judged once it has this many buckets of its own history (or a whole window):
#: enough to know a chronically noisier GPU's usual, soon enough for a new spare.
_OWN_BUCKETS = 5
#: Re-predict a node already predicted when its probability rose by this much.
_RISE = 0.1


# --------------------------------------------------------------------------- folding


def observe(
    state: HazardState, rank: int, node: str, ts: float, fields: Mapping[str, Any], policy: PredictionPolicy
) -> None:
    """Fold one GPU health report (a GpuHealth's fields, or its row's dict)."""
    if not policy.enabled or not fields.get("present"):
        return
    track = state.gpus.get(rank)
    if track is None or track.node != node:
        track = state.gpus[rank] = GpuTrack(node, ts)
    if ts < track.last_ts:
        return  # reordered: the counters' deltas need their order
    track.last_ts = ts
    bucket = math.floor(ts / policy.check_every_s) * policy.check_every_s
    last = track.last
    for name in COUNTERS:
        value = _counter(fields, name)
        if value is None:
            continue
        before = last.get(name)
        last[name] = value
        if name == "hw_slowdown":
            increment = value  # per report, not cumulative
        elif before is None:
            increment = 0.0  # the first reading is the baseline
        else:
            increment = value - before if value >= before else value  # a reset counts from 0
        if increment > 0:
            _add(track, name, bucket, increment, policy)
            if name == "xid_errors" and hardware_xid(fields.get("last_xid")):
                # the report's XIDs are told by its newest code: exact at one XID a report
                _add(track, "xid_hardware", bucket, increment, policy)
    for name in FLAGS:
        flag = fields.get(name)
        if flag is None:
            continue
        before = last.get(name)
        last[name] = 1.0 if flag else 0.0
        if flag and before == 0.0:  # turned true (the first reading is the baseline)
            _add(track, name, bucket, 1.0, policy)
    for name in LEVELS:
        level = fields.get(name)
        if level is None:
            continue
        sums = track.levels.get(name)
        if sums is None:
            sums = track.levels[name] = deque()
        if sums and sums[-1][0] == bucket:
            sums[-1][1] += level
            sums[-1][2] += 1
        else:
            sums.append([bucket, float(level), 1.0])
        while sums and sums[0][0] <= bucket - policy.window_s:
            sums.popleft()
        fleet = state.fleet_levels.setdefault(name, {}).setdefault(bucket, [0.0, 0.0])
        fleet[0] += level
        fleet[1] += 1.0


def _counter(fields: Mapping[str, Any], name: str) -> float | None:
    if name == "xid_hardware":  # reported with the XIDs (its increments: observe)
        return None if fields.get("xid_errors") is None else 0.0
    if name == "hw_slowdown":
        reasons = fields.get("throttle_reasons")
        return None if reasons is None else float(bool(_HW_SLOWDOWN.intersection(reasons)))
    value = fields.get(name)
    return None if value is None else float(value)


def _add(track: GpuTrack, name: str, bucket: float, increment: float, policy: PredictionPolicy) -> None:
    buckets = track.buckets.get(name)
    if buckets is None:
        buckets = track.buckets[name] = deque()
    if buckets and buckets[-1][0] == bucket:
        buckets[-1] = (bucket, buckets[-1][1] + increment)
    else:
        buckets.append((bucket, increment))
    while buckets and buckets[0][0] <= bucket - policy.window_s:
        buckets.popleft()


# --------------------------------------------------------------------------- evaluating


def threshold(policy: PredictionPolicy) -> float:
    """-log10 of the p-value a signal's window must beat: the false alarms asked for per
    node-day, shared over the signals and the day's evaluations."""
    tests = 3 * len(SIGNALS) * DAY_S / policy.check_every_s  # a counter's three: activity, volume, streak
    return -math.log10(policy.false_alarms_per_node_day / tests)


def due(state: HazardState, ts: float, policy: PredictionPolicy) -> bool:
    return policy.enabled and ts >= state.checked_ts + policy.check_every_s


def on_time(
    state: HazardState,
    run_id: str,
    attempt: int,
    ts: float,
    base_hazard_per_s: float,
    policy: PredictionPolicy,
    racks: Mapping[str, str] | None = None,
) -> list[FailurePredicted]:
    """Evaluate every node if an evaluation is due at `ts`. `base_hazard_per_s`: one
    node's share of the run's failure rate (p0's rate)."""
    if not due(state, ts, policy):
        return []
    first = state.checked_ts == 0.0
    state.checked_ts = math.floor(ts / policy.check_every_s) * policy.check_every_s
    if first:
        return []  # the window has just begun
    _expire(state, ts, policy)
    for buckets in state.fleet_levels.values():
        for bucket in [b for b in buckets if b <= state.checked_ts - policy.window_s - policy.check_every_s]:
            del buckets[bucket]
    nodes = window_counts(state, ts, policy)
    standing = _standing_out(state, nodes, ts, policy)
    outputs: list[FailurePredicted] = []
    p0 = 1.0 - math.exp(-base_hazard_per_s * policy.horizon_s)
    for node, found in sorted(standing.items()):
        made = _predict(state, run_id, attempt, node, found, ts, p0, policy)
        if made is not None:
            outputs.append(made)
    return outputs


def _streak(per: Mapping[float, float], level: float, latest_bucket: float, every: float) -> int:
    """Buckets in a row at or over `level`, up to the latest."""
    run, bucket = 0, latest_bucket
    while per.get(bucket, 0.0) >= level:
        run, bucket = run + 1, bucket - every
    return run


def _own(
    state: HazardState, node: str, name: str, latest: float, fleet: float, policy: PredictionPolicy
) -> tuple[float, bool]:
    """The node's own usual rate of the signal (per second) and whether it has history
    enough to be judged (_OWN_BUCKETS buckets, or a window). The usual is its history
    before the window (OwnRate), or, while that is shorter than a window (it joined within
    two), everything so far. The bucket that just closed then awaits its
    turn to join the past: whole while the node is new, else capped at the count that would
    make it active (a burst or a climb must not become its own usual: a steady chronic
    count does), and not at all while the signal stands out on the node. It starts at the
    fleet's rate."""
    every = policy.check_every_s
    own = state.own.get((node, name))
    if own is None:
        own = state.own[(node, name)] = OwnRate()
    count, seconds = own.past() if own.seconds >= policy.window_s else own.everything(every)
    usual = count / seconds if seconds > 0 else fleet / every
    known = seconds >= min(policy.window_s, _OWN_BUCKETS * every)
    frozen = (node, name) in state.episodes
    own.recent.append(
        -1.0 if frozen else min(latest, active_level(max(fleet, usual * every))) if known else latest
    )
    if len(own.recent) > policy.window_s / every:  # the window's oldest joins the past
        leaving = own.recent.popleft()
        if leaving >= 0:
            own.count, own.seconds = decayed_add(own.count, own.seconds, leaving, every, policy.own_history_s)
    return usual, known


def _standing_out(
    state: HazardState, nodes: dict[str, NodeCounts], ts: float, policy: PredictionPolicy
) -> dict[str, list[tuple[Episode, str]]]:
    """Update every (node, signal) episode at this evaluation; the nodes with at least one
    episode persistent enough to predict, each with its episodes and their sentences.

    A counter or flag stands out on a node when its buckets are active (a count its noise
    makes rare, p <= ACTIVE_P) more often over the window than the fleet's buckets are
    (a binomial tail past the threshold), and it is still going (the silence since its last
    active bucket is plausible at the window's rate of them: still_going): so a burst,
    however large, is one active bucket, and a failing part is many, in a row or every few."""
    every = policy.check_every_s
    latest_bucket = state.checked_ts - every
    noise = fleet_noise(state, nodes, policy)
    spread = level_spread([c.rises for c in nodes.values()], policy)
    bar = threshold(policy)
    active: set[tuple[str, str]] = set()
    out: dict[str, list[tuple[Episode, str]]] = {}
    for node, counts in nodes.items():
        for name in counts.gpus:
            if name not in noise:
                continue
            per = counts.buckets.get(name, {})
            rate, share = noise[name]
            gpus = counts.gpus[name]
            fleet = rate * gpus * every
            latest = per.get(latest_bucket, 0.0)
            usual, known = _own(state, node, name, latest, fleet, policy)
            if not per or not known:
                continue  # nothing in the window, or the node has no past of its own yet
            if name in policy.decisive:
                rank, _ = counts.top_gpu(name)
                text = (
                    f"{name}: on rank {rank} of {node} {(latest_bucket - max(per)) / 60:.0f} min ago, "
                    f"a verdict on the part by itself (the policy's decisive flags)"
                )
                active.add((node, name))
                _episode(state, node, name, bar, ts, text, out, policy)
                continue
            closed = max(1, round(counts.span.get(name, every) / every))
            level = active_level(max(fleet, usual * every))
            silent = round((latest_bucket - max(per)) / every)
            if not still_going(capped(counts, name, level) / closed, silent):
                continue  # it stopped: a burst, or a part that recovered
            hot = sum(1 for v in per.values() if v >= level)
            last_hot = max((b for b, v in per.items() if v >= level), default=None)
            hot_silent = closed if last_hot is None else round((latest_bucket - last_hot) / every)
            going = still_going(hot / closed, hot_silent)
            # activity counts the runs of active buckets, against the share of the fleet's
            # buckets that start one: noise that clusters over minutes is one run, not five
            # independent surprises (a steady climb is one run too: the streak finds it)
            follow = max(share, state.follow.get(name, share))
            starts = sum(1 for b, v in per.items() if v >= level and per.get(b - every, 0.0) < level)
            start_share = max(ACTIVE_P, share * (1.0 - follow))
            activity = binomial_surprise(starts, max(closed, starts), start_share) if going else 0.0
            volume, why = _volume(state, counts, name, per, usual, level, latest_bucket, policy)
            # a streak: r active buckets in a row up to now, against the fleet's share of
            # active buckets and its measured chance that one follows another (a climb
            # keeps every bucket active; noise, even clustered, rarely does for long)
            run = _streak(per, level, latest_bucket, every)
            streak = -math.log10(share) - (run - 1) * math.log10(follow) if run >= 2 else 0.0
            evidence = max(activity, volume, streak)
            if evidence < bar:
                continue
            if streak == evidence and streak > max(activity, volume):
                why = (
                    f"its last {run} {every / 60:.0f}-min buckets in a row over {level:g}, where the "
                    f"fleet's buckets are {share:.2%} active and {follow:.1%} of those followed by another"
                )
            rank, top = counts.top_gpu(name)
            text = (
                f"{name}: {counts.count(name):g} in the last {closed * every / 60:.0f} min on {node}'s "
                f"{gpus} GPUs (rank {rank}: {top:g}), {latest:g} in the last {every / 60:.0f} min; "
                + (
                    f"{hot} of its {closed} {every / 60:.0f}-min buckets over {level:g} (the fleet's "
                    f"noise, {fleet:.2g} a bucket, or its own usual {usual * every:.2g}) in {starts} "
                    f"run(s), where {start_share:.2%} of the fleet's buckets start one"
                    if activity >= max(volume, streak)
                    else why
                )
                + f": p <= 1e-{evidence:.0f}"
            )
            active.add((node, name))
            _episode(state, node, name, evidence, ts, text, out, policy)
        for name, drifts in counts.rises.items():
            rise_at, rise_scale, now_at, now_scale = spread.get(name, (0.0, 1.0, 0.0, 1.0))
            z, rise, now, rank = max(
                (min((r - rise_at) / rise_scale, (n - now_at) / now_scale), r, n, k) for r, n, k in drifts
            )
            evidence = normal_surprise(z) - math.log10(len(drifts))  # the node's hottest of its GPUs
            if evidence < bar:
                continue
            text = (
                f"{name}: rank {rank} of {node} {now:+.3g} above its own usual against the fleet, up "
                f"{rise:.3g} over the last {policy.window_s / 60:.0f} min (the fleet's GPUs: above their "
                f"usual {now_at:+.2g} ± {now_scale:.2g}, "
                f"rises {rise_at:+.2g} ± {rise_scale:.2g}): z {z:.1f} on both"
            )
            active.add((node, name))
            _episode(state, node, name, evidence, ts, text, out, policy)
    for key in [k for k in state.episodes if k not in active]:
        ended = state.episodes.pop(key)
        if ended.predicted and not ended.drained:
            state.closed.append(ended)  # its outcome is known when the horizon has passed
    return out


def _volume(
    state: HazardState,
    counts: NodeCounts,
    name: str,
    per: Mapping[float, float],
    usual: float,
    level: float,
    latest_bucket: float,
    policy: PredictionPolicy,
) -> tuple[float, str]:
    """The volume test: the node's window count, each bucket capped at its active level
    (a burst's excess left out), against the fleet's likewise capped noise and its own
    usual, if the count is not falling (its recent half holds at least its older half);
    its surprise and sentence."""
    floor = policy.background_per_s(name)  # the prior, and the floor
    rate, dispersion = state.volume.get(name, (floor, 1.0))
    rate = max(rate, floor)
    middle = latest_bucket - policy.window_s / 2
    recent = sum(min(v, level) for b, v in per.items() if b > middle)
    count = capped(counts, name, level)
    if recent < count - recent:
        return 0.0, ""  # falling: its recent half holds less than its older half
    exposure = counts.gpus[name] * counts.span[name]
    expected = max(rate * exposure, usual * counts.span[name])
    why = (
        f"{count:g} with each bucket capped at {level:g}, where the fleet's noise and its own usual "
        f"expect {expected:.2g} (dispersion {dispersion:.2g})"
    )
    return tail_surprise(count, expected, dispersion), why


def _episode(
    state: HazardState,
    node: str,
    name: str,
    evidence: float,
    ts: float,
    text: str,
    out: dict[str, list[tuple[Episode, str]]],
    policy: PredictionPolicy,
) -> None:
    episode = state.episodes.get((node, name))
    if episode is None:
        episode = state.episodes[(node, name)] = Episode(name, node, ts)
    else:
        episode.streak += 1
    episode.evidence = evidence
    if episode.streak >= policy.persist_checks:
        out.setdefault(node, []).append((episode, f"{text}; {episode.streak} evaluations in a row"))


def precision(state: HazardState, signal: str, policy: PredictionPolicy) -> tuple[float, int, int]:
    """q_s: the share of the signal's episodes a failure followed within the horizon (the
    Beta prior's mean updated with the run's outcomes), and the run's hits and misses."""
    hits, misses = state.outcomes.get(signal, [0, 0])
    a, b = policy.precision_prior.get(signal, (1.0, 9.0))
    return (a + hits) / (a + b + hits + misses), hits, misses


def _predict(
    state: HazardState,
    run_id: str,
    attempt: int,
    node: str,
    found: list[tuple[Episode, str]],
    ts: float,
    p0: float,
    policy: PredictionPolicy,
) -> FailurePredicted | None:
    found.sort(key=lambda item: -item[0].evidence)
    survive = 1.0 - p0
    signals: list[str] = []
    for episode, text in found:
        q, hits, misses = precision(state, episode.signal, policy)
        survive *= 1.0 - q
        episode.predicted = True
        a, b = policy.precision_prior.get(episode.signal, (1.0, 9.0))
        signals.append(
            f"{text}; a failure followed {q:.0%} of such episodes within {policy.horizon_s / 60:.0f} min "
            f"(prior {a:g}/{a + b:g}, this run {hits}/{hits + misses})"
        )
    probability = 1.0 - survive
    last = state.predicted.get(node)
    if last is not None and probability < last + _RISE:
        return None
    state.predicted[node] = probability
    strongest = found[0][0]
    return FailurePredicted(
        event_id=derived_id("failure_predicted", run_id, node, attempt, int(ts // policy.check_every_s)),
        run_id=run_id,
        attempt=attempt,
        rank=RUN_LEVEL_RANK,
        node=node,
        step=-1,
        ts=ts,
        reason=Reason(
            code=ReasonCode.FAILURE_PREDICTED,
            text=f"{node}: P(failure within {policy.horizon_s / 60:.0f} min) {probability:.0%} from "
            f"{len(found)} precursor(s), the strongest {strongest.signal} (base rate {p0:.2%})",
        ),
        probability=probability,
        horizon_s=policy.horizon_s,
        signals=signals[:32],
        evidence=min(strongest.evidence, 1e6),
    )


# --------------------------------------------------------------------------- outcomes


def on_failure(state: HazardState, node: str, ts: float, policy: PredictionPolicy) -> None:
    """A failure of `node` (an unplanned interruption naming it): each of its predicted
    episodes within the horizon before it is a hit."""
    for episode in [*state.episodes.values(), *state.closed]:
        if (
            episode.node == node
            and episode.predicted
            and not episode.drained
            and ts - episode.first_ts <= policy.horizon_s
        ):
            state.outcomes.setdefault(episode.signal, [0, 0])[0] += 1
            episode.drained = True  # counted: never again
    state.closed = [e for e in state.closed if not e.drained]
    state.predicted.pop(node, None)


def on_drained(state: HazardState, node: str) -> None:
    """`node` is drained: its episodes' outcomes will never be known (not counted)."""
    for episode in [*state.episodes.values(), *state.closed]:
        if episode.node == node:
            episode.drained = True
    state.closed = [e for e in state.closed if not e.drained]


def _expire(state: HazardState, ts: float, policy: PredictionPolicy) -> None:
    """Episodes whose horizon passed without a failure: misses. One still open starts again
    (a node that keeps standing out without failing counts a miss per horizon)."""
    for episode in state.episodes.values():
        if episode.predicted and not episode.drained and ts - episode.first_ts > policy.horizon_s:
            state.outcomes.setdefault(episode.signal, [0, 0])[1] += 1
            episode.first_ts = ts
    kept: list[Episode] = []
    for episode in state.closed:
        if ts - episode.first_ts > policy.horizon_s:
            state.outcomes.setdefault(episode.signal, [0, 0])[1] += 1
        else:
            kept.append(episode)
    state.closed = kept
