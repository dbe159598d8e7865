"""The checkpoint interval policy (seed §6): Young's and Daly's optimum from the run's
measured checkpoint cost C and MTBF M, published only when the change matters."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy
from trainguard.processors.core.decisions.interval import IntervalPolicy, daly_s, optimal_s, overhead, young_s
from trainguard.schemas import IntervalUpdate, ReasonCode, SetCheckpointInterval

#: Llama 3 on 16,384 GPUs: 419 unexpected interruptions in 54 days (the seed's figure).
LLAMA3_MTBF_16K_S = 54 * 86_400 / 419
MINUTE = 60.0


def test_the_seeds_numbers_at_16384_ranks() -> None:
    c, r, m = 30.0, 600.0, LLAMA3_MTBF_16K_S
    t, formula = optimal_s(c, m, IntervalPolicy())
    assert formula == "young" and t == pytest.approx(young_s(c, m))
    assert t / MINUTE == pytest.approx(13.6, abs=0.05)
    assert overhead(t, c, m, r) == pytest.approx(0.127, abs=0.0005)
    assert overhead(30 * MINUTE, c, m, r) == pytest.approx(0.151, abs=0.0005)  # a fixed 30 min
    assert r / m == pytest.approx(0.054, abs=0.0005)  # the restart term, whatever the interval
    # T* is the minimum: any other interval loses more
    assert all(overhead(t * k, c, m) > overhead(t, c, m) for k in (0.5, 0.9, 1.1, 2.0))


def test_daly_replaces_young_when_the_checkpoint_cost_is_not_small_against_the_mtbf() -> None:
    c, m = 600.0, 3_600.0  # C/M = 0.17
    t, formula = optimal_s(c, m, IntervalPolicy())
    x = c / (2 * m)
    assert formula == "daly"
    assert t == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c)
    assert daly_s(c, m) < young_s(c, m)
    assert daly_s(2 * m, m) == m  # C >= 2M: checkpoint once per MTBF
    # the threshold is the policy's
    assert optimal_s(c, m, IntervalPolicy(daly_above_c_over_m=0.5))[1] == "young"


def test_the_optimum_is_clamped_to_the_policy_bounds() -> None:
    policy = IntervalPolicy(min_s=120, max_s=3_600)
    assert optimal_s(0.01, 100.0, policy)[0] == 120
    assert optimal_s(60.0, 1e7, policy)[0] == 3_600


def policy(**interval: object) -> CorePolicy:
    # The seed's 16,384-GPU failure rate put on a 16-rank test job: the world-size prior
    # is then M = 3.1 h, as it is for a real 16,384-rank run.
    return CorePolicy(baseline=BaselinePolicy(reference_world_size=16), interval=IntervalPolicy(**interval))


def decisions(outputs: list) -> tuple[list[IntervalUpdate], list[SetCheckpointInterval]]:
    updates = [o for o in outputs if isinstance(o, IntervalUpdate)]
    commands = [o for o in outputs if isinstance(o, SetCheckpointInterval)]
    return updates, commands


def test_the_first_measured_cost_sets_the_interval_and_similar_costs_change_nothing() -> None:
    job = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(200)  # 10 checkpoints
    _, outputs = run_all(job.events, policy())
    updates, commands = decisions(outputs)
    assert len(updates) == len(commands) == 1  # 30 min -> ~13.6 min, then steady
    (update,), (command,) = updates, commands
    assert (
        update.interval_s
        == command.interval_s
        == pytest.approx(young_s(update.checkpoint_cost_s, update.mtbf_s))
    )
    assert update.interval_s / MINUTE == pytest.approx(13.6, abs=0.4)
    assert update.reason.code == command.reason.code == ReasonCode.CHECKPOINT_INTERVAL
    assert "young" in update.reason.text and "30.0 min" in update.reason.text
    assert command.caused_by == [update.event_id] and command.ranks is None


def test_storage_slowing_down_tenfold_moves_the_interval() -> None:
    job = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(200)
    job.checkpoint_blocking_s = 300.0  # the filesystem degrades: the median cost follows
    job.steps(400)
    _, outputs = run_all(job.events, policy())
    updates, _ = decisions(outputs)
    # The median of the last 20 costs follows in a step or two, not on every checkpoint.
    assert 2 <= len(updates) <= 3 and updates[-1].interval_s > 2.5 * updates[0].interval_s
    assert updates[-1].checkpoint_cost_s > 200


def test_a_checkpoint_reported_by_every_rank_is_one_cost_sample() -> None:
    job = Job(checkpoint_every=0).start().steps(5)
    for rank in range(16):
        job.checkpoint_written(30.0, rank=rank)
    job.steps(5)
    job.checkpoint_written(300.0)  # a second, slow checkpoint: the median of two samples
    state, _ = run_all(job.events, policy())
    assert list(state.runs[job.run_id].interval.costs) == [30.0, 300.0]


def test_interruptions_lower_the_mtbf_and_republish_only_when_the_gain_matters() -> None:
    job = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(40)
    _, outputs = run_all(job.events, policy())
    assert len(decisions(outputs)[0]) == 1
    published: list[int] = []
    for crash in range(3):
        job.exit(crash, exit_code=1)
        job.restart(resumed_from_step=job.step)
        job.steps(40)
        _, outputs = run_all(job.events, policy())
        published.append(len(decisions(outputs)[0]))
    # One crash moves M from 3.1 h to ~2.1 h: T* moves ~18%, worth < 0.5% of goodput: silent.
    # Three crashes (M ~1.2 h) make the interval in force cost > 0.5%: republished.
    assert published[0] == 1 and published[-1] == 2


def test_every_attempt_gets_the_interval_in_force_at_its_first_step() -> None:
    """Issue 15: a command carries its attempt and a restarted rank refuses an earlier
    attempt's, so the interval derived in attempt 0 is sent again to attempts 1 and 2, once
    each, at their first completed step (their ranks are up and reading commands), although
    re-deriving finds nothing new to publish."""
    job = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(60)
    for _ in range(2):
        job.exit(3, exit_code=1, signal=9)
        job.restart(resumed_from_step=job.step - job.step % 20)
        job.steps(60)
    clamped = policy(min_s=600, max_s=600)  # T* = 10 min whatever the crashes do to M
    _, outputs = run_all(job.events, clamped)
    updates, commands = decisions(outputs)
    (update,) = updates  # derived once, in attempt 0
    assert [(c.attempt, c.interval_s) for c in commands] == [(a, update.interval_s) for a in (0, 1, 2)]
    first_steps = {
        a: min((e for e in job.events if e.KIND == "step_timing" and e.attempt == a), key=lambda e: e.ts)
        for a in (1, 2)
    }
    for again in commands[1:]:
        cause = first_steps[again.attempt]
        assert again.caused_by == [cause.event_id] and again.issued_ts == cause.ts
        assert again.ranks is None and again.reason.code == ReasonCode.CHECKPOINT_INTERVAL
        assert again.reason.text.startswith(f"attempt {again.attempt} started: the interval in force")
        assert f"sent to attempt {again.attempt - 1} is refused" in again.reason.text
    # A replay decides the same commands (ids derived from their causes).
    _, replayed = run_all(job.events, clamped)
    assert [c.command_id for c in decisions(replayed)[1]] == [c.command_id for c in commands]


def test_nothing_is_re_sent_before_the_core_published_an_interval() -> None:
    """Until the core derives one, the launcher's interval is in force: nothing to re-send."""
    job = Job(checkpoint_every=20).start().steps(30)  # no checkpoint cost measured
    job.exit(3, exit_code=1, signal=9)
    job.restart(resumed_from_step=20).steps(30)
    _, outputs = run_all(job.events, policy())
    assert decisions(outputs) == ([], [])
    fixed = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(60)
    fixed.exit(3, exit_code=1, signal=9)
    fixed.restart(resumed_from_step=60).steps(30)
    assert decisions(run_all(fixed.events, policy(mode="fixed"))[1]) == ([], [])


def test_a_fixed_interval_is_never_changed() -> None:
    job = Job(checkpoint_every=20, checkpoint_blocking_s=30.0).start().steps(200)
    _, outputs = run_all(job.events, policy(mode="fixed"))
    assert decisions(outputs) == ([], [])


def test_an_incoherent_interval_policy_is_rejected_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="min_s .* must not exceed max_s"):
        IntervalPolicy(min_s=7_200, max_s=3_600)
    with pytest.raises(ValidationError, match="mode"):
        CorePolicy.model_validate({"interval": {"mode": "sometimes"}})
