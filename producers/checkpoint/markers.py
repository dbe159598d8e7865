"""What makes a checkpoint resumable: the one rule, read from its step directory's names.

A checkpoint is resumable when it was written whole (``MANIFEST.json``, the commit point,
written last: commit.py), validated after that (``VALIDATED``: all shards present, digests
as the manifest says, a test load, norms in the run's band: validate.py) and not rejected
since (``REJECTED``, which outranks an older validation). The seed's `checkpoint.validated`
is a field of a written checkpoint: a validation of nothing is not one.

Every reader asks :func:`resumable`: the launcher choosing the step to resume from
(producers/launcher/checkpoints.py, from a listing of the markers alone), and the ranks'
catalog loading, keeping and rolling back (catalog.py). trainguard's own writers never
leave ``VALIDATED`` without the manifest (written after it, removed before it), so the
manifest test changes nothing for their directories; it keeps a directory some other hand
left half-deleted or half-copied (a sync that copies small files first, a manual removal)
from being chosen by the launcher and then failing the ranks' load.

No torch and nothing else of the project: the launcher, the catalog and validation import it.
"""

from __future__ import annotations

from collections.abc import Collection

#: The commit point: the step's files with their digests, written last.
MANIFEST = "MANIFEST.json"
#: Written after a validation passed (json: when, and the verification watermark).
VALIDATED = "VALIDATED"
#: Written when a validation or a resume failed (json, with the reason).
REJECTED = "REJECTED"
#: Retention never deletes a step directory holding this marker (json: who pinned it, why).
PINNED = "PINNED"


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


def not_resumable(names: Collection[str]) -> str | None:
    """Why a step directory holding `names` is not resumable (``"no manifest"``,
    ``"rejected"``, ``"not validated"``, in that order), or None when it is."""
    if MANIFEST not in names:
        return "no manifest"
    if REJECTED in names:
        return "rejected"
    if VALIDATED not in names:
        return "not validated"
    return None


def resumable(names: Collection[str]) -> bool:
    """The rule (module docstring): ``MANIFEST.json`` and ``VALIDATED``, and no ``REJECTED``."""
    return not_resumable(names) is None
