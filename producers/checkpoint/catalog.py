"""The checkpoints under a root, as their directories and markers say (no torch here):
which steps are committed (``MANIFEST.json``, written last), which are resumable
(``VALIDATED`` and not ``REJECTED``: a rejection outranks an older validation), why one
is not, and the retention of the newest validated ones. The root is a local directory or
any fsspec location (storage.py).

The launcher reads the same markers to choose the next attempt's resume step
(producers/launcher/checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

from .storage import CheckpointStore

MANIFEST = "MANIFEST.json"
VALIDATED = "VALIDATED"
REJECTED = "REJECTED"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step a directory name holds (``step-000000123``), else None."""
    if not name.startswith("step-"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


class CheckpointCatalog:
    def __init__(self, root: Path | str | CheckpointStore) -> None:
        self.store = CheckpointStore.of(root)

    def step_dir(self, step: int) -> CheckpointStore:
        return self.store.child(step_dir_name(step))

    def step_dirs(self) -> list[int]:
        """Every step with a directory (committed or not), oldest first."""
        return sorted(s for name in self.store.names() if (s := step_of(name)) is not None)

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_dirs() if self.step_dir(s).exists(MANIFEST)]

    def validated_steps(self) -> list[int]:
        """Committed, ``VALIDATED`` and not ``REJECTED`` checkpoints, oldest first."""
        out = []
        for step in self.step_dirs():
            names = set(self.step_dir(step).names())
            if {MANIFEST, VALIDATED} <= names and REJECTED not in names:
                out.append(step)
        return out

    def latest_validated(self) -> int | None:
        steps = self.validated_steps()
        return steps[-1] if steps else None

    def rejection_reason(self, step: int) -> str | None:
        """Why a checkpoint is not resumable, or None when it is validated."""
        d = self.step_dir(step)
        names = set(d.names())
        if MANIFEST not in names:
            return f"checkpoint step {step} does not exist (no manifest in {d})"
        if REJECTED in names:
            marker = d.read_json(REJECTED) or {}
            return f"checkpoint step {step} was rejected: {marker.get('reason', 'unknown reason')}"
        if VALIDATED not in names:
            return f"checkpoint step {step} is not validated (yet)"
        return None

    def keep_newest(self, keep: int) -> None:
        """Delete every step directory older than the `keep` newest validated checkpoints."""
        validated = self.validated_steps()
        if len(validated) <= keep:
            return
        oldest_kept = validated[-keep]
        for step in self.step_dirs():
            if step < oldest_kept:
                self.store.remove(step_dir_name(step))
