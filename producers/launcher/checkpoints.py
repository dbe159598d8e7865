"""The launcher's view of the checkpoint directory: which steps hold a validated
checkpoint (``step-NNN/VALIDATED``) and which were rejected at load (``REJECTED``, which
outranks VALIDATED, so a rejected checkpoint is never chosen again)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .records import read_json

_STEP_DIR = re.compile(r"^step-(\d+)$")
VALIDATED_MARKER = "VALIDATED"
#: Written next to a checkpoint that failed verification (producers/checkpoint/validate.py):
#: it outranks VALIDATED, so a checkpoint the ranks rejected at load is never chosen again.
REJECTED_MARKER = "REJECTED"


def _step_dirs(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(os.scandir(checkpoint_dir))
    except OSError:
        return []
    found = [(m, entry) for entry in entries if (m := _STEP_DIR.match(entry.name)) is not None]
    return sorted((int(m.group(1)), Path(entry.path)) for m, entry in found if entry.is_dir())


def validated_steps(checkpoint_dir: Path) -> dict[int, float]:
    """Steps with a ``step-NNN/VALIDATED`` marker and no ``REJECTED`` one (a checkpoint the
    ranks rejected at load keeps its old VALIDATED marker), and each marker's mtime."""
    out: dict[int, float] = {}
    for step, path in _step_dirs(checkpoint_dir):
        if (path / REJECTED_MARKER).exists():
            continue
        try:
            out[step] = (path / VALIDATED_MARKER).stat().st_mtime
        except OSError:
            continue
    return out


def rejected_steps(checkpoint_dir: Path) -> dict[int, str]:
    """Steps with a ``REJECTED`` marker, and each one's reason."""
    out: dict[int, str] = {}
    for step, path in _step_dirs(checkpoint_dir):
        if (path / REJECTED_MARKER).exists():
            out[step] = str(read_json(path / REJECTED_MARKER).get("reason", "unknown reason"))
    return out
