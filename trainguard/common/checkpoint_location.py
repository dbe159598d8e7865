"""Where a run's checkpoints may live, checked before anything is launched:

- a directory every host of the run mounts (local disk for one host; NFS, Lustre, a
  FUSE-mounted bucket for many), named by a path or a file:// URI;
- an object store or any other fsspec filesystem by URL (s3://bucket/ckpt, gs://...,
  az://...), written through torch DCP's fsspec writer (producers/checkpoint/storage.py), when that
  filesystem's package is installed (``pip install trainguard[s3]`` gives s3fs).

Refused, each with its reason: an unknown scheme; a known one whose package is missing
where the checkpoints are written; a filesystem only one process sees (memory://) or one
that cannot be written (http://, zip://, ...).

One rule for both sides (issue 48): the launcher and the checkpoint writer (producers/)
and the run API that accepts a run's location (processors/api.py) import it from here.
Imports nothing of the project (trainguard/common); fsspec only for a URL.
"""

from __future__ import annotations

from pathlib import Path

#: fsspec filesystems that cannot hold a run's checkpoints, and why.
_UNUSABLE = {
    "memory": "memory:// is one process's memory: the ranks and the launcher are separate processes",
    **{
        scheme: f"{scheme}:// is read-only to fsspec"
        for scheme in ("http", "https", "github", "git", "gist", "data", "reference")
    },
    **{scheme: f"{scheme}:// is a read-only archive" for scheme in ("zip", "tar", "libarchive")},
}


class LocationError(ValueError):
    """A checkpoint location trainguard cannot use, with why."""


def is_url(location: str) -> bool:
    """Whether `location` names a filesystem by scheme (file:// included)."""
    return "://" in location


def checkpoint_location(uri: str, *, need_package: bool = True) -> str:
    """The location `uri` names: a path for a path or a file:// URI, else the URL
    itself. LocationError when it cannot hold checkpoints; with `need_package` (where the
    ranks run) also when the filesystem's package is not installed here."""
    if not uri.strip():
        raise LocationError("an empty checkpoint location")
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path.startswith("/"):
            raise LocationError(f"{uri!r}: a file:// URI needs an absolute path (file:///shared/ckpt)")
        return str(Path(path))
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return str(Path(uri))
    import fsspec
    from fsspec.registry import known_implementations

    if scheme in _UNUSABLE:
        raise LocationError(f"{uri!r}: {_UNUSABLE[scheme]}")
    if scheme not in known_implementations and scheme not in fsspec.registry:
        raise LocationError(
            f"{uri!r}: no filesystem is known for {scheme}://; give a directory every host mounts "
            "(a path, or file:///...) or an fsspec URL (s3://, gs://, az://, ...)"
        )
    if not rest.strip("/"):
        raise LocationError(f"{uri!r}: name a bucket and a prefix, e.g. {scheme}://bucket/ckpt")
    if need_package:
        try:
            fsspec.get_filesystem_class(scheme)
        except ImportError as exc:  # fsspec's message names the package ("Install s3fs to ...")
            hint = " (pip install 'trainguard[s3]')" if scheme in ("s3", "s3a") else ""
            raise LocationError(f"{uri!r}: {exc}{hint}") from exc
    return uri
