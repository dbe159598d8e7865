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
