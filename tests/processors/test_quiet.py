"""Quiet heartbeats, step stats and GPU health fold from their rows (processors/core/folds/quiet.py)
to the decisions, the dead letters and the whole state of their models folded by ``step``,
on runs where the events that are not quiet matter: a gradient spike and a NaN burst (the
step stats the SDC detector judges), a hang (the heartbeats whose stall the watchdog
sees), that hang on a run cut in 8 shards (the shards forward the phases of stalled
ranks), stragglers diagnosed from their nodes' GPU health (a hot node; a narrow NVLink,
sharded). Most of them take the quiet fold, and the ones that decide do not."""

from __future__ import annotations

import pytest

from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import GpuHealth, Heartbeat, StepStats

from ..schemas.test_columnar import folds, same

#: (scenario, ranks a shard, what it decides, the most of its heartbeats and step stats
#: that may go through ``step``: a healthy stretch's are quiet; a hang's stalled heartbeats
#: and a restarting attempt's are not).
CASES = [
    ("grad-spike", 4096, b"grad_spike", 0.05),
    ("nan-burst", 4096, b"non_finite_loss", 0.5),
    ("hang-allreduce", 4096, b"hang_detected", 0.3),
    ("hang-allreduce", 16, b"hang_detected", 0.3),
    ("straggler-thermal", 4096, b"node_thermal", 0.05),
    ("straggler-nvlink", 16, b"node_link", 0.05),
]


@pytest.mark.parametrize(
    ("name", "shard_ranks", "decided", "most_by_step"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_quiet_heartbeats_and_step_stats_fold_as_step_folds_them(
    name: str, shard_ranks: int, decided: bytes, most_by_step: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    through_step = {True: 0, False: 0}  # the three kinds' events that ``step`` folded, by mode
    fold_one = CoreDriver._fold

    def counted(self, event, result, hint, shard, shard_ranks):  # type: ignore[no-untyped-def]
        through_step[self.columnar] += type(event) in (Heartbeat, StepStats, GpuHealth)
        fold_one(self, event, result, hint, shard, shard_ranks)

    monkeypatch.setattr(CoreDriver, "_fold", counted)
    scenario = Scenario.builtin(name)
    (as_rows, rows_state), (by_step, step_state) = folds(scenario, shard_ranks=shard_ranks)
    assert as_rows == by_step
    assert any(decided in out for out in as_rows), decided  # the fault was decided
    same(rows_state, step_state)
    # Most were quiet (every one of them went through ``step`` in the reference).
    assert through_step[True] <= most_by_step * through_step[False], through_step
