"""The rank side's checkpoint cadence: the interval in force (seconds) counted in steps of
the measured step time; a fixed cadence in steps overrides it."""

from __future__ import annotations

import pytest

from trainguard.producers.checkpoint.cadence import CheckpointCadence


def run(cadence: CheckpointCadence, steps: range, step_s: float, t0: float = 100.0) -> list[int]:
    """Steps of `step_s` seconds each; the steps after which a checkpoint was due (and taken)."""
    saved = []
    for i, step in enumerate(steps):
        cadence.begin(step, t0 + i * step_s)
        end = t0 + (i + 1) * step_s
        if cadence.due(step, end):
            cadence.saved(step, end)
            saved.append(step)
    return saved


def test_the_interval_in_force_is_counted_in_steps_of_the_measured_step_time() -> None:
    cadence = CheckpointCadence(interval_s=2.0)
    saved = run(cadence, range(0, 100), step_s=0.1)  # 2 s at 0.1 s a step: every 20 steps
    assert cadence.steps_per_checkpoint() == 20
    assert saved == [19, 39, 59, 79, 99]
    assert cadence.describe() == "every 2s = 20 steps of 0.1s"


def test_a_resumed_process_counts_from_its_first_step() -> None:
    cadence = CheckpointCadence(interval_s=1.0)
    assert run(cadence, range(120, 150), step_s=0.1) == [129, 139, 149]


def test_before_the_step_time_is_measured_the_seconds_count() -> None:
    cadence = CheckpointCadence(interval_s=0.25, min_samples=5)
    # Slow first steps (a cold process): the wall clock decides until 5 samples exist.
    assert run(cadence, range(0, 3), step_s=0.2) == [1]
    assert cadence.step_s() is None and "not measured yet" in cadence.describe()


def test_a_new_interval_applies_from_the_last_save() -> None:
    cadence = CheckpointCadence(interval_s=1.0)
    assert run(cadence, range(0, 20), step_s=0.1) == [9, 19]
    cadence.set_interval(3.0)  # a SetCheckpointInterval: 30 steps from the last save
    assert run(cadence, range(20, 80), step_s=0.1, t0=102.0) == [49, 79]
    cadence.set_interval(None)
    assert run(cadence, range(80, 200), step_s=0.1, t0=108.0) == []


def test_the_step_count_follows_the_step_time() -> None:
    cadence = CheckpointCadence(interval_s=2.0, window=10)
    run(cadence, range(0, 30), step_s=0.1)
    assert cadence.steps_per_checkpoint() == 20
    run(cadence, range(30, 60), step_s=0.4, t0=103.0)  # the job slowed down fourfold
    assert cadence.steps_per_checkpoint() == 5


def test_a_fixed_cadence_overrides_the_interval() -> None:
    cadence = CheckpointCadence(interval_s=0.01, every_steps=10)
    assert run(cadence, range(0, 40), step_s=0.1) == [9, 19, 29, 39]
    assert run(CheckpointCadence(every_steps=10), range(5, 25), step_s=0.1) == [9, 19]
    assert CheckpointCadence(every_steps=7).describe() == "every 7 steps (fixed)"
    with pytest.raises(ValueError, match="every_steps must be >= 1"):
        CheckpointCadence(every_steps=0)


def test_no_interval_no_checkpoint_on_time() -> None:
    cadence = CheckpointCadence()
    assert run(cadence, range(0, 1000), step_s=10.0) == []
    assert cadence.describe() == "none on time"


def run_costly(cadence: CheckpointCadence, steps: int, step_s: float, cost_s: float) -> list[int]:
    """Steps of `step_s` seconds, a save making its step `cost_s` longer (the blocking
    copy the loop waits for): the steps after which a checkpoint was taken."""
    saved, now = [], 0.0
    for step in range(steps):
        cadence.begin(step, now)
        now += step_s
        if cadence.due(step, now):
            cadence.saved(step, now)
            saved.append(step)
            now += cost_s
    return saved


def test_without_an_interval_the_prior_mtbf_and_the_measured_cost_give_youngs_interval() -> None:
    """Offline (no processor, no launcher interval): the first save comes as soon as the step
    time is measured, its cost is measured from its step, then T* = sqrt(2 C M)."""
    mtbf = 10 * 3600.0  # a 10 h prior: T* = sqrt(2 x 2 s x 36,000 s) = 379 s
    cadence = CheckpointCadence(prior_mtbf_s=mtbf, min_samples=5)
    assert "once the first checkpoint's cost is measured" in cadence.describe()
    assert "prior MTBF (10 h for 8 ranks)" in str(cadence.opening_note(8))  # said at the start
    assert cadence.follow(None) is None  # nothing derived yet: nothing to say
    saved = run_costly(cadence, 6000, step_s=0.5, cost_s=2.0)
    assert saved[0] == 5  # five step times measured: the first save, which measures C
    assert cadence.cost_s() == pytest.approx(2.0)
    young = (2 * 2.0 * mtbf) ** 0.5
    assert cadence.interval() == pytest.approx(young)
    assert cadence.steps_per_checkpoint() == round(young / 0.5)
    gaps = {b - a for a, b in zip(saved[1:], saved[2:], strict=False)}
    assert gaps == {round(young / 0.5)}
    assert cadence.describe().startswith(f"every {young:g}s (young: C=2s measured, M=10 h prior")
    assert cadence.follow(None) == cadence.describe() and cadence.follow(None) is None  # said once
    assert cadence.follow(30.0) == "every 30s = 60 steps of 0.5s"  # a SetCheckpointInterval
    assert cadence.opening_note(8) is None  # an interval in force


def test_the_derived_interval_is_clamped_and_an_interval_in_force_replaces_it() -> None:
    cadence = CheckpointCadence(prior_mtbf_s=1e9, max_s=600.0)  # a huge MTBF: at most 10 min
    run_costly(cadence, 20, step_s=1.0, cost_s=5.0)
    assert cadence.interval() == 600.0
    cadence.set_interval(30.0)  # the processor's SetCheckpointInterval
    assert cadence.interval() == 30.0 and cadence.derived() is None
    quiet = CheckpointCadence()  # no prior and no interval: nothing on time
    assert run_costly(quiet, 50, step_s=1.0, cost_s=1.0) == [] and quiet.describe() == "none on time"
