"""The windowed slowdown detector (issue 47): a node 5% slow and a rank 8% slow, under
jitter 0.03-0.05 with GC pauses and a heavy tail, found within 300 steps at 1,024 and
16,384 ranks; nothing on noise, the false-alarm budget an upper bound on what noise
raises; a rack slow as a whole left to the group detector; a sharded run finds what an
unsharded one does; through the engine, the same diagnosis and payback as a per-step flag,
and one flag per rank."""

from __future__ import annotations

import numpy as np
import pytest

from harness.slowdown_streams import NoisyJob, SlowUnit, WindowHarness, trigger
from harness.straggler_streams import HealthFault, Slow, SyncJob, of_kind
from trainguard.processors.core import CorePolicy, CoreState, step
from trainguard.processors.core.detectors import slowdown
from trainguard.processors.core.detectors.slowdown import z_threshold
from trainguard.processors.core.detectors.slowdown_state import NODE, RANK, SlowdownPolicy
from trainguard.processors.core.outputs import Forward
from trainguard.schemas import (
    Diagnosis,
    EvictionDecision,
    EvictionVerdict,
    EvictRank,
    StragglerCleared,
    StragglerDiagnosed,
    StragglerFlagged,
)
from trainguard.schemas.sharding import route

ONSET = 100
WITHIN = 300


def found(h: WindowHarness) -> dict[str, int]:
    """Flagged node (or rank, as 'rank N') -> the step it was flagged at."""
    out: dict[str, int] = {}
    for at, flag in h.flags:
        key = flag.node if "node " in flag.reason.text.split(" computes")[0] else f"rank {flag.rank}"
        assert key not in out, f"{key} flagged twice"
        out[key] = at
    return out


@pytest.mark.parametrize("jitter", [0.03, 0.05])
def test_a_node_5pct_and_a_rank_8pct_slow_are_found_within_300_steps_at_1024_ranks(jitter: float) -> None:
    slow_rank = 700  # on node-0087, another rack
    job = NoisyJob(
        jitter=jitter,
        slow=[SlowUnit(1.05, node=5, from_step=ONSET), SlowUnit(1.08, rank=slow_rank, from_step=ONSET)],
    )
    h = WindowHarness(job)
    h.steps(ONSET + WITHIN)
    flagged = found(h)
    assert set(flagged) == {"node-0005", f"rank {slow_rank}"}, flagged
    assert all(at - ONSET <= WITHIN for at in flagged.values()), flagged
    by_unit = {f.node: f for _, f in h.flags}
    assert 1.02 < by_unit["node-0005"].slowdown < 1.08
    assert by_unit["node-0005"].rank // 8 == 5  # the node's slowest rank is named
    assert by_unit["node-0087"].rank == slow_rank and 1.03 < by_unit["node-0087"].slowdown < 1.12


def test_at_16384_ranks_a_node_5pct_and_a_rank_8pct_slow_are_found_within_300_steps() -> None:
    job = NoisyJob(
        world_size=16_384,
        nodes_per_rack=16,
        jitter=0.04,
        slow=[SlowUnit(1.05, node=1500, from_step=ONSET), SlowUnit(1.08, rank=4321, from_step=ONSET)],
    )
    h = WindowHarness(job)
    h.steps(ONSET + WITHIN)
    flagged = found(h)
    assert set(flagged) == {"node-1500", "rank 4321"}, flagged
    assert all(at - ONSET <= WITHIN for at in flagged.values()), flagged


@pytest.mark.parametrize(("jitter", "spread"), [(0.03, 0.0), (0.05, 0.01)])
def test_noise_alone_flags_nothing(jitter: float, spread: float) -> None:
    # 1,024 ranks for 4,000 steps, GC pauses and tails; with a 1% silicon lottery too, which
    # the measured spread carries into the thresholds
    h = WindowHarness(NoisyJob(jitter=jitter, rank_spread=spread, seed=11))
    h.steps(4_000)
    assert h.flags == []


def test_a_gpu_slower_than_its_own_past_is_found_under_a_silicon_lottery() -> None:
    # 16,384 ranks whose GPUs differ persistently by 1% (some ~4% slower than the median for
    # ever): against the run's reference a 5% slowdown hides in that spread; against each
    # rank's own past (once 24 blocks are kept) it does not
    onset = 800
    job = NoisyJob(
        world_size=16_384,
        nodes_per_rack=16,
        jitter=0.04,
        rank_spread=0.01,
        slow=[SlowUnit(1.05, rank=9001, from_step=onset)],
        seed=1,
    )
    h = WindowHarness(job)
    h.steps(onset + WITHIN)
    assert [(f.rank, "own" in f.reason.text) for _, f in h.flags] == [(9001, True)]
    assert h.flags[0][0] - onset <= WITHIN and 1.02 < h.flags[0][1].slowdown < 1.08


def test_a_flag_against_its_own_past_lasts_as_long_as_the_slowdown() -> None:
    # the past moves on and takes the slow blocks in; the flag is judged against the past it
    # was flagged with, so it clears when the rank recovers, not when its past catches up
    onset, end = 800, 2_000
    job = NoisyJob(
        jitter=0.03, rank_spread=0.01, slow=[SlowUnit(1.06, rank=300, from_step=onset, to_step=end)], seed=4
    )
    h = WindowHarness(job)
    outputs = h.steps(end + 400)
    assert [f.rank for _, f in h.flags] == [300] and "own" in h.flags[0][1].reason.text
    (cleared,) = of_kind(outputs, StragglerCleared)
    assert cleared.rank == 300 and end < cleared.step <= end + 400


def test_a_slowdown_that_ended_is_cleared_and_not_flagged_again_from_old_windows() -> None:
    # A node 25% slow for 300 steps: flagged within a block, cleared after it recovers, and
    # the longer windows that still reach back into the slow steps do not flag it again
    # (which would be diagnosed on health that is normal by then)
    job = NoisyJob(jitter=0.04, slow=[SlowUnit(1.25, node=40, from_step=ONSET, to_step=ONSET + 300)], seed=8)
    h = WindowHarness(job)
    outputs = h.steps(ONSET + 900)
    assert [(f.node, at - ONSET <= 64) for at, f in h.flags] == [("node-0040", True)]
    (cleared,) = of_kind(outputs, StragglerCleared)
    assert ONSET + 300 < cleared.step < ONSET + 300 + 128


def test_the_budget_bounds_what_noise_raises() -> None:
    # With budgets large enough to see (z ~ 3.9 and ~3.3): noise raises flags, more the larger
    # the budget, never more than the budget says (Bonferroni over overlapping windows is an
    # upper bound); the expectation at this run's size scales the budget by its ranks and steps.
    steps, world = 3_000, 1_024
    counts = []
    for budget in (2_000.0, 20_000.0):
        policy = SlowdownPolicy(false_flags_per_10k_steps=budget, min_slowdown=1e-3)  # no payback floor
        h = WindowHarness(NoisyJob(world_size=world, jitter=0.04, seed=5), policy=policy)
        h.steps(steps)
        expected = budget * steps / 10_000 * world / policy.reference_ranks
        assert len(h.flags) <= expected, (budget, len(h.flags), expected)
        counts.append(len(h.flags))
    assert 0 < counts[0] < counts[1]


def test_thresholds_follow_the_budget_and_the_node_size() -> None:
    policy = SlowdownPolicy()
    assert 6.0 < z_threshold(policy, RANK, 8) < 6.5  # ~1e-10 per window per rank
    assert z_threshold(policy, NODE, 8) < z_threshold(policy, RANK, 8)  # 8x fewer nodes
    looser = SlowdownPolicy(false_flags_per_10k_steps=1.0)
    assert z_threshold(looser, RANK, 8) < z_threshold(policy, RANK, 8)


@pytest.mark.parametrize("nodes_per_rack", [4, 16])
def test_a_rack_slow_as_a_whole_is_not_flagged_node_by_node(nodes_per_rack: int) -> None:
    # 6% on every rank of rack 3: the group detector's (group_slowdown.py); a node 8% slow
    # in another rack is still this detector's
    job = NoisyJob(
        nodes_per_rack=nodes_per_rack,
        jitter=0.04,
        slow=[SlowUnit(1.06, rack=3, from_step=ONSET), SlowUnit(1.08, node=100, from_step=ONSET)],
    )
    h = WindowHarness(job)
    h.steps(ONSET + WITHIN)
    assert set(found(h)) == {"node-0100"}


def test_a_sharded_run_finds_what_an_unsharded_one_does() -> None:
    def run(shard_ranks: int) -> dict[str, int]:
        job = NoisyJob(
            world_size=4096,
            nodes_per_rack=16,
            jitter=0.05,
            slow=[SlowUnit(1.05, node=300, from_step=ONSET), SlowUnit(1.08, rank=1000, from_step=ONSET)],
        )
        h = WindowHarness(job, shard_ranks=shard_ranks)
        h.steps(ONSET + WITHIN)
        return found(h)

    whole = run(0)
    assert set(whole) == {"node-0300", "rank 1000"}
    assert run(1024) == whole


# --------------------------------------------------------------------------- through the engine


def _engine(job: SyncJob, health: list[HealthFault], steps: int, shard_ranks: int = 0) -> list:
    """The job's events through the core; with `shard_ranks`, routed to their shards as the
    driver does (schemas/sharding.py), each Forward re-published to shard 0."""
    job.start()
    outputs: list = []
    state, policy = CoreState(), CorePolicy()
    for chunk in range(0, steps, 20):
        job.health(health)
        job.steps(min(20, steps - chunk))
        for event in job.events:
            shards = route(event, job.world_size, shard_ranks) if shard_ranks else [0]
            for shard in shards:
                state, out = step(state, event, policy, shard=shard, shard_ranks=shard_ranks)
                for o in out:
                    if isinstance(o, Forward):
                        state, more = step(state, o.event, policy, shard=0, shard_ranks=shard_ranks)
                        outputs += more
                    else:
                        outputs.append(o)
        job.events.clear()
    return outputs


def test_through_the_engine_a_node_10pct_slow_from_nic_contention_is_diagnosed_and_evicted() -> None:
    # The miss: a node (all 8 GPUs) 10% slow from NIC contention under 4% jitter with
    # GC pauses and a heavy tail: ~2.5 robust z per step, which the per-step rule never flags.
    node = 6
    slow = [Slow(r, 1.10, from_step=60) for r in range(node * 8, node * 8 + 8)]
    job = SyncJob(
        world_size=256,
        nodes_per_rack=4,
        jitter=0.04,
        heavy_tail=True,
        gc_pause_p=0.003,
        gc_factor=1.3,
        slow=slow,
    )
    outputs = _engine(job, [HealthFault("nic", node=job.node(node * 8))], 260)
    flags = of_kind(outputs, StragglerFlagged)
    assert [f.node for f in flags] == [job.node(node * 8)], [f.reason.text for f in flags]
    assert "median" in flags[0].reason.text and flags[0].step - 60 <= WITHIN
    (diagnosed,) = of_kind(outputs, StragglerDiagnosed)
    assert diagnosed.diagnosis == Diagnosis.NETWORK_CONTENTION
    (decision,) = of_kind(outputs, EvictionDecision)
    assert decision.decision == EvictionVerdict.EVICT  # ~9% of the job: pays back in ~2 h


def test_a_shards_slow_node_is_diagnosed_there_and_its_eviction_decided_by_shard_0() -> None:
    # Two shards of 128 ranks: the node 10% slow lives on shard 1, which alone sees its step
    # times and GPU health; it flags and diagnoses, and forwards both to shard 0, which
    # charges the slowdown and prices the eviction (one decision, as unsharded).
    node = 20  # ranks 160-167
    slow = [Slow(r, 1.10, from_step=60) for r in range(node * 8, node * 8 + 8)]
    job = SyncJob(world_size=256, nodes_per_rack=4, jitter=0.04, heavy_tail=True, slow=slow)
    outputs = _engine(job, [HealthFault("nic", node=job.node(node * 8))], 260, shard_ranks=128)
    (flag,) = of_kind(outputs, StragglerFlagged)
    assert flag.node == job.node(node * 8) and flag.rank >= 128
    (diagnosed,) = of_kind(outputs, StragglerDiagnosed)
    assert diagnosed.diagnosis == Diagnosis.NETWORK_CONTENTION
    (decision,) = of_kind(outputs, EvictionDecision)
    assert (decision.rank, decision.decision) == (flag.rank, EvictionVerdict.EVICT)
    assert [c.rank for c in of_kind(outputs, EvictRank)] == [flag.rank]


def test_through_the_engine_a_rank_flagged_by_both_rules_is_flagged_once() -> None:
    # 30% slow: the window flags it within a block or two, the per-step rule after 100 steps;
    # the later one is absorbed (one flag, one diagnosis, one decision)
    job = SyncJob(world_size=256, nodes_per_rack=4, jitter=0.03, slow=[Slow(77, 1.3, from_step=40)])
    outputs = _engine(job, [HealthFault("thermal", rank=77)], 240)
    flags = of_kind(outputs, StragglerFlagged)
    assert [f.rank for f in flags] == [77]
    assert flags[0].step < 40 + 100  # before the per-step rule's streak could complete
    assert len(of_kind(outputs, StragglerDiagnosed)) == 1
    assert [d.decision for d in of_kind(outputs, EvictionDecision)] == [EvictionVerdict.EVICT]


def test_a_block_too_thinly_reported_for_min_units_is_skipped_without_sorting_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run-level stream (only rank 0 reports: producers/simulator/longrun.py) cannot give
    min_units ranks a median: its blocks are skipped before the block is sorted; a block
    half the ranks report in full is judged, with the medians of those that reported."""
    policy = SlowdownPolicy()
    h = WindowHarness(NoisyJob(seed=3), policy)
    run = h.runs[0]
    blocks = 3
    with monkeypatch.context() as patched:
        patched.setattr(slowdown, "_row_medians", lambda *_: pytest.fail("a thin block was sorted"))
        for _ in range(blocks * policy.block_steps):
            values = h.job.next_step()
            values[1:] = np.nan  # rank 0 alone reported
            slowdown.on_step(run.slowdown, run, h.job.step, values, 1, trigger(run.run_id, h.job.step),
                             policy, h.eviction)  # fmt: skip
    assert (run.slowdown.judged, run.slowdown.skipped) == (0, blocks)
    half = h.job.world_size // 2
    for _ in range(policy.block_steps):
        values = h.job.next_step()
        values[half:] = np.nan
        slowdown.on_step(run.slowdown, run, h.job.step, values, half, trigger(run.run_id, h.job.step),
                         policy, h.eviction)  # fmt: skip
    assert (run.slowdown.judged, run.slowdown.skipped) == (1, blocks)
    column = (run.slowdown.pos - 1) % run.slowdown.ring[RANK].shape[1]
    judged = np.isfinite(run.slowdown.ring[RANK][:, column])
    assert judged[:half].all() and not judged[half:].any()
