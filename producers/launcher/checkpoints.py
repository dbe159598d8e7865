"""The launcher's view of the checkpoint location (a directory or an fsspec URL): which
steps hold a resumable checkpoint (its manifest and ``VALIDATED``, no ``REJECTED``: a
rejected checkpoint is never chosen again, and a re-save keeps the marker until the new
save is validated) and which were rejected. What is resumable is decided in one place,
producers/checkpoint/markers.py, which the ranks' catalog reads too."""

from __future__ import annotations

import logging
from pathlib import Path

from ...common.checkpoint_location import LocationError
from ..checkpoint.markers import REJECTED, VALIDATED, resumable, step_of
from ..checkpoint.storage import CheckpointStore

log = logging.getLogger(__name__)

#: Locations that could not be listed, with the error last logged: the launcher polls (an
#: eviction waiting for a newer checkpoint lists every 0.5 s), so an outage is logged once
#: per distinct error, and its end once.
_unlisted: dict[str, str] = {}


def _step_dirs(location: Path | str) -> list[tuple[int, CheckpointStore]]:
    """Every step directory and the names in it; [] when the location cannot be read."""
    key = str(location)
    try:
        store = CheckpointStore.of(location)
        names = store.names()
    except (OSError, LocationError) as exc:
        if _unlisted.get(key) != str(exc):
            log.warning("checkpoint location %s not listed: %s (logged again if the error changes)", key, exc)
            _unlisted[key] = str(exc)
        return []
    if _unlisted.pop(key, None) is not None:
        log.info("checkpoint location %s listed again", key)
    found = ((step, name) for name in names if (step := step_of(name)) is not None)
    return sorted((step, store.child(name)) for step, name in found)


def validated_steps(location: Path | str) -> dict[int, float]:
    """Resumable steps (markers.py: the manifest, ``VALIDATED``, no ``REJECTED``; a
    checkpoint the ranks rejected at load keeps its old VALIDATED marker), and each
    ``VALIDATED`` marker's mtime."""
    out: dict[int, float] = {}
    for step, directory in _step_dirs(location):
        if not resumable(directory.names()):
            continue
        try:
            out[step] = directory.mtime(VALIDATED)
        except OSError:
            continue
    return out


def rejected_steps(location: Path | str) -> dict[int, str]:
    """Steps with a ``REJECTED`` marker, and each one's reason."""
    out: dict[int, str] = {}
    for step, directory in _step_dirs(location):
        if REJECTED in directory.names():
            marker = directory.read_json(REJECTED) or {}
            out[step] = str(marker.get("reason", "unknown reason"))
    return out
