"""The checkpoints under a root, as their directories and markers say (no torch here):
which steps are committed (``MANIFEST.json``, written last), which are resumable, why one
is not, and the retention that deletes the rest. The root is a local directory or any
fsspec location (storage.py).

Markers. A step is resumable when its directory holds the manifest, ``VALIDATED`` and no
``REJECTED`` (markers.py, the one rule, which the launcher reads too:
producers/launcher/checkpoints.py). ``VALIDATED`` is written after the manifest and
removed before it (a re-save, a deletion). ``REJECTED`` (json, with the reason) stays when
its step is saved again: the reason is on record until the new save is validated, and
:meth:`CheckpointCatalog.mark_validated` then writes ``VALIDATED`` (carrying the old
reason as ``replaces_rejection``) before it removes ``REJECTED``, so a reader in between
sees both markers: not resumable.

Retention (:func:`retention_plan`, the one rule; rank 0 applies it after each validation,
producers/checkpoint/manager.py). The ``keep`` most recently validated resumable
checkpoints are kept; every step directory below the oldest kept one's step is deleted
(older validated ones, rejected ones, writes that never committed), except one
``PINNED`` (an ancestor a launcher, processor or operator marked) or one still being
written or validated (``busy``). Nothing at or above the oldest kept step is touched, so
the newest validated checkpoint, the ones in flight, and anything newer stay. "Recently"
is the ``VALIDATED`` marker's ``validated_at``, not the step: after a rollback the new
lineage's checkpoints are the recent ones, and the newer-numbered ones it abandoned can
neither crowd them out nor be deleted before the new lineage has passed them.

Rollback ancestors. An SDC mismatch found by a cross-rank (ring) check rolls the run back
to the newest validated checkpoint at or before the last check that passed (processors/
core/decisions/rollback.py), which may be older than the ``keep`` newest when checks are rarer than
checkpoints. Whether a check passed is the processor's verdict, so the rank keeps, for
each of the latest ring checks it ran (``watermarks``: the last two, so the ancestor of
a failing newest check and of a passing one's successor), the newest resumable
checkpoint at or before its step: the ancestor any rollback the processor can send names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .markers import MANIFEST, PINNED, REJECTED, VALIDATED, not_resumable, resumable, step_dir_name, step_of
from .storage import CheckpointStore

log = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "PINNED",
    "REJECTED",
    "VALIDATED",
    "CheckpointCatalog",
    "StepEntry",
    "resumable",
    "retention_plan",
    "step_dir_name",
    "step_of",
]


@dataclass(frozen=True)
class StepEntry:
    """One step directory as retention sees it."""

    step: int
    names: frozenset[str]
    #: When it was validated (its VALIDATED marker's ``validated_at``; 0: it does not say).
    validated_at: float = 0.0

    @property
    def resumable(self) -> bool:
        return resumable(self.names)


def retention_plan(
    entries: Iterable[StepEntry], keep: int, busy: Collection[int] = (), watermarks: Iterable[int] = ()
) -> list[int]:
    """The steps whose directories retention deletes, oldest first (the module docstring's
    rule): those below the oldest of the `keep` most recently validated resumable
    checkpoints, less the ``PINNED`` ones, the `busy` ones (being written or validated)
    and the rollback ancestors of the `watermarks` (steps of the latest cross-rank checks)."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    entries = sorted(entries, key=lambda e: e.step)
    validated = sorted((e for e in entries if e.resumable), key=lambda e: (e.validated_at, e.step))
    if len(validated) <= keep:
        return []
    floor = min(e.step for e in validated[-keep:])
    ancestors = {
        max(older) for mark in watermarks if (older := [e.step for e in validated if e.step <= mark])
    }
    return [
        e.step
        for e in entries
        if e.step < floor and PINNED not in e.names and e.step not in busy and e.step not in ancestors
    ]


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
        return [e.step for e in self.entries(times=False) if e.resumable]

    def latest_validated(self) -> int | None:
        steps = self.validated_steps()
        return steps[-1] if steps else None

    def entries(self, times: bool = True) -> list[StepEntry]:
        """Every step directory with its names, oldest first; `times`: with each resumable
        one's validation time (one marker read each)."""
        out = []
        for step in self.step_dirs():
            directory = self.step_dir(step)
            names = frozenset(directory.names())
            at = 0.0
            if times and resumable(names):
                at = _seconds((directory.read_json(VALIDATED) or {}).get("validated_at"))
            out.append(StepEntry(step, names, at))
        return out

    def rejection_reason(self, step: int) -> str | None:
        """Why a checkpoint is not resumable, or None when it is validated."""
        d = self.step_dir(step)
        why = not_resumable(set(d.names()))
        if why == "no manifest":
            return f"checkpoint step {step} does not exist (no manifest in {d})"
        if why == "rejected":
            marker = d.read_json(REJECTED) or {}
            return f"checkpoint step {step} was rejected: {marker.get('reason', 'unknown reason')}"
        if why == "not validated":
            return f"checkpoint step {step} is not validated (yet)"
        return None

    def mark_validated(self, step: int, payload: dict[str, Any]) -> None:
        """Record a validation: ``VALIDATED``, then (a re-save of a rejected step) the
        ``REJECTED`` marker removed, its reason kept in the new marker (module docstring)."""
        d = self.step_dir(step)
        if REJECTED in d.names():
            superseded = d.read_json(REJECTED) or {}
            payload = {**payload, "replaces_rejection": superseded.get("reason", "unknown reason")}
            d.write_json(payload, VALIDATED)
            d.remove(REJECTED)
        else:
            d.write_json(payload, VALIDATED)

    def pin(self, step: int, by: str, reason: str) -> None:
        """Keep a step's checkpoint whatever retention's count says, until :meth:`unpin`."""
        self.step_dir(step).write_json({"step": step, "by": by, "reason": reason}, PINNED)

    def unpin(self, step: int) -> None:
        self.step_dir(step).remove(PINNED)

    def retain(self, keep: int, busy: Collection[int] = (), watermarks: Iterable[int] = ()) -> list[int]:
        """Delete what :func:`retention_plan` says; returns the steps deleted. A deletion
        that fails (an object store's outage, a permission) is logged and left for the
        next pass: housekeeping must never stop training. Listing errors propagate."""
        deleted = []
        for step in retention_plan(self.entries(), keep, busy, watermarks):
            directory = self.step_dir(step)
            try:
                # The commit point goes first: a deletion cut short leaves an uncommitted
                # directory, which no reader resumes from and the next pass deletes.
                directory.remove(VALIDATED)
                directory.remove(MANIFEST)
                self.store.remove(step_dir_name(step))
            except Exception as exc:  # OSError, botocore's errors, ...: not fatal
                log.warning("retention could not delete checkpoint step %d (%s): %s", step, directory, exc)
                continue
            deleted.append(step)
        return deleted


def _seconds(value: object) -> float:
    """A marker's timestamp (0.0 when missing or not a finite number)."""
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return 0.0
