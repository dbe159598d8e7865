"""What a user suffers, scored (harness/scoring/harms.py): each harm on the decisions of a library
scenario run through the pure core in a closed loop, some of them edited to make the harm
(a page nobody expects, a rollback target after the onset, a release)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from harness.devtools.stack import builtin_policy
from harness.scoring.evaluate import ClosedLoop, closed_loop, score_loop
from harness.scoring.harms import UNATTRIBUTED, assess, truth_label
from trainguard.processors.core.policy import load_policy
from trainguard.producers.simulator import Scenario, ScenarioError
from trainguard.producers.simulator.scenario import Expect
from trainguard.schemas import (
    Derived,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    Page,
    Reason,
    ReasonCode,
    StragglerFlagged,
)

POLICY = load_policy(str(builtin_policy("evaluate")))
LIBRARY = Scenario.library()
_LOOPS: dict[str, ClosedLoop] = {}


def loop(name: str) -> ClosedLoop:
    """The scenario through the pure core (cached: several tests read one run)."""
    if name not in _LOOPS:
        _LOOPS[name] = closed_loop(LIBRARY[name], POLICY)
    return _LOOPS[name]


def harms_of(name: str, outputs: list | None = None, expect: Expect | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    scenario, run = LIBRARY[name], loop(name)
    return assess(
        scenario.truth(),
        run.outputs if outputs is None else outputs,
        expect if expect is not None else scenario.expect,
        scenario.world_size,
        racks=scenario.racks(),
        step_started_ts=run.step_started_ts,
        **kwargs,  # type: ignore[arg-type]
    )


class NodeReleased(Derived):
    """Stands for the release WP-C adds: a quarantined node back in the pool, with the reason."""

    KIND: ClassVar[str] = "quarantine_released"
    VERSION: ClassVar[int] = 1


# --------------------------------------------------------------------------- pages


def test_a_data_fault_pages_same_step_rightly_and_nothing_else_is_suffered() -> None:
    """The repeating data fault (issue 14): same_step pages (explained by the truth: a data
    fault repeating at that step); the run is paused rather than restarted into the step,
    no same_node page blames the spare, and the node quarantined at the first failure is
    released with the reason."""
    harms = harms_of("data-fault-repeat")
    assert [line.split(" at ")[0] for line in harms.pages_right] == ["same_step"]
    assert harms.false_pages == [] and harms.pages_missing == []
    assert harms.false_quarantines == [] and [line.split(" ")[0] for line in harms.released] == ["node-0009"]
    assert harms.restarts_after_same_step == []


def test_restarts_after_the_same_step_page_and_an_unreleased_node_count_against_the_run() -> None:
    """The same run with the pause and the release taken out (what the core did before
    issue 14 sent them): the quarantine stands as false, and a later failure at the paged
    step counts as a restart into it."""
    run = loop("data-fault-repeat")
    kept = [o for o in run.outputs if o.KIND not in ("quarantine_released", "release_node")]
    harms = harms_of("data-fault-repeat", kept)
    assert [line.split(" ")[0] for line in harms.false_quarantines] == ["node-0009"] and harms.released == []
    page = next(o for o in run.outputs if isinstance(o, Page) and o.rule == "same_step")
    again = next(o for o in run.outputs if isinstance(o, Interruption) and o.step == page.step)
    update = {
        "event_id": "again",
        "interruption_id": "again",
        "attempt": again.attempt + 5,
        "ts": page.ts + 60,
    }
    later = again.model_copy(update=update)
    assert len(harms_of("data-fault-repeat", [*kept, later]).restarts_after_same_step) == 1


def test_an_unexpected_page_is_false_a_tolerated_one_is_not_an_expected_one_must_come() -> None:
    run = loop("straggler-thermal")
    flag = next(o for o in run.outputs if isinstance(o, StragglerFlagged))
    goodput_page = Page(
        event_id="page-x",
        run_id=flag.run_id,
        attempt=flag.attempt,
        rank=-1,
        node="",
        step=flag.step,
        ts=flag.ts,
        reason=Reason(code=ReasonCode.PAGE_GOODPUT, text="goodput 0.2 over the last 1 h"),
        rule="goodput",
    )
    outputs = [*run.outputs, goodput_page]
    assert len(harms_of("straggler-thermal", outputs).false_pages) == 1
    tolerated = harms_of("straggler-thermal", outputs, Expect(allow_pages=["goodput"]))
    assert tolerated.false_pages == [] and len(tolerated.pages_tolerated) == 1
    missing = harms_of("straggler-thermal", run.outputs, Expect(pages=["goodput"]))
    assert missing.pages_missing == ["goodput"]
    assert missing.violations(Expect(pages=["goodput"])) == ["page missing: goodput"]


def test_a_facilities_page_is_right_for_a_hot_rack_and_false_for_a_hot_node() -> None:
    """The rack detector's alert (WP-B): explained by a hot aisle, not by one hot node."""
    for name, right in (("straggler-hot-aisle", True), ("straggler-thermal", False)):
        run = loop(name)
        flag = next(o for o in run.outputs if isinstance(o, StragglerFlagged))
        alert = Page(
            **flag.model_dump(include={"run_id", "attempt", "node", "step", "ts"}),
            event_id="page-facilities",
            rank=-1,
            reason=Reason(code=ReasonCode.ENVIRONMENTAL, text=f"{flag.node}'s rack is hot: alert facilities"),
            rule="facilities",
        )
        before = harms_of(name)
        harms = harms_of(name, [*run.outputs, alert])
        assert before.false_pages == [], name  # the hot aisle's own facilities page is right too
        added = (len(harms.pages_right) - len(before.pages_right), len(harms.false_pages))
        assert added == ((1, 0) if right else (0, 1)), name


# --------------------------------------------------------------------------- quarantines


def test_a_quarantined_innocent_node_released_with_its_reason_counts_as_released() -> None:
    run = loop("data-fault-repeat")
    quarantined = next(o for o in run.outputs if o.KIND == "quarantine")
    release = NodeReleased(
        event_id="release-1",
        run_id=quarantined.run_id,
        attempt=quarantined.attempt + 1,
        rank=-1,
        node=quarantined.node,
        step=quarantined.step,
        ts=quarantined.ts + 10,
        reason=Reason(code=ReasonCode.QUARANTINE, text="step 237 failed again on a spare: data"),
    )
    harms = harms_of("data-fault-repeat", [*run.outputs, release])
    assert harms.false_quarantines == [] and [line.split(" ")[0] for line in harms.released] == ["node-0009"]


def test_a_quarantine_of_the_faulty_node_is_right() -> None:
    harms = harms_of("hang-allreduce")
    quarantines = [o for o in loop("hang-allreduce").outputs if o.KIND == "quarantine"]
    assert [q.node for q in quarantines] == ["node-0012"]  # rank 100's node
    assert harms.false_quarantines == [] and harms.violations(Expect()) == []


# --------------------------------------------------------------------------- rollbacks


def _sdc_interruption(outputs: list) -> Interruption:  # type: ignore[type-arg]
    return next(o for o in outputs if isinstance(o, Interruption) and o.cause == InterruptionCause.SDC)


def test_the_wrong_gpus_rollback_goes_behind_its_onset() -> None:
    """sdc-wrong-gpu: the wrong GPU is deterministic from step 300; the rollback goes to the
    newest validated checkpoint at or before the last passing cross-rank check that covered
    it (before issue 14: at or before the self-check watermark, checkpoint 2500)."""
    run = loop("sdc-wrong-gpu")
    assert _sdc_interruption(run.outputs).last_checkpoint_step <= 300
    harms = harms_of("sdc-wrong-gpu")
    assert harms.rollbacks == 1 and harms.wrong_rollbacks == []


def test_a_bit_flips_onset_is_the_check_that_saw_it() -> None:
    """sdc-bitflip: armed at step 250, it strikes in the check of step 401; the rollback to
    checkpoint 300 (the newest at or before the last passing check) is right."""
    run = loop("sdc-bitflip")
    assert _sdc_interruption(run.outputs).last_checkpoint_step == 300
    harms = harms_of("sdc-bitflip")
    assert harms.rollbacks == 1 and harms.wrong_rollbacks == []


@pytest.mark.parametrize(("target", "wrong"), [(250, False), (300, False), (350, True)])
def test_a_rollback_is_right_only_to_a_checkpoint_at_or_before_the_onset(target: int, wrong: bool) -> None:
    """Issue 14's acceptance: every rollback target at or before the fault's onset."""
    run = loop("sdc-wrong-gpu")
    found = _sdc_interruption(run.outputs)
    moved = [
        o.model_copy(update={"last_checkpoint_step": target}) if o is found else o
        for o in run.outputs
        if o.KIND != "rollback"  # the command names the same target
    ]
    assert len(harms_of("sdc-wrong-gpu", moved).wrong_rollbacks) == int(wrong)


# --------------------------------------------------------------------------- phantoms


def test_phantom_records_not_rejected_are_accepted() -> None:
    harms = harms_of("control-healthy", phantoms=(10, 4))
    assert (harms.phantoms_sent, harms.phantoms_rejected, harms.phantoms_accepted) == (10, 4, 6)
    assert harms.violations(Expect()) == ["phantom_accepted: 6 phantom record(s) accepted"]


def test_a_decision_naming_a_rank_outside_the_world_counts_as_a_phantom_accepted() -> None:
    run = loop("straggler-thermal")
    flag = next(o for o in run.outputs if isinstance(o, StragglerFlagged))
    phantom = flag.model_copy(update={"event_id": "phantom-flag", "rank": 4100, "node": "node-phantom"})
    assert harms_of("straggler-thermal", [*run.outputs, phantom]).phantoms_accepted == 1


# --------------------------------------------------------------------------- goodput


def test_goodput_lost_is_attributed_to_the_fault_from_the_cores_accounting() -> None:
    run = loop("hang-allreduce")
    (recovered,) = [o for o in run.outputs if isinstance(o, InterruptionRecovered)]
    harms = harms_of("hang-allreduce")
    (truth,) = LIBRARY["hang-allreduce"].truth()
    expected = recovered.phases["detect"] + recovered.restart_s + recovered.lost_s
    assert harms.lost_s == {truth_label(truth): pytest.approx(expected)}
    assert UNATTRIBUTED not in harms.lost_s


def test_a_slowdown_costs_its_pace_until_it_is_flagged() -> None:
    run = loop("straggler-thermal")
    (truth,) = LIBRARY["straggler-thermal"].truth()
    first = min((o for o in run.outputs if isinstance(o, StragglerFlagged)), key=lambda o: o.ts)
    onset = run.step_started_ts[truth.step]
    lost = harms_of("straggler-thermal").lost_s[truth_label(truth)]
    before_detection = (first.ts - onset) * (1 - 1 / first.slowdown)
    assert before_detection > 0 and lost >= before_detection  # plus the eviction's restart, if any


# --------------------------------------------------------------------------- expect


def test_a_scenario_without_expect_forbids_every_harm_and_unknown_names_fail() -> None:
    assert set(Scenario.builtin("control-healthy").expect.must_not) == {
        "page_false",
        "quarantine_innocent",
        "rollback_after_onset",
        "restart_after_same_step",
        "phantom_accepted",
    }
    base = Scenario.builtin("control-healthy").model_dump(mode="json")
    for expect, field in (
        ({"must_not": ["page_flase"]}, "expect.must_not.0"),
        ({"pages": ["same_stepp"]}, "expect.pages.0"),
        ({"forbid": []}, "expect.forbid"),
    ):
        with pytest.raises(ScenarioError, match=field.replace(".", r"\.")):
            Scenario.parse({**base, "expect": expect})


def test_phantom_ranks_must_lie_outside_the_world() -> None:
    base = Scenario.builtin("control-healthy").model_dump(mode="json")
    fault = {"kind": "phantom_ranks", "ranks": [255, 256], "from_step": 1}
    with pytest.raises(ScenarioError, match=r"faults\.0\.ranks: \[255\] are inside world_size 256"):
        Scenario.parse({**base, "faults": [fault]})


# --------------------------------------------------------------------------- mixed-256


def test_mixed_256_scored_through_the_pure_core() -> None:
    """The small mixed-fault scenario (issue 14): a thermal node, a NIC node, an 8% hot
    rack, a deterministically wrong GPU, a hang, crashes, a data fault repeating at one
    step and records from ranks that do not exist, in one run. Every fault found with its
    cause, and nothing a user would suffer: no false page, no innocent node left
    quarantined (the data fault's first node is released), the rollback behind the wrong
    GPU's onset, no restart into the failing step after the same_step page, one facilities
    page for the hot rack however often the run restarts, every phantom record rejected."""
    scenario = LIBRARY["mixed-256"]
    result = score_loop(scenario, closed_loop(scenario, POLICY))
    h = result.harms
    assert h.phantoms_sent == h.phantoms_rejected > 0 and h.phantoms_accepted == 0
    assert result.false_alarms == [] and result.misses == []
    assert {"group_slowdown", "sdc_cross_rank", "straggler", "hang", "crash"} <= set(result.detectors)
    for name, board in result.detectors.items():
        assert board.fn == 0 and board.fp == 0 and board.diagnosis_wrong == 0, name
    assert h.false_pages == [] and h.pages_missing == []
    assert sorted(line.split(" at ")[0] for line in h.pages_right) == ["facilities", "same_step"]
    assert h.false_quarantines == []
    assert [line.split(" ")[0] for line in h.released] == ["node-0009"]
    assert h.rollbacks == 1 and h.wrong_rollbacks == []
    assert h.restarts_after_same_step == []
    assert not result.failed and result.violations == []
