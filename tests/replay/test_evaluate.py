"""The detectors scored on the labelled scenario library through the pure core: every
injected fault is found by the right detector, on the right rank or node, in time, and
the control runs raise nothing. (The same scenarios through the live pipeline:
`trainguard evaluate --live`, reported in docs/benchmarks.md.)"""

from __future__ import annotations

import pytest

from trainguard.processors.core.policy import load_policy
from trainguard.producers.simulator import Scenario
from trainguard.replay.evaluate import EXPECTED, run_core, score
from trainguard.stack import builtin_policy

POLICY = load_policy(str(builtin_policy("evaluate")))
LIBRARY = Scenario.library()
#: The 16,384-rank control is exercised by the benchmarks, not the unit suite (minutes of CPU).
QUICK = sorted(name for name in LIBRARY if name != "control-16k")


@pytest.mark.parametrize("name", QUICK)
def test_every_fault_is_detected_and_nothing_else(name: str) -> None:
    result = run_core(LIBRARY[name], POLICY)
    if name.startswith("control"):
        assert result.truths == [] and result.detections == []  # noisy, healthy: nothing at all
    assert result.misses == [], result.misses
    assert result.false_alarms == [], [(a.detector, a.rank, a.node, a.step) for a in result.false_alarms]
    for truth in result.truths:
        board = result.detectors[EXPECTED[truth.kind]]
        assert board.tp >= 1
        if truth.kind == "slow":
            # flagged within 110 steps of onset (issue 3), and diagnosed as the ground truth says
            assert max(board.latency_steps) <= 110 and board.diagnosis_wrong == 0
        if truth.kind == "hang":
            # detected within step_timeout (3 x p99 of 0.2 s steps, floor 2 s) + 5 s
            assert max(board.latency_s) <= POLICY.hang.floor_s + 5


def test_a_detection_nobody_injected_is_a_false_positive() -> None:
    thermal = run_core(LIBRARY["straggler-thermal"], POLICY)
    flagged = [d.event for d in thermal.detections if d.detector == "straggler"]
    # Score the same detections against a scenario that injected nothing.
    result = score("no-fault", [], flagged, {}, {})
    assert result.detectors["straggler"].fp == len(flagged) and not result.misses
