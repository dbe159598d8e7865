"""Goodput accounting (seed §6): the reports add up the run's measured losses: checkpoint
blocking, work re-done after interruptions, restart time, a straggler's pace; and a
collapse below 0.3 over the last hour pages (R5)."""

from __future__ import annotations

import random

import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy
from trainguard.processors.core.accounting.goodput import GoodputPolicy, GoodputState, advance, breakdown
from trainguard.schemas import CheckpointWritten, GoodputReport, Interruption, InterruptionRecovered, Page

POLICY = CorePolicy(baseline=BaselinePolicy(reference_world_size=16))
HOUR = 3600.0


def of(kind: type, outputs: list) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def hourly(outputs: list) -> list[GoodputReport]:
    return [r for r in of(GoodputReport, outputs) if r.window_s == HOUR]


def test_a_healthy_run_loses_only_its_checkpoint_blocking() -> None:
    job = Job(step_s=60.0, checkpoint_every=10, checkpoint_blocking_s=30.0).start().steps(150)  # 2.5 h
    _, outputs = run_all(job.events, POLICY)
    reports = hourly(outputs)
    assert len(reports) >= 12  # every 10 minutes of event time
    last = reports[-1]
    blocked = sum(e.blocking_s for e in of(CheckpointWritten, job.events) if last.ts - HOUR < e.ts <= last.ts)
    assert last.checkpoint_s == pytest.approx(blocked, abs=31)  # minute buckets at the edges
    assert last.elapsed_s == pytest.approx(HOUR, abs=61)
    assert last.lost_s == last.restart_s == last.straggler_s == 0
    assert last.goodput == pytest.approx(1 - last.checkpoint_s / last.elapsed_s)
    assert 0.94 < last.goodput < 0.97 and not of(Page, outputs)
    # 1 h, 24 h and 7 d reports, each with its own window
    assert {r.window_s for r in of(GoodputReport, outputs)} == {HOUR, 86_400.0, 604_800.0}


def test_an_interruption_costs_its_lost_steps_and_its_restart() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(45)  # last checkpoint at 40
    job.exit(3, exit_code=1)
    job.restart(resumed_from_step=40, delay_s=300.0)
    job.steps(60)
    _, outputs = run_all(job.events, POLICY)
    (crash,) = of(Interruption, outputs)
    (recovered,) = of(InterruptionRecovered, outputs)
    report = [r for r in hourly(outputs) if r.ts > recovered.ts][0]
    assert report.lost_s == pytest.approx(crash.lost_steps * 60.0, rel=0.06)  # median step ~60 s
    assert report.restart_s == pytest.approx(recovered.restart_s, abs=1.0)
    overhead = (report.lost_s + report.restart_s) / report.elapsed_s
    assert report.goodput == pytest.approx(1 - overhead)


def test_a_stuck_restart_pages_on_goodput_at_most_once_an_hour() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(30)
    for rank in (1, 2):  # two ordinary failures: 5-minute restarts
        job.exit(rank, exit_code=1)
        job.restart(resumed_from_step=job.step - job.step % 10, delay_s=300.0)
        job.steps(40)
    job.exit(3, exit_code=1)  # then a restart that hangs for 100 minutes
    job.restart(resumed_from_step=job.step - job.step % 10, delay_s=6000.0)
    job.steps(30)
    _, outputs = run_all(job.events, POLICY)
    collapse = [p for p in of(Page, outputs) if p.rule == "goodput"]
    assert collapse and all(b.ts - a.ts >= HOUR for a, b in zip(collapse, collapse[1:], strict=False))
    reports = {r.event_id: r for r in hourly(outputs)}
    for page in collapse:
        assert reports[page.caused_by[0]].goodput < 0.3 and "usual 359 s restart" in page.reason.text
    stuck = of(Interruption, outputs)[-1]
    assert all(p.ts > stuck.ts for p in collapse)  # the ordinary failures paged nothing
    # every hourly report under 0.3 with enough history is covered by a page in its hour
    low = [r for r in reports.values() if r.goodput < 0.3 and r.elapsed_s >= 1800]
    assert low and all(any(0 <= r.ts - p.ts < HOUR for p in collapse) for r in low)


def test_failures_at_their_usual_price_page_on_rate_not_goodput() -> None:
    """A crash every ~12 minutes with the run's usual restarts: the hour's goodput is
    gone, and the pattern is the failure rate (paged by that rule), not the goodput."""
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(30)
    for rank in range(1, 8):
        job.exit(rank, exit_code=1)
        job.restart(resumed_from_step=job.step - job.step % 10, delay_s=600.0)
        job.steps(2)
    job.steps(30)
    _, outputs = run_all(job.events, POLICY)
    assert any(r.goodput < 0.3 and r.elapsed_s >= 1800 for r in hourly(outputs))
    rules = [p.rule for p in of(Page, outputs)]
    assert "failure_rate" in rules and "goodput" not in rules


def test_a_straggler_costs_its_slowdown_of_the_training_time() -> None:
    state, policy = GoodputState(), GoodputPolicy()
    advance(state, 0.0, False, policy)
    state.slowdowns[17] = 1.25  # flagged: the job runs at this rank's pace
    for t in range(60, 3601, 60):
        advance(state, float(t), False, policy)
    b = breakdown(state, 3600.0, HOUR)
    assert b.straggler == pytest.approx(0.2 * 3600.0)  # (1 - 1/1.25) of the hour
    assert b.goodput == pytest.approx(0.8)
    del state.slowdowns[17]  # cleared: no further cost
    advance(state, 3660.0, False, policy)
    assert breakdown(state, 3660.0, HOUR).straggler == pytest.approx(0.2 * 3540.0)


def test_events_that_only_move_the_clock_account_the_same_in_any_order() -> None:
    """The clock steps through the running maximum of the event times, and each step's
    pieces are differences of close floats (exact) whose sums stay exact: the same events
    in another order (a stretch of quiet rows of several kinds folded kind by kind, issue
    20) leave the same buckets, to the bit, and the same windows. (Not so while a
    straggler is flagged: its accrual, piece x slowdown, rounds; such a fold keeps order.)"""
    rng, policy = random.Random(20), GoodputPolicy()
    for start in [1_796_423_880.123456, 1_000.0] * 25:  # a wall clock's ts, the simulator's
        # ~20 nodes' flushes over a few minutes: times spread and repeated, as a log has them.
        stamps = [start + rng.choice([rng.uniform(0, 400), round(rng.uniform(0, 400), 1)]) for _ in range(99)]
        stamps *= 3
        states = []
        for order in (stamps, rng.sample(stamps, len(stamps)), sorted(stamps)):
            state = GoodputState()
            advance(state, start, False, policy)
            for ts in order:
                advance(state, ts, False, policy)
            states.append(state)
        first = states[0]
        for other in states[1:]:
            assert other.clock == first.clock
            assert {k: m.elapsed for k, m in other.minutes.items()} == {
                k: m.elapsed for k, m in first.minutes.items()
            }
            assert other.totals == first.totals
            assert breakdown(other, other.clock, 3600.0) == breakdown(first, first.clock, 3600.0)
