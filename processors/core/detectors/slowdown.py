"""The windowed slowdown detector (issue 47): a node or a rank persistently a few percent
slower, which the per-step rule (straggler.py: robust z > 3 for 100 steps) cannot see.

Per step, 10% slower under 4% jitter is ~2.5 robust z: under the seed's 3-sigma line, so
the 100-step streak never forms. A statistic over a window sees it: a rank's median over
32 steps has about a fifth of one step's spread, a node's median over its 8 ranks less
again. So, from each evaluated step's compute times (measured BEFORE the collective; the
straggler detector decides when a step is complete and hands them over, as to the group
detector):

    block    B = `block_steps` consecutive steps (step // B)
    d_r      = log(median of rank r's compute over the block / the block's median rank)
    d_n      = median of d_r over node n's ranks
    X_u(k)   = mean of unit u's d over its last k blocks (each horizon k of `horizons`)
    ctx_u    = max(median of X over the units, median X of u's rack or placement group)
    e_u(k)   = X_u(k) - ctx_u                 (a rack slow as a whole is the group detector's)
    sigma(k) = 1.4826 x MAD of e(k) across the units, the median over `noise_blocks` blocks
    thr(k)   = max(log(1 + floor), z x sigma(k))

A unit over thr(k) at any horizon is flagged once (a StragglerFlagged naming the rank, or
a node's slowest rank): the same diagnosis and the same payback-priced eviction as a
per-step flag follow (engine._stragglers). It clears after `clear_blocks` blocks under
`clear_fraction` x thr at the horizon it was flagged at.

Nothing is a constant tuned to a scenario. sigma is measured on the run, across its
ranks (so it holds the jitter, the tails a median lets through, and persistent per-GPU
speed differences). z is the Gaussian quantile of the false-alarm budget: expected false
flags per 10,000 steps at `reference_ranks` ranks, split evenly over the levels, the
horizons and the blocks (Bonferroni; the overlapping windows make it conservative): at
the defaults 6.2 sigma for a rank, 5.9 for a node of 8. The floor is the slowdown whose
eviction would pay back just within the horizon (eviction.py's formula at its prior P
and default R: 3.6%); a smaller one could not be acted on. A slowdown s is then found
by the first window whose noise it exceeds: the smaller, the slower.

One flag per rank and node: a unit the per-step rule has flagged is not flagged here,
and a per-step flag on a rank (or a rank of a node) flagged here is absorbed with its
clear (:func:`absorb`). A rank of a node flagged here is not flagged again.

Sharded runs: each shard judges its own ranks against its own reference (a shard is a
multiple of the rack: thousands of ranks, whose median is the run's), with the world's
budget; nothing crosses shards. Quiet fast paths (block.py, quiet.py) never complete a
step, so they never reach this detector: it sees every evaluated step.

Pure: no clock, no I/O; per step one strided copy of the step's compute times, per block
a partition of the block's (ranks x B) buffer and a few numpy calls per horizon
(bench/bench_slowdown.py). (A (B x ranks) buffer makes the copy contiguous, 45 -> 21 us a
step at 16,384 ranks, but its transpose costs the judgement 3 ms a block: 15% more a step.)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from ....schemas import Derived, Envelope, Reason, ReasonCode, StragglerCleared, StragglerFlagged
from ..decisions.eviction_state import EvictionPolicy
from ..ids import derived_id
from .slowdown_state import CHANGE, LEVEL, LEVELS, NODE, RANK, SlowdownPolicy, SlowdownState, _Flag, _Layout

if TYPE_CHECKING:  # state.py embeds this module's state: no import cycle at run time
    from ..state import RunState

MAD_TO_SIGMA = 1.4826
#: The false-alarm budget is stated per this many steps.
BUDGET_STEPS = 10_000


# --------------------------------------------------------------------------- derived numbers


def payback_floor(policy: SlowdownPolicy, eviction: EvictionPolicy) -> float:
    """The smallest slowdown worth a flag: the policy's, else the one whose eviction pays back
    exactly within the horizon, R / (P x (1 - 1/s)) = horizon (eviction.py's formula at the
    prior P(healthy) and the default R)."""
    if policy.min_slowdown is not None:
        return policy.min_slowdown
    cost = eviction.default_restart_s / max(1e-9, eviction.prior_healthy * eviction.horizon_s)
    return 1.0 / (1.0 - cost) - 1.0 if cost < 0.5 else 1.0


def z_threshold(policy: SlowdownPolicy, level: str, ranks_per_node: int) -> float:
    """The threshold in sigmas for `level`: the Gaussian quantile of its share of the budget
    per judged window at `reference_ranks` ranks."""
    units = (
        policy.reference_ranks if level == RANK else max(1, policy.reference_ranks // max(1, ranks_per_node))
    )
    tests = 2 if policy.baseline_blocks else 1  # LEVEL, and CHANGE where the unit's past is kept
    windows = units * (BUDGET_STEPS / policy.block_steps) * len(policy.horizons) * len(LEVELS) * tests
    return -NormalDist().inv_cdf(policy.false_flags_per_10k_steps / windows)


# --------------------------------------------------------------------------- per step


def reset(state: SlowdownState, attempt: int) -> None:
    """Forget everything of the previous attempt (counters are kept)."""
    judged, skipped = state.judged, state.skipped
    state.__dict__.update(SlowdownState(attempt=attempt).__dict__)
    state.judged, state.skipped = judged, skipped


def on_step(
    state: SlowdownState,
    run: RunState,
    step: int,
    values: np.ndarray,
    reported: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    eviction: EvictionPolicy,
) -> list[Derived]:
    """One step evaluated by the straggler detector (`values`: compute_s by rank, NaN where
    no report; `reported`: how many reported): recorded in its block; a block complete (its
    last step, or a step of a later block) is judged."""
    if not policy.enabled or trigger.attempt < state.attempt:
        return []
    if trigger.attempt > state.attempt:
        reset(state, trigger.attempt)
    layout = _layout(state, run, policy)
    if layout is None:
        return []
    size = policy.block_steps
    block = step // size
    outputs: list[Derived] = []
    if block != state.block:
        if state.columns:  # the block's last steps never came
            outputs += _judge(state, run, layout, step, trigger, policy, eviction)
        state.block, state.first_step, state.columns, state.holes = block, step, 0, False
        state.reports = 0
    local = values[layout.first : layout.first + layout.n]
    column = state.buf[:, state.columns]
    column[: local.size] = local
    if local.size < layout.n:
        column[local.size :] = np.nan
    state.holes = state.holes or reported != layout.n or local.size < layout.n
    state.reports += min(reported, local.size)
    state.columns += 1
    if step % size == size - 1:
        outputs += _judge(state, run, layout, step, trigger, policy, eviction)
    return outputs


def absorb(state: SlowdownState, run: RunState, found: list[Derived]) -> list[Derived]:
    """The per-step detector's outputs, less its flags on a rank of a node this detector has
    flagged (the node, or a rank of it), and their clears: one flag per node."""
    if not state.flagged and not state.absorbed:
        return found
    kept: list[Derived] = []
    for item in found:
        if isinstance(item, StragglerFlagged) and _covered(state, item.rank):
            state.absorbed.add(item.event_id)
            continue
        if isinstance(item, StragglerCleared) and item.caused_by and item.caused_by[0] in state.absorbed:
            state.absorbed.discard(item.caused_by[0])
            continue
        kept.append(item)
    return kept


def _covered(state: SlowdownState, rank: int) -> bool:
    layout = state.layout
    if layout is None:
        return False
    r = rank - layout.first
    if not 0 <= r < layout.n:
        return False
    if (RANK, r) in state.flagged:
        return True
    rpn = layout.rpn  # one flag per node: any flag of this detector on the rank's node
    return rpn > 0 and any((u if lv == NODE else u // rpn) == r // rpn for lv, u in state.flagged)


# --------------------------------------------------------------------------- layout


def _layout(state: SlowdownState, run: RunState, policy: SlowdownPolicy) -> _Layout | None:
    owned = run.owned()
    if owned is None or len(owned) < policy.min_units:
        return None
    rpn = run.ranks_per_node
    key = (owned.start, owned.stop, rpn, len(run.nodes))
    if state.layout is not None and state.layout.key == key:
        return state.layout
    attempt, judged, skipped = state.attempt, state.judged, state.skipped
    reset(state, attempt)
    state.judged, state.skipped = judged, skipped
    first, n = owned.start, len(owned)
    node_level = rpn > 1 and first % rpn == 0 and n // rpn >= policy.min_units
    rpn = rpn if node_level else 0
    names = [_node_name(run, first + j * rpn, rpn) for j in range(n // rpn)] if rpn else []
    members, pairs = _groups(run, names, policy)
    state.layout = _Layout(key, first, n, rpn, names, members, pairs)
    size = max(policy.horizons) + policy.baseline_blocks
    state.buf = np.full((n, policy.block_steps), np.nan, np.float32)
    state.ring = {RANK: np.full((n, size), np.nan)}
    if rpn:
        state.ring[NODE] = np.full((n // rpn, size), np.nan)
    state.ring_steps = deque(maxlen=size)
    return state.layout


def _node_name(run: RunState, rank: int, rpn: int) -> str:
    index = rank // rpn
    return run.nodes[index] if index < len(run.nodes) else ""


def _groups(
    run: RunState, names: list[str], policy: SlowdownPolicy
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The racks and placement groups with at least `min_group_nodes` nodes here, as a padded
    matrix of local node indices, and its (node, group) pairs."""
    where = {name: j for j, name in enumerate(names) if name}
    groups: list[list[int]] = []
    if run.groups.groups:
        for group in run.groups.groups:
            local = [where[node] for node in group.nodes if node in where]
            if len(local) >= policy.min_group_nodes:
                groups.append(local)
    else:
        racks: dict[str, list[int]] = {}
        for name, j in where.items():
            rack = run.racks.get(name)
            if rack is not None:
                racks.setdefault(rack, []).append(j)
        groups = [sorted(held) for _, held in sorted(racks.items()) if len(held) >= policy.min_group_nodes]
    width = max((len(g) for g in groups), default=0)
    members = np.full((len(groups), width), -1, np.int64)
    for i, nodes in enumerate(groups):
        members[i, : len(nodes)] = nodes
    at = np.nonzero(members >= 0)
    return members, (members[at], at[0])


# --------------------------------------------------------------------------- per block


def _nan_row_medians(block: np.ndarray, min_count: float) -> np.ndarray:
    """Each row's median over its non-NaN values (NaN where fewer than `min_count`): sorted
    rows put NaN last, so each median is at its own count's middle."""
    rows = np.sort(block, axis=1)
    count = block.shape[1] - np.isnan(block).sum(axis=1)
    lo = np.take_along_axis(rows, np.maximum(0, (count - 1) // 2)[:, None], axis=1)[:, 0]
    hi = np.take_along_axis(rows, np.minimum(block.shape[1] - 1, count // 2)[:, None], axis=1)[:, 0]
    medians = (lo.astype(np.float64) + hi) / 2
    medians[count < max(1.0, min_count)] = np.nan
    return medians


def _row_medians(block: np.ndarray, holes: bool, min_count: float) -> np.ndarray:
    """Each row's median, `block` reordered in place (np.median copies and checks NaN)."""
    if holes:
        bad = np.isnan(block).any(axis=1)
        if bad.any():
            medians = np.empty(block.shape[0])
            medians[bad] = _nan_row_medians(block[bad], min_count)
            good = ~bad
            if good.any():
                medians[good] = _row_medians(block[good], False, min_count)
            return medians
    k = block.shape[1] // 2
    block.partition(k, axis=1)
    if block.shape[1] % 2:
        return block[:, k].astype(np.float64)
    return (block[:, k].astype(np.float64) + block[:, :k].max(axis=1)) / 2


def _median(x: np.ndarray) -> float:
    """The median of `x`, which is reordered in place."""
    k = x.size // 2
    x.partition(k)
    return float(x[k]) if x.size % 2 else float(x[k] + x[:k].max()) / 2


def _judge(
    state: SlowdownState,
    run: RunState,
    layout: _Layout,
    step: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    eviction: EvictionPolicy,
) -> list[Derived]:
    """The block just filled: its medians into the rings, then every window judged."""
    columns, state.columns = state.columns, 0
    min_count = max(1.0, columns * policy.min_block_fraction)
    # A unit needs `min_count` reports for a median: with fewer reports in all than
    # min_units x min_count, fewer than min_units units have one (a run-level stream that
    # only one rank reports); skipped without sorting the block.
    thin = state.reports < policy.min_units * min_count
    if columns < policy.min_block_fraction * policy.block_steps or thin:
        state.skipped += 1
        return []
    medians = _row_medians(state.buf[:, :columns], state.holes, min_count)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(medians)
    valid = np.isfinite(logs)
    if np.count_nonzero(valid) < policy.min_units:
        state.skipped += 1
        return []
    logs[~valid] = np.nan
    logs -= _median(logs[valid])
    size = max(policy.horizons) + policy.baseline_blocks
    state.ring[RANK][:, state.pos] = logs
    if layout.rpn:
        nodes = logs[: layout.rpn * len(layout.node_names)].reshape(-1, layout.rpn)
        state.ring[NODE][:, state.pos] = _row_medians(nodes.copy(), True, layout.rpn / 2)
    state.ring_steps.append(state.first_step)
    state.pos = (state.pos + 1) % size
    state.judged += 1
    return _windows(state, run, layout, step, trigger, policy, eviction)


@dataclass
class _Window:
    """One test of one level over one horizon, judged this block."""

    excess: np.ndarray  # over the reference (LEVEL) or over the unit's own past (CHANGE)
    ok: np.ndarray  # units with a statistic
    threshold: float
    sigma: float
    x: np.ndarray  # the window's mean block excess (the LEVEL statistic)
    ref: float  # its median over the units
    past: np.ndarray | None  # CHANGE: each unit's mean block excess before the windows


_Key = tuple[str, str, int]  # (test, level, horizon index)


def _windows(
    state: SlowdownState,
    run: RunState,
    layout: _Layout,
    step: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    eviction: EvictionPolicy,
) -> list[Derived]:
    floor = math.log1p(payback_floor(policy, eviction))
    longest, back = max(policy.horizons), policy.baseline_blocks
    size, have = longest + back, len(state.ring_steps)
    past: dict[str, np.ndarray] | None = None
    if back and have >= size:  # each unit's own past: the blocks before the longest window
        cols = [(state.pos - 1 - longest - j) % size for j in range(back)]
        past = {level: ring[:, cols].mean(axis=1) for level, ring in state.ring.items()}
    judged: dict[_Key, _Window] = {}
    for h, k in enumerate(policy.horizons):
        if have < k:
            break
        cols = [(state.pos - 1 - j) % size for j in range(k)]
        stats = {level: ring[:, cols].mean(axis=1) for level, ring in state.ring.items()}
        tests: list[tuple[str, dict[str, np.ndarray]]] = [(LEVEL, stats)]
        if past is not None:
            tests.append((CHANGE, {level: x - past[level] for level, x in stats.items()}))
        for test, values in tests:
            context = _context(values[NODE], layout, policy) if NODE in values else None
            for level, x in values.items():
                ok = np.isfinite(x)
                if np.count_nonzero(ok) < policy.min_units:
                    continue
                ref = _median(x[ok])
                if context is None:
                    excess = x - ref
                else:
                    around = context if level == NODE else np.repeat(context, layout.rpn)
                    base = np.full(x.size, ref)
                    base[: around.size] = np.maximum(ref, around)
                    excess = x - base
                # the spread of the statistic itself, around the run's reference (the rack
                # context only lowers an excess: measured after it, a rack's member shrinks it)
                spread = MAD_TO_SIGMA * _median(np.abs(x[ok] - ref))
                noise = state.noise.get((test, level, h))
                if noise is None or noise.maxlen != policy.noise_blocks:
                    noise = state.noise[(test, level, h)] = deque(noise or (), maxlen=policy.noise_blocks)
                noise.append(spread)
                sigma = statistics.median(noise)
                threshold = max(floor, z_threshold(policy, level, layout.rpn) * sigma)
                own = None if past is None or test == LEVEL else past[level]
                judged[(test, level, h)] = _Window(excess, ok, threshold, sigma, stats[level], ref, own)
    outputs = _clears(state, run, layout, step, trigger, policy, judged)
    return outputs + _flags(state, run, layout, step, trigger, policy, judged, floor)


def _context(nodes: np.ndarray, layout: _Layout, policy: SlowdownPolicy) -> np.ndarray:
    """Per node, the median statistic of its slowest rack or placement group (-inf: none)."""
    context = np.full(nodes.size, -np.inf)
    if not layout.members.size:
        return context
    padded = np.where(layout.members >= 0, nodes[layout.members], np.nan)
    medians = _nan_row_medians(padded, policy.min_group_nodes)
    medians[np.isnan(medians)] = -np.inf
    node_of, group_of = layout.pairs
    np.maximum.at(context, node_of, medians[group_of])
    return context


# --------------------------------------------------------------------------- flags


def _flags(
    state: SlowdownState,
    run: RunState,
    layout: _Layout,
    step: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    judged: dict[_Key, _Window],
    floor: float,
) -> list[Derived]:
    """Units over a threshold, each at its shortest horizon; nodes first (a node slow as a
    whole is one flag, not one per rank), then ranks on nodes not flagged. A unit slower than
    its own past is flagged only if it also costs the job the payback floor."""
    per_step = {r - layout.first for r in run.straggler.flagged if 0 <= r - layout.first < layout.n}
    rpn = layout.rpn
    # nodes with a flag on them already (here or the per-step rule's): one flag per node, whose
    # eviction replaces every GPU of it
    taken = (
        {u if lv == NODE else u // rpn for lv, u in state.flagged} | {r // rpn for r in per_step}
        if rpn
        else set()
    )
    outputs: list[Derived] = []
    for level in (NODE, RANK):
        found: dict[int, tuple[str, int]] = {}
        for h in range(len(policy.horizons)):
            levels = judged.get((LEVEL, level, h))
            if levels is None:
                continue
            for test in (LEVEL, CHANGE):
                w = judged.get((test, level, h))
                if w is None:
                    continue
                hit = w.ok & (w.excess > w.threshold)
                if test == CHANGE:
                    hit &= levels.excess > floor
                for unit in np.flatnonzero(hit).tolist():
                    found.setdefault(unit, (test, h))
        for unit, (test, h) in sorted(found.items()):
            if (level, unit) in state.flagged:
                continue
            if state.cleared:  # windows from before a flag's clear see the slowdown that ended
                node_key = (NODE, unit if level == NODE or not rpn else unit // rpn)
                since = max(
                    state.cleared.get((level, unit), -1), state.cleared.get(node_key, -1) if rpn else -1
                )
                if state.ring_steps[-policy.horizons[h]] <= since:
                    continue
            if unit in (taken if level == NODE else per_step) or (
                level == RANK and rpn and unit // rpn in taken
            ):
                continue
            if rpn:
                taken.add(unit if level == NODE else unit // rpn)
            outputs.append(
                _flag(state, run, layout, (test, level, h), unit, step, trigger, policy, judged, floor)
            )
    return outputs


def _flag(
    state: SlowdownState,
    run: RunState,
    layout: _Layout,
    key: _Key,
    unit: int,
    step: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    judged: dict[_Key, _Window],
    floor: float,
) -> StragglerFlagged:
    test, level, h = key
    w, levels = judged[key], judged[(LEVEL, level, h)]
    k, size = policy.horizons[h], policy.block_steps
    onset = state.ring_steps[-k]
    if level == NODE:
        slowest = 0
        if (LEVEL, RANK, h) in judged:  # the node's slowest rank is named
            mine = judged[(LEVEL, RANK, h)].excess[unit * layout.rpn : (unit + 1) * layout.rpn]
            slowest = int(np.nanargmax(mine)) if np.isfinite(mine).any() else 0
        rank = layout.first + unit * layout.rpn + slowest
        global_unit = (layout.first // layout.rpn) + unit
    else:
        rank = global_unit = layout.first + unit
    node = _rank_node(run, layout, rank)
    e = float(w.excess[unit])
    z = e / w.sigma if w.sigma > 0 else math.inf
    slowdown = math.exp(float(levels.excess[unit]))  # what the job pays: against the reference
    event_id = derived_id("slowdown_flagged", run.run_id, state.attempt, level, global_unit, onset)
    base = float(w.past[unit]) if w.past is not None else 0.0
    state.flagged[(level, unit)] = _Flag(level, unit, rank, event_id, step, h, test, base, w.threshold)
    what = f"node {node} (its {layout.rpn} ranks' median)" if level == NODE else f"rank {rank} on {node}"
    z_level = z_threshold(policy, level, layout.rpn)
    bound = "the payback floor" if w.threshold <= floor else f"{z_level:.1f} x the {w.sigma:.2%} spread"
    if test == LEVEL:
        against = "the run's reference (its rack's where that is slower)"
    else:
        against = (
            f"its own {policy.baseline_blocks * size} steps before, {math.expm1(e):+.1%} (now "
            f"{slowdown:.3f}x the run's reference, over the payback floor); it is"
        )
    text = (
        f"{what} computes {math.exp(e):.3f}x {against} over the {k * size} steps since step {onset}: "
        f"its median per {size}-step block, averaged over {k}; robust z {z:.1f}, threshold "
        f"+{math.expm1(w.threshold):.1%} ({bound} of this window across the run's {level}s, for "
        f"{policy.false_flags_per_10k_steps:g} false flags per {BUDGET_STEPS:,} steps at "
        f"{policy.reference_ranks:,} ranks; payback floor +{math.expm1(floor):.1%})"
    )
    return StragglerFlagged(
        event_id=event_id,
        run_id=run.run_id,
        attempt=state.attempt,
        rank=rank,
        node=node,
        step=step,
        ts=trigger.ts,
        reason=Reason(code=ReasonCode.STRAGGLER, text=text[:2000]),
        caused_by=[trigger.event_id],
        robust_z=z,
        slowdown=slowdown,
        consecutive_steps=k * size,
        onset_step=onset,
    )


def _rank_node(run: RunState, layout: _Layout, rank: int) -> str:
    nodes = run.straggler.nodes
    if rank < len(nodes) and nodes[rank]:
        return nodes[rank]
    if layout.rpn:
        return layout.node_names[(rank - layout.first) // layout.rpn]
    known = run.ranks.get(rank)
    return known.node if known is not None else ""


def _clears(
    state: SlowdownState,
    run: RunState,
    layout: _Layout,
    step: int,
    trigger: Envelope,
    policy: SlowdownPolicy,
    judged: dict[_Key, _Window],
) -> list[Derived]:
    """A flag clears after `clear_blocks` blocks under `clear_fraction` x its threshold at its
    horizon: over the reference (LEVEL), or over its own past as it was when flagged (CHANGE:
    the moving past would take the slowdown in and clear it while still slow)."""
    outputs: list[Derived] = []
    for key, flag in list(state.flagged.items()):
        levels = judged.get((LEVEL, flag.level, flag.horizon))
        if levels is None or not levels.ok[flag.unit]:
            continue
        flag.blocks += 1
        if flag.test == LEVEL:
            e, threshold = float(levels.excess[flag.unit]), levels.threshold
        else:
            e, threshold = float(levels.x[flag.unit]) - levels.ref - flag.base, flag.threshold
        flag.in_band = flag.in_band + 1 if e < policy.clear_fraction * threshold else 0
        if flag.in_band < policy.clear_blocks:
            continue
        del state.flagged[key]
        state.cleared[key] = step
        if layout.rpn:
            node_key = (NODE, flag.unit if flag.level == NODE else flag.unit // layout.rpn)
            state.cleared[node_key] = step
        node = _rank_node(run, layout, flag.rank)
        what = f"node {node}" if flag.level == NODE else f"rank {flag.rank} on {node}"
        since = "the reference" if flag.test == LEVEL else "its own past"
        outputs.append(
            StragglerCleared(
                event_id=derived_id("slowdown_cleared", flag.event_id, step),
                run_id=run.run_id,
                attempt=state.attempt,
                rank=flag.rank,
                node=node,
                step=step,
                ts=trigger.ts,
                reason=Reason(
                    code=ReasonCode.STRAGGLER_RECOVERED,
                    text=f"{what} back under {policy.clear_fraction:g} x its threshold for {flag.in_band} "
                    f"blocks of {policy.block_steps} steps (now {math.exp(e):.3f}x {since}) after "
                    f"{flag.blocks} blocks flagged since step {flag.flagged_step}",
                ),
                caused_by=[flag.event_id, trigger.event_id],
                flagged_steps=flag.blocks * policy.block_steps,
            )
        )
    return outputs
