"""Where a run's checkpoints may live: a directory of a filesystem every host of the run
mounts (local disk for one host; NFS, Lustre, a FUSE-mounted bucket for many), named by a
path or a file:// URI.

Object stores named by URI (s3://, gs://, az://...) are refused with a clear message rather
than taken for local paths: the checkpoint protocol (atomic step directories, VALIDATED
markers, the launcher's journal beside them) needs a filesystem's rename and listing. A
bucket mounted as a filesystem works today through its mount path.
"""

from __future__ import annotations

from pathlib import Path


class LocationError(ValueError):
    """A checkpoint location trainguard cannot use, with why."""


def local_checkpoint_dir(uri: str) -> Path:
    """The directory `uri` names: a path, or a file:// URI; LocationError for anything else."""
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path.startswith("/"):
            raise LocationError(f"{uri!r}: a file:// URI needs an absolute path (file:///shared/ckpt)")
        return Path(path)
    scheme, sep, _ = uri.partition("://")
    if sep:
        raise LocationError(
            f"{uri!r}: checkpoints on an object store ({scheme}://) are not supported yet; give a "
            "directory every host mounts (a path, or file:///...), e.g. the bucket's FUSE mount"
        )
    if not uri.strip():
        raise LocationError("an empty checkpoint location")
    return Path(uri)
