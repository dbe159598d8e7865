"""The rack / placement-group slowdown detector (issue 14 item 1).

Per-rank robust z cannot see a whole rack a few percent slow: its ranks barely move the
median of thousands, and each rank's z stays well inside the jitter. The rack as a whole
can: the median of its 128 ranks has about a tenth of one rank's spread. So, per
evaluated step (the straggler detector decides when a step is complete and hands over
its compute times, measured BEFORE the collective):

    m_g   = median compute_s of group g's ranks           (a rack, or a declared placement group)
    ref   = median of the racks' m_g                      (robust to a slow rack or two)
    e_g   = m_g / ref - 1                                 (the group's relative excess)
    noise = median over the last `noise_window` steps of the robust spread of e over the
            racks (1.4826 x MAD), scaled to one rank: spread x sqrt(typical group size)
    thr_g = max(min_slowdown, noise_sigma x noise / sqrt(ranks of g reporting))

A step is slow for g when e_g > thr_g; `consecutive_steps` slow steps (gaps of up to
`max_gap_steps` steps allowed, as in straggler.py) flag the group once; `clear_steps`
consecutive steps under `clear_fraction` x thr_g clear it (hysteresis). The floor
dominates at rack size (noise ~0.35% per step for 128 ranks at 3% jitter): a group
slower than the floor by a few noise widths is found after `consecutive_steps` steps,
one slow node of a rack (8 of 128 ranks) moves the rack median by ~0.25% and never
flags it (the per-rank detector owns it).

Diagnosis, from the group's nodes' GPU health: median temperature over the thermal limit,
or at least half the nodes hot, throttled or power-capped -> ENVIRONMENTAL, alert
facilities (a page, rule `facilities`); NIC utilisation over the band -> network
contention; otherwise unknown. A group finding never evicts or quarantines anything.

Sharded runs (schemas/sharding.py): no shard has the run-wide reference, so each
non-coordinator shard summarises its groups per evaluated step (median and count per
group, and every `health_every_steps` steps a health digest per group) in one
:class:`GroupComputeTimes` record forwarded to shard 0, which merges the parts of each
step (all shards in, or `max_pending_steps` newer steps seen) and judges it. A group cut
by a shard boundary (a placement group across shards) is merged as the count-weighted
median of its parts' medians: an approximation, exact for the racks (a shard is a
multiple of the rack).

Pure: no clock, no I/O; per-step buffers are dropped once the step is judged; the
per-step work is a few numpy calls per distinct group size (bench/bench_group_slowdown.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ....schemas import (
    Derived,
    Diagnosis,
    Envelope,
    GroupComputeTimes,
    GroupSlowdownCleared,
    GroupSlowdownFlagged,
    Reason,
    ReasonCode,
    RunStarted,
    StragglerAction,
)
from ....schemas.sharding import shard_count
from ..decisions.paging import page
from ..ids import derived_id
from .diagnosis import node_health
from .diagnosis_state import DiagnosisPolicy, HealthState
from .group_state import (
    _NEVER,
    PLACEMENT_GROUP,
    RACK,
    GroupSlowdownPolicy,
    GroupState,
    _Flag,
    _Group,
    _SizeClass,
)

if TYPE_CHECKING:  # state.py embeds this module's state: no import cycle at run time
    from ..state import RunState

MAD_TO_SIGMA = 1.4826


# --------------------------------------------------------------------------- layout


def on_run_started(state: GroupState, run: RunState, event: RunStarted, policy: GroupSlowdownPolicy) -> None:
    """The run's groups from its RunStarted: racks (node -> rack) and declared placement
    groups; each group's ranks from the node order (rank r is on nodes[r // ranks_per_node])."""
    if event.attempt < state.attempt or (event.attempt == state.attempt and state.groups):
        return  # an older attempt's, or a second report of this one's start: streaks stand
    _reset(state, event.attempt)
    if not policy.enabled:
        return
    rpn, world = event.ranks_per_node, event.world_size
    where = {node: i for i, node in enumerate(event.nodes)}
    members: dict[tuple[str, str], list[str]] = {}
    for node in event.nodes:
        rack = event.racks.get(node)
        if rack is not None:
            members.setdefault((RACK, rack), []).append(node)
    for name, nodes in sorted(event.placement_groups.items()):
        members[(PLACEMENT_GROUP, name)] = [n for n in nodes if n in where]
    owned = run.owned() or range(world)
    groups: list[_Group] = []
    for (kind, name), nodes in members.items():
        if not nodes:
            continue
        first = np.fromiter((where[n] * rpn for n in nodes), np.int64, len(nodes))
        ranks = (first[:, None] + np.arange(rpn, dtype=np.int64)).ravel()
        ranks = ranks[ranks < world]
        local = ranks[(ranks >= owned.start) & (ranks < owned.stop)]
        groups.append(_Group(name, kind, nodes, int(ranks.size), local))
    state.groups = groups
    state.index = {f"{g.kind}:{g.name}": i for i, g in enumerate(groups)}
    state.is_rack = np.array([g.kind == RACK for g in groups], np.bool_)
    state.sizes = np.array([g.size for g in groups], np.float64)
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        if g.local.size:
            by_size.setdefault(int(g.local.size), []).append(i)
    state.classes = []
    for size, ids in sorted(by_size.items()):
        perm = np.concatenate([groups[i].local for i in ids])
        state.classes.append(_SizeClass(np.array(ids, np.int64), perm, size, int(perm.max())))
    state.shards = shard_count(world, run.shard_ranks) if run.shard_ranks else 1
    n = len(groups)
    state.run_len, state.last_slow = [0] * n, [_NEVER] * n
    state.onset, state.excess_sum = [-1] * n, [0.0] * n


def _reset(state: GroupState, attempt: int) -> None:
    state.__dict__.update(GroupState(attempt=attempt, judged=state.judged, late=state.late).__dict__)


# --------------------------------------------------------------------------- per shard


def summarise(state: GroupState, values: np.ndarray, policy: GroupSlowdownPolicy) -> tuple[np.ndarray, ...]:
    """(group indices, medians, counts) of this shard's groups for one step's compute times
    (`values` by rank, NaN where a rank did not report); groups with fewer than
    `min_group_ranks` reports are left out."""
    ids, medians, counts = [], [], []
    for c in state.classes:
        if c.top >= values.size:
            continue  # ranks beyond what the straggler buffers hold: nothing reported there
        block = values[c.perm].reshape(-1, c.size)
        missing = np.isnan(block)
        if missing.any():
            count = c.size - missing.sum(axis=1)
            keep = count >= policy.min_group_ranks
            if not keep.any():
                continue
            # Rows sorted put NaN last: each row's median is at its own count's middle
            # (np.nanmedian takes a masked-array path many times slower).
            rows, count = np.sort(block[keep], axis=1), count[keep]
            lo = np.take_along_axis(rows, ((count - 1) // 2)[:, None], axis=1)[:, 0]
            hi = np.take_along_axis(rows, (count // 2)[:, None], axis=1)[:, 0]
            ids.append(c.groups[keep])
            medians.append((lo + hi) / 2)
            counts.append(count)
            continue
        ids.append(c.groups)
        medians.append(_row_medians(block))
        counts.append(np.full(block.shape[0], c.size))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(medians), np.concatenate(counts)


def _row_medians(block: np.ndarray) -> np.ndarray:
    """Each row's median, `block` reordered in place (np.median's copies and NaN checks cost
    several times more, per size class and step)."""
    k = block.shape[1] // 2
    block.partition(k, axis=1)  # one kth: a second doubles the cost
    if block.shape[1] % 2:
        return block[:, k].copy()
    return (block[:, k] + block[:, :k].max(axis=1)) / 2


def _median(x: np.ndarray) -> float:
    return float(_row_medians(x.reshape(1, -1))[0]) if x.size else math.nan


def on_local_step(
    state: GroupState,
    run: RunState,
    step: int,
    values: np.ndarray,
    trigger: Envelope,
    policy: GroupSlowdownPolicy,
    diagnosis_policy: DiagnosisPolicy,
    reported: int | None = None,
) -> list[Derived | GroupComputeTimes]:
    """One step evaluated by this state's straggler detector (`reported`: how many ranks
    reported it, when known): on the coordinator its groups' part is judged with the
    others'; on another shard it becomes the GroupComputeTimes to forward to shard 0. A step
    too thinly reported for any group to count costs nothing (a run whose ranks mostly do
    not report: the month-long simulation has one reporting rank)."""
    if not state.groups or trigger.attempt != state.attempt:
        return []
    if reported is not None and reported < policy.min_group_ranks:
        return []
    ids, medians, counts = summarise(state, values, policy)
    if run.coordinator:
        part = (ids, medians, counts)
        return list(_add_part(state, run, step, run.shard, part, trigger, policy, diagnosis_policy))
    names = [f"{state.groups[i].kind}:{state.groups[i].name}" for i in ids.tolist()]
    health = {}
    if step % policy.health_every_steps == 0:
        for i in _suspects(ids, medians, policy):
            digest = _health_digest(run.health, state.groups[i].nodes, diagnosis_policy)
            if digest:
                health[f"{state.groups[i].kind}:{state.groups[i].name}"] = digest
    return [
        GroupComputeTimes(
            event_id=derived_id("group_compute_times", run.run_id, state.attempt, run.shard, step),
            run_id=run.run_id,
            attempt=state.attempt,
            rank=-1,
            node="",
            step=step,
            ts=trigger.ts,
            shard=run.shard,
            groups=names,
            medians=medians.tolist(),
            counts=counts.tolist(),
            health=health,
        )
    ]


def _suspects(ids: np.ndarray, medians: np.ndarray, policy: GroupSlowdownPolicy) -> list[int]:
    """The groups of a shard whose health shard 0 may need: those over half the floor above
    the shard's own median group (a shard of fewer than `min_groups` groups: all of them).
    Digesting every group's nodes every few steps would cost more than the detector."""
    if ids.size < policy.min_groups:
        return sorted(set(ids.tolist()))
    local = _median(medians.copy())
    return sorted(set(ids[medians > local * (1 + policy.min_slowdown / 2)].tolist()))


def on_summary(
    state: GroupState,
    run: RunState,
    event: GroupComputeTimes,
    policy: GroupSlowdownPolicy,
    diagnosis_policy: DiagnosisPolicy,
) -> list[Derived]:
    """Shard 0: another shard's summary of one step."""
    if event.attempt != state.attempt or not state.groups:
        return []
    ids = np.array([state.index.get(name, -1) for name in event.groups], np.int64)
    known = ids >= 0
    for name, digest in event.health.items():
        if name in state.index:
            state.health[state.index[name]] = dict(digest)
    part = (ids[known], np.asarray(event.medians)[known], np.asarray(event.counts, np.int64)[known])
    return _add_part(state, run, event.step, event.shard, part, event, policy, diagnosis_policy)


# --------------------------------------------------------------------------- coordinator


def _add_part(
    state: GroupState,
    run: RunState,
    step: int,
    shard: int,
    part: tuple[np.ndarray, ...],
    trigger: Envelope,
    policy: GroupSlowdownPolicy,
    diagnosis_policy: DiagnosisPolicy,
) -> list[Derived]:
    if step <= state.judged_through:
        state.late += 1
        return []
    state.pending.setdefault(step, {})[shard] = part  # type: ignore[assignment]
    state.newest_step = max(state.newest_step, step)
    outputs: list[Derived] = []
    while state.pending:
        oldest = min(state.pending)
        parts = state.pending[oldest]
        if len(parts) < state.shards and state.newest_step - oldest < policy.max_pending_steps:
            break
        del state.pending[oldest]
        state.judged_through = oldest
        outputs += _judge(state, run, oldest, list(parts.values()), trigger, policy, diagnosis_policy)
    return outputs


def _merge(state: GroupState, parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Per group: its median and reporting ranks over the parts (NaN / 0 where absent). A group
    in several parts gets the count-weighted median of their medians."""
    n = len(state.groups)
    medians, counts = np.full(n, np.nan), np.zeros(n)
    ids = np.concatenate([p[0] for p in parts])
    if np.unique(ids).size == ids.size:  # no group cut by a shard boundary (racks never are)
        medians[ids] = np.concatenate([p[1] for p in parts])
        counts[ids] = np.concatenate([p[2] for p in parts])
        return medians, counts
    split: dict[int, list[tuple[float, float]]] = {}
    for ids, m, c in parts:
        for i, mi, ci in zip(ids.tolist(), m.tolist(), c.tolist(), strict=True):
            split.setdefault(i, []).append((mi, ci))
    for i, pieces in split.items():
        pieces.sort()
        total = sum(c for _, c in pieces)
        acc = 0.0
        for k, (mi, ci) in enumerate(pieces):
            acc += ci
            if acc * 2 > total or (acc * 2 == total and k + 1 == len(pieces)):
                medians[i] = mi
                break
            if acc * 2 == total:  # the halves meet between two parts: their mean, as a median
                medians[i] = (mi + pieces[k + 1][0]) / 2
                break
        counts[i] = total
    return medians, counts


def _judge(
    state: GroupState,
    run: RunState,
    step: int,
    parts: list[tuple[np.ndarray, ...]],
    trigger: Envelope,
    policy: GroupSlowdownPolicy,
    diagnosis_policy: DiagnosisPolicy,
) -> list[Derived]:
    medians, counts = _merge(state, parts)
    valid = counts >= policy.min_group_ranks
    ref_mask = valid & state.is_rack
    if np.count_nonzero(ref_mask) < policy.min_groups:
        ref_mask = valid
    if np.count_nonzero(ref_mask) < policy.min_groups:
        return []
    reference = _median(medians[ref_mask])
    if reference <= 0:
        return []
    state.judged += 1
    excess = medians / reference - 1
    ref_excess = excess[ref_mask]
    spread = MAD_TO_SIGMA * _median(np.abs(ref_excess - _median(ref_excess.copy())))
    if state.noise.maxlen != policy.noise_window:
        state.noise = deque(state.noise, maxlen=policy.noise_window)
    state.noise.append(spread * math.sqrt(_median(counts[ref_mask])))
    noise = statistics.median(state.noise)  # per-rank equivalent spread
    with np.errstate(divide="ignore", invalid="ignore"):
        threshold = np.maximum(policy.min_slowdown, policy.noise_sigma * noise / np.sqrt(counts))
    slow = np.flatnonzero(valid & (excess > threshold)).tolist()

    now, hits = state.judged, []
    for i in slow:
        e = float(excess[i])
        if now - state.last_slow[i] - 1 > policy.max_gap_steps:
            state.run_len[i], state.onset[i], state.excess_sum[i] = 1, step, e
        else:
            state.run_len[i] += 1
            state.excess_sum[i] += e
        state.last_slow[i] = now
        if state.run_len[i] >= policy.consecutive_steps and i not in state.flagged:
            hits.append(i)
    outputs: list[Derived] = []
    for i, flag in list(state.flagged.items()):
        if not valid[i]:
            continue
        flag.steps += 1
        in_band = excess[i] < policy.clear_fraction * threshold[i]
        flag.in_band = flag.in_band + 1 if in_band else 0
        if flag.in_band >= policy.clear_steps:
            del state.flagged[i]
            state.environmental.discard(i)
            outputs.append(_cleared(state, run, i, flag, step, float(excess[i]), trigger))
    for i in hits:
        outputs += _flag(
            state,
            run,
            i,
            step,
            reference,
            float(threshold[i]),
            (policy.noise_sigma, noise),
            int(counts[i]),
            trigger,
            diagnosis_policy,
        )
    return outputs


def _health_digest(health: HealthState, nodes: list[str], policy: DiagnosisPolicy) -> dict[str, float]:
    """The group's health: its nodes' median temperature, the share of reporting nodes hot
    (over the limit), throttled or power-capped, and the median NIC utilisation."""
    temps, nics, hot, reporting = [], [], 0, 0
    for node in nodes:
        h = node_health(health, node)
        if h is None:
            continue
        reporting += 1
        if h.temperature_c is not None:
            temps.append(h.temperature_c)
        if h.nic_utilization is not None:
            nics.append(h.nic_utilization)
        hot += bool(
            h.capped
            or h.throttled
            or (h.temperature_c is not None and h.temperature_c > policy.thermal_limit_c)
        )
    if not reporting:
        return {}
    digest = {"nodes_reporting": float(reporting), "hot_share": hot / reporting}
    if temps:
        digest["median_temp_c"] = statistics.median(temps)
    if nics:
        digest["nic_median"] = statistics.median(nics)
    return digest


_Verdict = tuple[Diagnosis, StragglerAction, ReasonCode, str]


def _diagnose(digest: dict[str, float], g: _Group, policy: DiagnosisPolicy) -> _Verdict:
    """Why the group is slow, from its health digest; never an eviction."""
    limit, band = policy.thermal_limit_c, policy.nic_utilization_band
    if not digest:
        why = "no GPU health reported by its nodes: cause unknown, a human looks (never evicted)"
        return Diagnosis.UNKNOWN, StragglerAction.NONE, ReasonCode.UNKNOWN_CAUSE, why
    temp, nic = digest.get("median_temp_c"), digest.get("nic_median")
    hot, reporting = digest["hot_share"], int(digest["nodes_reporting"])
    if (temp is not None and temp > limit) or hot >= 0.5:
        temps = f"a median {temp:.1f} C (limit {limit:g} C)" if temp is not None else "no temperature"
        why = (
            f"its nodes are at {temps}, {round(hot * reporting)} of {reporting} hot, throttled or "
            f"power-capped: the environment of {g.name} (cooling, power), not its nodes; evicting "
            "would move the symptom. Alert facilities, do not evict"
        )
        return Diagnosis.ENVIRONMENTAL, StragglerAction.ALERT_FACILITIES, ReasonCode.ENVIRONMENTAL, why
    if nic is not None and nic > band:
        why = (
            f"its nodes' shared NICs are at a median {nic:.0%} utilisation (band {band:.0%}): its network "
            "is contended; every node of it is affected, so no eviction: change placement"
        )
        return Diagnosis.NETWORK_CONTENTION, StragglerAction.NONE, ReasonCode.NETWORK_CONTENTION, why
    why = "GPU health is normal (not hot, NICs within band): cause unknown, a human looks (never evicted)"
    return Diagnosis.UNKNOWN, StragglerAction.NONE, ReasonCode.UNKNOWN_CAUSE, why


def _flag(
    state: GroupState,
    run: RunState,
    i: int,
    step: int,
    reference: float,
    threshold: float,
    measured: tuple[float, float],
    reporting: int,
    trigger: Envelope,
    policy: DiagnosisPolicy,
) -> list[Derived]:
    noise_sigma, noise = measured  # the policy's multiple, the per-rank noise measured
    g = state.groups[i]
    streak, onset = state.run_len[i], state.onset[i]
    slowdown = 1 + state.excess_sum[i] / streak
    local = g.local.size > 0 and run.coordinator
    digest = _health_digest(run.health, g.nodes, policy) if local else state.health.get(i, {})
    diagnosis, action, code, why = _diagnose(digest, g, policy)
    event_id = derived_id("group_slowdown_flagged", run.run_id, state.attempt, g.kind, g.name, onset)
    state.flagged[i] = _Flag(event_id, step)
    if diagnosis == Diagnosis.ENVIRONMENTAL:
        state.environmental.add(i)
    where = f"{g.kind.replace('_', ' ')} {g.name} ({len(g.nodes)} nodes, {g.size} ranks)"
    text = (
        f"{where} computes {slowdown:.3f}x the run's median group ({reference:.3f} s) for {streak} steps "
        f"since step {onset} (threshold +{threshold:.1%}: the floor, or {noise_sigma:g} x "
        f"{noise / math.sqrt(max(1, reporting)):.2%} noise per step at its size); {why}"
    )
    flagged = GroupSlowdownFlagged(
        event_id=event_id,
        run_id=run.run_id,
        attempt=state.attempt,
        rank=-1,
        node=g.nodes[0],
        step=step,
        ts=trigger.ts,
        reason=Reason(code=ReasonCode.GROUP_SLOWDOWN, text=text[:2000]),
        caused_by=[trigger.event_id],
        group=g.name,
        group_kind=g.kind,
        members=g.nodes[:4096],
        slowdown=slowdown,
        threshold=threshold,
        consecutive_steps=streak,
        onset_step=onset,
        diagnosis=diagnosis,
        action=action,
        evidence={
            **digest,
            "slowdown": slowdown,
            "threshold": threshold,
            "noise_per_rank": noise,
            "ranks_reporting": float(reporting),
            "reference_s": reference,
            "thermal_limit_c": policy.thermal_limit_c,
        },
    )
    outputs: list[Derived] = [flagged]
    # one facilities page per group until it clears: a restart re-flags the same hot rack in
    # the new attempt, and a second page about it is noise, not news
    paged = ("facilities", f"{g.kind}:{g.name}")
    if action == StragglerAction.ALERT_FACILITIES and paged not in run.paging.paged:
        run.paging.paged.add(paged)
        outputs.append(page(flagged, "facilities", code, f"{where}: {why}", [event_id]))
    return outputs


def _cleared(
    state: GroupState, run: RunState, i: int, flag: _Flag, step: int, excess: float, trigger: Envelope
) -> GroupSlowdownCleared:
    g = state.groups[i]
    run.paging.paged.discard(("facilities", f"{g.kind}:{g.name}"))  # a recurrence pages again
    return GroupSlowdownCleared(
        event_id=derived_id("group_slowdown_cleared", flag.event_id, step),
        run_id=run.run_id,
        attempt=state.attempt,
        rank=-1,
        node=g.nodes[0],
        step=step,
        ts=trigger.ts,
        reason=Reason(
            code=ReasonCode.GROUP_SLOWDOWN_CLEARED,
            text=f"{g.kind.replace('_', ' ')} {g.name} back within its threshold for {flag.in_band} steps "
            f"(now {1 + excess:.3f}x the run's median group) after {flag.steps} steps flagged since "
            f"step {flag.flagged_step}",
        ),
        caused_by=[flag.event_id, trigger.event_id],
        group=g.name,
        flagged_steps=flag.steps,
    )


def flagged_environment(state: GroupState, node: str) -> str | None:
    """The name of a group holding `node` that is flagged ENVIRONMENTAL, if any (the per-rank
    eviction of its ranks must not go ahead: evicting moves the symptom)."""
    for i in state.flagged:
        g = state.groups[i]
        if i in state.environmental and node in g.nodes:
            return g.name
    return None
