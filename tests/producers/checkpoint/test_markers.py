"""One rule for "resumable" (producers/checkpoint/markers.py, issue 48): the launcher
choosing a resume step and the ranks' catalog (load, retention, rollback ancestors) agree
on every combination of markers in a step directory, and a ``VALIDATED`` without the
manifest it validated is resumable for neither."""

from __future__ import annotations

import itertools
from pathlib import Path

from trainguard.producers.checkpoint import markers
from trainguard.producers.checkpoint.catalog import CheckpointCatalog, StepEntry, retention_plan
from trainguard.producers.checkpoint.markers import MANIFEST, PINNED, REJECTED, VALIDATED
from trainguard.producers.launcher.checkpoints import validated_steps

NAMES = (MANIFEST, VALIDATED, REJECTED, PINNED, "__0_0.distcp")


def test_every_combination_of_markers_is_judged_alike_by_the_launcher_and_the_catalog(tmp_path: Path) -> None:
    combos = [set(c) for n in range(len(NAMES) + 1) for c in itertools.combinations(NAMES, n)]
    for step, names in enumerate(combos):
        d = tmp_path / markers.step_dir_name(step)
        d.mkdir()
        for name in names:
            (d / name).write_text("{}")
    expected = {
        s for s, names in enumerate(combos) if {MANIFEST, VALIDATED} <= names and REJECTED not in names
    }
    assert len(expected) == 4  # with or without PINNED, with or without a shard

    catalog = CheckpointCatalog(tmp_path)
    assert set(validated_steps(tmp_path)) == expected
    assert set(catalog.validated_steps()) == expected
    assert {e.step for e in catalog.entries() if e.resumable} == expected
    assert {s for s in catalog.step_dirs() if catalog.rejection_reason(s) is None} == expected
    assert {s for s, names in enumerate(combos) if markers.resumable(names)} == expected


def test_a_validated_marker_without_its_manifest_is_not_chosen_to_resume_from(tmp_path: Path) -> None:
    # A directory half-deleted or half-copied by another hand: the launcher used to choose
    # it from VALIDATED alone, and the ranks then failed to load it (no manifest).
    for step, names in ((5, (MANIFEST, VALIDATED)), (10, (VALIDATED,))):
        d = tmp_path / markers.step_dir_name(step)
        d.mkdir()
        for name in names:
            (d / name).write_text("{}")
    assert set(validated_steps(tmp_path)) == {5}
    catalog = CheckpointCatalog(tmp_path)
    assert catalog.latest_validated() == 5
    assert (
        catalog.rejection_reason(10)
        == f"checkpoint step 10 does not exist (no manifest in {catalog.step_dir(10)})"
    )
    assert markers.not_resumable({VALIDATED}) == "no manifest"
    assert markers.not_resumable({MANIFEST, VALIDATED, REJECTED}) == "rejected"
    assert markers.not_resumable({MANIFEST}) == "not validated"


def test_retention_counts_only_resumable_checkpoints_toward_keep() -> None:
    # Two whole checkpoints and two VALIDATED markers without a manifest: keep=2 keeps the
    # two whole ones and deletes nothing above the older of them.
    entries = [
        StepEntry(1, frozenset({MANIFEST, VALIDATED}), 1.0),
        StepEntry(2, frozenset({VALIDATED}), 2.0),
        StepEntry(3, frozenset({MANIFEST, VALIDATED}), 3.0),
        StepEntry(4, frozenset({VALIDATED}), 4.0),
    ]
    assert retention_plan(entries, keep=2) == []
    assert retention_plan(entries, keep=1) == [1, 2]
