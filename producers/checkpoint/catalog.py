"""The checkpoints under a root, as their directories and markers say (no torch here):
which steps are committed (``MANIFEST.json``, written last), which are resumable
(``VALIDATED`` and not ``REJECTED``: a rejection outranks an older validation), why one
is not, and the retention of the newest validated ones.

The launcher reads the same markers to choose the next attempt's resume step
(producers/launcher/checkpoints.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .validate import MANIFEST, REJECTED, VALIDATED


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


class CheckpointCatalog:
    def __init__(self, root: Path) -> None:
        self.root = root

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def step_dirs(self) -> list[int]:
        """Every step with a directory (committed or not), oldest first."""
        steps = []
        if self.root.is_dir():
            for path in self.root.glob("step-*"):
                try:
                    steps.append(int(path.name[5:]))
                except ValueError:
                    continue
        return sorted(steps)

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_dirs() if (self.step_dir(s) / MANIFEST).is_file()]

    def validated_steps(self) -> list[int]:
        """Committed, ``VALIDATED`` and not ``REJECTED`` checkpoints, oldest first."""
        out = []
        for step in self.committed_steps():
            d = self.step_dir(step)
            if (d / VALIDATED).is_file() and not (d / REJECTED).exists():
                out.append(step)
        return out

    def latest_validated(self) -> int | None:
        steps = self.validated_steps()
        return steps[-1] if steps else None

    def rejection_reason(self, step: int) -> str | None:
        """Why a checkpoint is not resumable, or None when it is validated."""
        d = self.step_dir(step)
        if not (d / MANIFEST).is_file():
            return f"checkpoint step {step} does not exist (no manifest in {d})"
        if (d / REJECTED).exists():
            marker = _read_json(d / REJECTED)
            return f"checkpoint step {step} was rejected: {marker.get('reason', 'unknown reason')}"
        if not (d / VALIDATED).is_file():
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
                shutil.rmtree(self.step_dir(step), ignore_errors=True)


def _read_json(path: Path) -> dict[str, Any]:
    """A marker's json payload ({} when unreadable)."""
    try:
        with open(path) as f:
            payload: dict[str, Any] = json.load(f)
            return payload
    except (OSError, ValueError):
        return {}
