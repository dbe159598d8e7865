"""Checkpoint retention (issue 44): the rule (catalog.py: retention_plan) on its own, then
applied by the manager's rank 0 after each validation, on a local directory and on an S3
endpoint (tests/producers/s3_server.py), with its default from TRAINGUARD_CHECKPOINT_KEEP.
The rule keeps the `keep` most recently validated checkpoints and deletes only what is
below the oldest of them: never the newest validated one, never a write in flight, never
anything newer than the oldest kept, never a PINNED ancestor."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard.producers.checkpoint.catalog import (
    MANIFEST,
    PINNED,
    REJECTED,
    VALIDATED,
    CheckpointCatalog,
    StepEntry,
    retention_plan,
)
from trainguard.producers.checkpoint.manager import CheckpointManager
from trainguard.producers.checkpoint.storage import CheckpointStore
from trainguard.producers.launcher.checkpoints import validated_steps
from trainguard.producers.training.config import (
    DEFAULT_CHECKPOINT_KEEP,
    ENV_CHECKPOINT_KEEP,
    SupervisorConfig,
    checkpoint_keep,
)

from .checkpoint_fixtures import Loop, make_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

GOOD = frozenset({MANIFEST, VALIDATED, ".metadata", "__0_0.distcp"})


def entry(step: int, kind: str = "validated", at: float | None = None) -> StepEntry:
    names = {
        "validated": GOOD,
        "rejected": GOOD | {REJECTED},  # validated once, rejected at a load since
        "uncommitted": frozenset({"__0_0.distcp"}),  # being written, or a write that died
        "committed": GOOD - {VALIDATED},  # being validated
        "pinned": GOOD | {PINNED},
    }[kind]
    return StepEntry(step, names, float(step) if at is None else at)


# ------------------------------------------------------------------------------ the rule


def test_keeps_the_newest_validated_and_deletes_everything_below_the_oldest_kept() -> None:
    entries = [entry(s) for s in (10, 20, 30, 40, 50)] + [entry(15, "rejected"), entry(5, "uncommitted")]
    assert retention_plan(entries, keep=2) == [5, 10, 15, 20, 30]
    assert retention_plan(entries, keep=5) == []  # nothing beyond the count yet
    assert retention_plan(entries, keep=9) == []
    assert retention_plan(entries, keep=1) == [5, 10, 15, 20, 30, 40]  # never the newest validated


def test_nothing_at_or_above_the_oldest_kept_is_touched() -> None:
    """The newer ones not (yet) resumable: a write in flight, a commit being validated, a
    checkpoint rejected at a load; with one validated below them, none of them counts."""
    entries = [entry(10), entry(20), entry(30), entry(40, "rejected"), entry(50, "committed")]
    entries.append(entry(60, "uncommitted"))
    assert retention_plan(entries, keep=2) == [10]


def test_a_pinned_or_busy_directory_below_the_oldest_kept_stays() -> None:
    entries = [entry(10, "pinned"), entry(20), entry(30, "uncommitted"), entry(40), entry(50), entry(60)]
    assert retention_plan(entries, keep=2) == [20, 30, 40]
    assert retention_plan(entries, keep=2, busy={30}) == [20, 40]
    # A pinned checkpoint is kept, not counted: it does not hold back everything above it.
    assert retention_plan([entry(10, "pinned"), entry(20), entry(30)], keep=1) == [20]


def test_after_a_rollback_the_new_lineage_counts_not_the_abandoned_higher_steps() -> None:
    """Validated at 100, 110, 120; rolled back to 100, the run validates 105 and 108 later.
    The abandoned 110 and 120 are older by validation: they neither crowd out the new
    lineage nor go before it has passed them (they are above its oldest kept)."""
    old = [entry(100, at=1.0), entry(110, at=2.0), entry(120, at=3.0)]
    new = [entry(105, at=4.0), entry(108, at=5.0)]
    assert retention_plan(old + new, keep=2) == [100]  # keeps 105 and 108; 110, 120 above them
    assert retention_plan([*old, *new, entry(125, at=6.0), entry(130, at=7.0)], keep=2) == [
        100, 105, 108, 110, 120,
    ]  # fmt: skip


def test_the_rollback_ancestor_of_each_latest_ring_check_stays() -> None:
    """Checkpoints every 10 steps, ring checks at 25 and 55: a mismatch at 55 rolls back to
    the newest validated at or before 25 (20), one at the next check to the newest at or
    before 55 (50): both stay, however many newer ones the count keeps."""
    entries = [entry(s) for s in range(10, 100, 10)]
    assert retention_plan(entries, keep=2) == [10, 20, 30, 40, 50, 60, 70]
    assert retention_plan(entries, keep=2, watermarks=(25, 55)) == [10, 30, 40, 60, 70]
    assert retention_plan(entries, keep=2, watermarks=(5,)) == retention_plan(entries, keep=2)  # none older


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        retention_plan([entry(1)], keep=0)


# -------------------------------------------------------------------- on a store, rank 0


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"{request.getfixturevalue('s3').bucket()}/runs/r"


def manager(root: str, **kw) -> CheckpointManager:  # type: ignore[no-untyped-def]
    return CheckpointManager(root, make_state(0), rank=0, world_size=1, run_id="r", **kw)


def save_steps(mgr: CheckpointManager, steps: range) -> None:
    loop = Loop(mgr.state)
    for step in steps:
        loop.steps(1)
        mgr.save(step)
        mgr.wait_validated()


def test_the_manager_keeps_its_count_of_validated_checkpoints_on_every_store(root: str) -> None:
    with manager(root, keep=3) as mgr:
        save_steps(mgr, range(8))
        assert mgr.validated_steps() == [5, 6, 7]
    assert CheckpointStore(root).names() == [f"step-{s:09d}" for s in (5, 6, 7)]
    assert sorted(validated_steps(root)) == [5, 6, 7]  # the launcher reads the same
    with manager(root) as fresh:
        assert fresh.load() == 7


def test_the_default_count_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_KEEP, raising=False)
    assert checkpoint_keep({}) == DEFAULT_CHECKPOINT_KEEP == 5
    with manager(str(tmp_path / "a")) as default:
        assert default.keep == 5
    monkeypatch.setenv(ENV_CHECKPOINT_KEEP, "2")
    with manager(str(tmp_path / "b")) as mgr:
        assert mgr.keep == 2
        save_steps(mgr, range(4))
        assert mgr.validated_steps() == [2, 3]
    with manager(str(tmp_path / "c"), keep=7) as given:
        assert given.keep == 7  # the argument wins
    assert SupervisorConfig.from_env({ENV_CHECKPOINT_KEEP: "9"}).checkpoint_keep == 9
    assert SupervisorConfig.from_env({}).checkpoint_keep == 5
    for bad in ("0", "-1", "2.5", "all", ""):
        with pytest.raises(ValueError, match="positive whole number"):
            checkpoint_keep({ENV_CHECKPOINT_KEEP: bad})
        with pytest.raises(ValueError, match="positive whole number"):
            SupervisorConfig.from_env({ENV_CHECKPOINT_KEEP: bad})


def test_a_pinned_ancestor_survives_and_goes_once_unpinned(tmp_path: Path) -> None:
    catalog = CheckpointCatalog(tmp_path)
    with manager(str(tmp_path), keep=2) as mgr:
        save_steps(mgr, range(2))
        catalog.pin(0, by="test", reason="a rollback may need it")
        save_steps(mgr, range(2, 5))
        assert mgr.validated_steps() == [0, 3, 4]
        catalog.unpin(0)
        save_steps(mgr, range(5, 6))
        assert mgr.validated_steps() == [4, 5]


def test_only_rank_0_deletes(tmp_path: Path) -> None:
    """Rank 1's manager (one process here: no collectives) writes and commits, never
    validates nor deletes, whatever its count."""
    with manager(str(tmp_path), keep=5) as mgr:
        save_steps(mgr, range(3))
    other = CheckpointManager(str(tmp_path), make_state(0), rank=1, world_size=1, run_id="r", keep=1)
    with other:  # rank 1 has no validator, so retention never runs there
        other.save(3).wait(30)
        other.wait_validated()
    assert CheckpointCatalog(tmp_path).step_dirs() == [0, 1, 2, 3]


def test_a_deletion_that_fails_is_logged_and_the_rest_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Here a file stands where a step directory should be, so its markers cannot be
    removed (NotADirectoryError from the real filesystem): logged, skipped, the others
    deleted, and saving goes on."""
    (tmp_path / "step-000000000").write_text("not a directory")
    with caplog.at_level(logging.WARNING), manager(str(tmp_path), keep=1) as mgr:
        save_steps(mgr, range(1, 4))
        assert mgr.validated_steps() == [3]
    assert CheckpointCatalog(tmp_path).step_dirs() == [0, 3]
    assert "retention could not delete checkpoint step 0" in caplog.text
