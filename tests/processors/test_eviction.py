"""Straggler eviction (seed §7 step 3, R2): evict only after diagnosis and only when the
restart pays back within the horizon, with P(healthy replacement) measured from the run's
own past evictions; at most one an hour; never two in a row in one rack (page instead)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from trainguard.processors.core.decisions.eviction import (
    on_cleared,
    on_diagnosed,
    on_flagged,
    on_recovered,
    on_step,
    on_time,
    p_healthy,
    payback_s,
    straggler_cost,
)
from trainguard.processors.core.decisions.eviction_state import NEVER_S, EvictionPolicy, EvictionState
from trainguard.schemas import (
    Diagnosis,
    EvictionDecision,
    EvictionVerdict,
    EvictRank,
    InterruptionRecovered,
    Page,
    Reason,
    ReasonCode,
    StragglerAction,
    StragglerDiagnosed,
    StragglerFlagged,
    decode,
    encode,
)

T0 = 1.8e9
HOUR = 3600.0
MINUTE = 60.0
STEP_S = 10.0  # a large job's step
RANKS_PER_NODE = 8


def node_of(rank: int) -> str:
    return f"node-{rank // RANKS_PER_NODE:03d}"


def rack_of(rank: int) -> str:
    """Four nodes (32 ranks) per rack: ranks 0-31 rack-0, 32-63 rack-1, ..."""
    return f"rack-{rank // (4 * RANKS_PER_NODE)}"


@dataclass
class Run:
    """One run's eviction state driven the way the engine drives it: on_step on each new
    job step and on_time on every event; a flag goes through on_flagged before its
    diagnosis reaches on_diagnosed."""

    policy: EvictionPolicy = field(default_factory=EvictionPolicy)
    restart_s: float | None = None
    state: EvictionState = field(default_factory=EvictionState)
    attempt: int = 0
    step: int = 0
    ts: float = T0
    outputs: list[EvictionDecision | EvictRank | Page] = field(default_factory=list)
    resolved: list[bool] = field(default_factory=list)

    def steps(self, n: int) -> Run:
        for _ in range(n):
            self.step += 1
            self.ts += STEP_S
            outcome = on_step(self.state, self.attempt, self.step, self.policy)
            if outcome is not None:
                self.resolved.append(outcome.resolved)
            self.outputs += on_time(self.state, self.ts, self.attempt, self.policy, self.restart_s)
        return self

    def flag(
        self,
        rank: int,
        slowdown: float = 1.2,
        diagnosis: Diagnosis = Diagnosis.NODE_THERMAL,
        action: StragglerAction = StragglerAction.EVICT,
    ) -> list[EvictionDecision | EvictRank | Page]:
        flag = flagged(rank, self.attempt, self.step, self.ts, slowdown)
        outcome = on_flagged(self.state, flag, self.policy)
        if outcome is not None:
            self.resolved.append(outcome.resolved)
        out = on_diagnosed(
            self.state, diagnosed(flag, diagnosis, action), rack_of(rank), self.restart_s, self.policy
        )
        self.outputs += out
        return out

    def restart(self, downtime_s: float = 10 * MINUTE, lost_steps: int = 20) -> Run:
        """The eviction's checkpoint boundary: the next attempt resumes a little behind."""
        self.attempt += 1
        self.ts += downtime_s
        self.step -= lost_steps
        return self


def flagged(rank: int, attempt: int, step: int, ts: float, slowdown: float) -> StragglerFlagged:
    return StragglerFlagged(
        event_id=f"flag-{attempt}-{rank}-{step}",
        run_id="run-a",
        attempt=attempt,
        rank=rank,
        node=node_of(rank),
        step=step,
        ts=ts,
        reason=Reason(code=ReasonCode.STRAGGLER, text=f"rank {rank} {slowdown}x for 100 steps"),
        robust_z=6.5,
        slowdown=slowdown,
        consecutive_steps=100,
        onset_step=max(0, step - 100),
    )


def diagnosed(
    flag: StragglerFlagged,
    diagnosis: Diagnosis = Diagnosis.NODE_THERMAL,
    action: StragglerAction = StragglerAction.EVICT,
) -> StragglerDiagnosed:
    return StragglerDiagnosed(
        event_id=f"diag-{flag.event_id}",
        run_id=flag.run_id,
        attempt=flag.attempt,
        rank=flag.rank,
        node=flag.node,
        step=flag.step,
        ts=flag.ts,
        reason=Reason(code=ReasonCode.NODE_THERMAL, text=f"{flag.node} at 91.0 C (limit 85 C): evict"),
        caused_by=[flag.event_id],
        diagnosis=diagnosis,
        action=action,
        evidence={"node_temp_c": 91.0, "slowdown": flag.slowdown, "robust_z": flag.robust_z},
    )


def decisions(outputs: list) -> list[EvictionDecision]:
    return [o for o in outputs if isinstance(o, EvictionDecision)]


def evictions(outputs: list) -> list[EvictRank]:
    return [o for o in outputs if isinstance(o, EvictRank)]


def pages(outputs: list) -> list[Page]:
    return [o for o in outputs if isinstance(o, Page)]


def recovered(restart_s: float, n: int) -> InterruptionRecovered:
    return InterruptionRecovered(
        event_id=f"rec-{n}",
        run_id="run-a",
        attempt=n,
        rank=-1,
        node="",
        step=100,
        ts=T0 + n * HOUR,
        reason=Reason(code=ReasonCode.RESUMED, text="resumed"),
        interruption_id=f"i-{n}",
        restart_s=restart_s,
        resumed_attempt=n,
    )


# --------------------------------------------------------------------------- the payback


def test_the_seeds_arithmetic_a_20_percent_straggler_pays_back_in_50_minutes_and_is_evicted() -> None:
    assert straggler_cost(1.25) == pytest.approx(0.20)  # 1.25x slow: the job loses 20% of its steps
    assert payback_s(600.0, 1.0 * straggler_cost(1.25)) == pytest.approx(50 * MINUTE)
    policy = EvictionPolicy(prior_healthy=1.0)  # P = 1: the seed's first, unconditioned figure
    run = Run(policy=policy, restart_s=600.0).steps(300)
    out = run.flag(21, slowdown=1.25)
    (decision,) = decisions(out)
    (command,) = evictions(out)
    assert decision.decision == EvictionVerdict.EVICT and decision.reason.code == ReasonCode.EVICTION
    assert decision.p_healthy == 1.0 and decision.restart_s == 600.0
    assert decision.straggler_cost == pytest.approx(0.2) and decision.benefit == pytest.approx(0.2)
    assert decision.payback_s == pytest.approx(3000.0) and decision.horizon_s == 6 * HOUR
    assert "50 min" in decision.reason.text and "node-002" in decision.reason.text
    assert (decision.rank, decision.node, decision.step, decision.ts) == (21, "node-002", 300, T0 + 3000)
    assert decision.caused_by == ["diag-flag-0-21-300"]
    # The command: this rank, this attempt, issued at the decision's event time, caused by it.
    assert (command.rank, command.attempt, command.issued_ts) == (21, 0, decision.ts)
    assert command.caused_by == [decision.event_id] and command.ranks is None


def test_a_2_percent_straggler_does_not_pay_back_within_the_horizon() -> None:
    run = Run(restart_s=600.0).steps(300)
    (decision,) = run.flag(21, slowdown=1.02)
    # cost 1.96%, P = 0.8 (prior): benefit 1.57%, 600 s / 0.0157 = 10.6 h > 6 h
    assert decision.decision == EvictionVerdict.DECLINED
    assert decision.reason.code == ReasonCode.EVICTION_DECLINED
    assert decision.payback_s == pytest.approx(600 / (0.8 * (1 - 1 / 1.02)))
    assert decision.payback_s / HOUR == pytest.approx(10.6, abs=0.05)
    assert "10.6 h" in decision.reason.text and "horizon 6.0 h" in decision.reason.text
    # The same straggler under a 12 h horizon pays back in time.
    run = Run(policy=EvictionPolicy(horizon_s=12 * HOUR), restart_s=600.0).steps(300)
    assert decisions(run.flag(21, slowdown=1.02))[0].decision == EvictionVerdict.EVICT


def test_r_is_the_runs_measured_restart_time_once_it_has_one() -> None:
    run = Run().steps(300)  # no restart_s given: default 600 s, then the measured median
    for n, seconds in enumerate((840.0, 1_500.0, 900.0)):
        on_recovered(run.state, recovered(seconds, n), run.policy)
    (decision, _) = run.flag(21, slowdown=1.2)
    assert decision.restart_s == 900.0
    assert decision.payback_s == pytest.approx(900 / (0.8 * (1 - 1 / 1.2)))  # 112.5 min
    assert Run().steps(300).flag(21)[0].restart_s == 600.0


def test_no_slowdown_means_no_benefit_and_a_finite_never_on_the_wire() -> None:
    run = Run().steps(300)
    flag = flagged(21, 0, 300, run.ts, 1.2)
    diag = diagnosed(flag).model_copy(update={"evidence": {"node_temp_c": 91.0}})
    (decision,) = on_diagnosed(run.state, diag, "rack-0", None, run.policy)
    assert decision.decision == EvictionVerdict.DECLINED and decision.benefit == 0.0
    assert decision.payback_s == NEVER_S and "never" in decision.reason.text
    assert decode(encode(decision)) == decision


# --------------------------------------------------------------------------- diagnosis first


@pytest.mark.parametrize(
    ("diagnosis", "action"),
    [
        (Diagnosis.ENVIRONMENTAL, StragglerAction.ALERT_FACILITIES),
        (Diagnosis.UNKNOWN, StragglerAction.NONE),
    ],
)
def test_a_diagnosis_that_does_not_recommend_eviction_is_not_evicted(
    diagnosis: Diagnosis, action: StragglerAction
) -> None:
    run = Run(restart_s=600.0).steps(300)
    out = run.flag(21, slowdown=1.5, diagnosis=diagnosis, action=action)  # pays back fast: still no
    (decision,) = out
    assert decision.decision == EvictionVerdict.NOT_EVICTED and evictions(out) == []
    assert decision.reason.code == ReasonCode.EVICTION_DECLINED
    assert str(action) in decision.reason.text and "91.0 C" in decision.reason.text  # quotes the diagnosis
    # It is no eviction: neither the rate limit nor the same-rack rule counts it.
    out = run.steps(5).flag(22, slowdown=1.5)
    assert [d.decision for d in decisions(out)] == [EvictionVerdict.EVICT] and len(evictions(out)) == 1


@pytest.mark.parametrize("action", [StragglerAction.EVICT_ONCE, StragglerAction.EVICT_AND_REPLACE])
def test_evict_once_and_evict_and_replace_recommend_eviction(action: StragglerAction) -> None:
    run = Run(restart_s=600.0).steps(300)
    out = run.flag(21, slowdown=1.2, diagnosis=Diagnosis.UNKNOWN, action=action)
    assert decisions(out)[0].decision == EvictionVerdict.EVICT and len(evictions(out)) == 1


def test_nothing_is_evicted_when_the_policy_disables_eviction() -> None:
    run = Run(policy=EvictionPolicy(enabled=False), restart_s=600.0).steps(300)
    out = run.flag(21, slowdown=1.5)
    (decision,) = out
    assert decision.decision == EvictionVerdict.NOT_EVICTED and "disabled" in decision.reason.text
    assert decision.payback_s == pytest.approx(600 / (0.8 / 3))  # the numbers are still recorded
    out = run.steps(400).flag(45, slowdown=1.5)
    assert evictions(out) == [] and run.state.evictions == 0


# --------------------------------------------------------------------------- the guards


def test_a_second_straggler_within_the_hour_is_deferred_then_evicted_once_the_hour_has_passed() -> None:
    run = Run(restart_s=600.0).steps(300)
    (first, _) = run.flag(21, slowdown=1.2)  # node-002, rack-0
    assert first.decision == EvictionVerdict.EVICT
    run.steps(60).restart()  # the checkpoint boundary 10 min later, 10 min to restart
    run.steps(60)  # 10 more minutes into attempt 1
    assert run.ts - first.ts == pytest.approx(30 * MINUTE)
    (deferred,) = run.flag(45, slowdown=1.2)  # node-005, rack-1
    assert deferred.decision == EvictionVerdict.DEFERRED and deferred.attempt == 1
    assert deferred.reason.code == ReasonCode.EVICTION_DEFERRED
    assert "30 min" in deferred.reason.text and "one per 60 min" in deferred.reason.text
    before = len(run.outputs)
    run.steps(179)  # 29 min 50 s: the hour since the first eviction is not over
    assert run.ts - first.ts < HOUR and run.outputs[before:] == []
    run.steps(1)  # exactly one hour after the first eviction
    (again, command) = run.outputs[before:]
    assert isinstance(again, EvictionDecision) and isinstance(command, EvictRank)
    assert again.decision == EvictionVerdict.EVICT and again.ts - first.ts == HOUR
    assert (again.rank, again.attempt) == (45, 1) and again.caused_by == [
        deferred.caused_by[0],
        deferred.event_id,
    ]
    assert (command.rank, command.attempt, command.issued_ts) == (45, 1, again.ts)
    assert again.event_id != deferred.event_id
    run.steps(400)
    assert len(evictions(run.outputs)) == 2  # decided once


def test_at_most_one_deferred_candidate_is_evicted_per_hour_the_costliest_first() -> None:
    run = Run(restart_s=600.0).steps(300)
    run.flag(21, slowdown=1.2)
    run.steps(60).restart().steps(60)
    run.flag(45, slowdown=1.1)  # rack-1
    run.flag(77, slowdown=1.3)  # rack-2: costs more, pays back sooner
    run.steps(180)  # the hour has passed: one of them goes
    assert [c.rank for c in evictions(run.outputs)] == [21, 77]
    run.steps(300)  # 50 minutes on: rank 45 still waits its hour
    assert [c.rank for c in evictions(run.outputs)] == [21, 77]
    run.steps(60)
    assert [c.rank for c in evictions(run.outputs)] == [21, 77, 45]
    ts = [d.ts for d in decisions(run.outputs) if d.decision == EvictionVerdict.EVICT]
    assert ts[1] - ts[0] >= HOUR and ts[2] - ts[1] >= HOUR


def test_a_deferred_candidate_is_dropped_when_it_clears_or_a_new_attempt_starts() -> None:
    run = Run(restart_s=600.0).steps(300)
    run.flag(21)
    run.steps(60).restart().steps(60)
    run.flag(45)
    on_cleared(run.state, 45)  # the straggle resolved itself
    run.steps(400)
    assert [c.rank for c in evictions(run.outputs)] == [21]

    run = Run(restart_s=600.0).steps(300)
    run.flag(21)
    run.steps(60).restart().steps(60)
    run.flag(45)
    run.steps(30).restart()  # attempt 1 crashed; an EvictRank for it would name a dead attempt
    run.steps(400)
    assert [c.rank for c in evictions(run.outputs)] == [21]


def test_two_consecutive_evictions_in_one_rack_page_a_human_instead() -> None:
    run = Run(restart_s=600.0).steps(300)
    (first, _) = run.flag(21)  # node-002, rack-0
    run.steps(60).restart().steps(720)  # two hours later: the rate limit is not what stops it
    out = run.flag(9)  # node-001, rack-0 again
    (decision, page) = out
    assert evictions(out) == []
    assert isinstance(decision, EvictionDecision) and isinstance(page, Page)
    assert decision.decision == EvictionVerdict.PAGED and decision.reason.code == ReasonCode.PAGE_SAME_RACK
    assert page.rule == "same_rack_eviction" and page.reason.code == ReasonCode.PAGE_SAME_RACK
    assert page.evidence == [first.event_id, decision.caused_by[0]]
    assert (page.rank, page.node, page.ts) == (9, "node-001", decision.ts)
    assert "rack-0" in page.reason.text and "human" in page.reason.text
    # Another straggler of that rack: not evicted either, and not paged twice.
    run.steps(720)
    (again,) = run.flag(17)
    assert again.decision == EvictionVerdict.PAGED and "already paged" in again.reason.text


def test_a_second_gpu_of_the_node_being_evicted_is_that_nodes_eviction_not_another() -> None:
    run = Run(restart_s=600.0).steps(300)
    (first, _) = run.flag(21)  # node-002, rack-0: evicted at the next checkpoint boundary
    run.steps(30)
    (second,) = run.flag(17)  # node-002 too: a second GPU of the node already leaving
    assert second.decision == EvictionVerdict.NOT_EVICTED
    assert second.reason.code == ReasonCode.NODE_ALREADY_LEAVING
    assert "node-002 already leaves the job" in second.reason.text
    assert "one node, one eviction" in second.reason.text
    run.steps(720)  # no deferral comes back later as a same-rack page
    assert [c.rank for c in evictions(run.outputs)] == [21] and pages(run.outputs) == []
    # In the next attempt node-002's slot holds a new node: its straggler is judged afresh.
    run.restart().steps(400)
    assert [d.reason.code for d in decisions(run.flag(17))] == [ReasonCode.PAGE_SAME_RACK]


def test_an_eviction_in_another_rack_in_between_resets_the_same_rack_rule() -> None:
    run = Run(restart_s=600.0).steps(300)
    run.flag(21)  # rack-0
    run.steps(60).restart().steps(720)
    run.flag(45)  # rack-1
    run.steps(60).restart().steps(720)
    run.flag(9)  # rack-0 again, but not consecutively
    assert [c.rank for c in evictions(run.outputs)] == [21, 45, 9] and pages(run.outputs) == []


# --------------------------------------------------------------------------- P(healthy)


def test_p_healthy_falls_as_evictions_stop_helping_and_eviction_then_stops() -> None:
    """An aisle that runs hot without tripping the rack rule: every replacement straggles
    again. P falls with each unresolved eviction until R / (P x cost) exceeds the horizon."""
    run = Run().steps(300)
    for n, seconds in enumerate((840.0, 900.0, 960.0)):  # R: the run's restarts, median 900 s
        on_recovered(run.state, recovered(seconds, n), run.policy)
    p_values, repeats = [], []
    for rank in (5, 37, 69):  # rack-0, rack-1, rack-2
        (decision, command) = run.flag(rank, slowdown=1.1)  # costs 9.1% of the job
        assert decision.decision == EvictionVerdict.EVICT and command.rank == rank
        p_values.append(decision.p_healthy)
        run.steps(60).restart()  # evicted at the checkpoint boundary
        run.steps(110)  # the replacement straggles too: flagged again after 100 slow steps
        repeat = decisions(run.flag(rank, slowdown=1.1))[0]
        assert repeat.p_healthy < p_values[-1]  # counted before the repeat is decided
        repeats.append(repeat.decision)
        run.steps(400)
    assert run.resolved == [False, False, False]
    # Its own rack's eviction straggling again pages a human, until P is too low to evict at all.
    assert repeats == [EvictionVerdict.PAGED, EvictionVerdict.PAGED, EvictionVerdict.DECLINED]
    (declined,) = run.flag(101, slowdown=1.1)  # rack-3
    p_values.append(declined.p_healthy)
    assert p_values == pytest.approx([0.8, 3.2 / 5, 3.2 / 6, 3.2 / 7])  # Beta(3.2, 0.8) posterior means
    assert all(a > b for a, b in zip(p_values, p_values[1:], strict=False))
    assert declined.decision == EvictionVerdict.DECLINED
    assert (declined.evictions_resolved, declined.evictions_unresolved) == (0, 3)
    assert declined.payback_s == pytest.approx(900 / (3.2 / 7 * (1 - 1 / 1.1)))  # 6.02 h > 6 h
    assert "0 of 3 past evictions resolved" in declined.reason.text
    # A payback period, not a threshold: a straggler that costs a third of the job still pays.
    run.steps(10)
    assert decisions(run.flag(102, slowdown=1.5))[0].decision == EvictionVerdict.EVICT


def test_evictions_that_resolve_the_straggle_raise_p() -> None:
    run = Run(restart_s=600.0).steps(300)
    run.flag(21)
    assert p_healthy(run.state, run.policy) == pytest.approx(0.8)
    run.steps(60).restart()
    run.steps(200)
    assert run.resolved == []  # not yet: its first step and 199 past it
    run.flag(40)  # another rank straggling does not decide this eviction's outcome
    run.steps(1)
    assert run.resolved == [True]
    assert p_healthy(run.state, run.policy) == pytest.approx(4.2 / 5)
    run.flag(21)  # flagged after the window: a new straggle, not this eviction's failure
    assert (run.state.resolved, run.state.unresolved) == (1, 0)


def test_the_outcome_is_judged_in_the_attempt_after_the_eviction_not_the_one_it_was_issued_in() -> None:
    run = Run(restart_s=600.0).steps(300)
    run.flag(21)
    run.steps(30)
    on_flagged(run.state, flagged(21, 0, run.step, run.ts, 1.2), run.policy)  # the old streak, same attempt
    run.steps(300)  # the boundary has not come yet: steps of attempt 0 judge nothing
    assert (run.state.resolved, run.state.unresolved) == (0, 0)
    run.restart().steps(150)
    outcome = on_flagged(run.state, flagged(21, 1, run.step, run.ts, 1.2), run.policy)
    assert outcome is not None and not outcome.resolved and run.state.unresolved == 1


# --------------------------------------------------------------------------- replay


def test_the_same_diagnosis_delivered_twice_is_decided_once_and_a_replay_decides_the_same() -> None:
    def play() -> Run:
        run = Run(restart_s=600.0).steps(300)
        flag = flagged(21, 0, run.step, run.ts, 1.2)
        diag = diagnosed(flag)
        for _ in range(2):  # at-least-once delivery
            on_flagged(run.state, flag, run.policy)
            run.outputs += on_diagnosed(run.state, diag, "rack-0", run.restart_s, run.policy)
        run.steps(60).restart().steps(60)
        run.flag(45)
        run.steps(400)
        return run

    first, second = play(), play()
    assert [type(o).__name__ for o in first.outputs] == [
        "EvictionDecision", "EvictRank", "EvictionDecision", "EvictionDecision", "EvictRank",
    ]  # fmt: skip
    assert first.outputs == second.outputs  # same ids, same numbers: consumers dedupe a replay
    assert len({o.event_id for o in decisions(first.outputs)}) == 3
