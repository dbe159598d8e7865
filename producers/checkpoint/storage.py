"""A checkpoint root on any filesystem fsspec knows: a local or shared directory, or an
object store (s3://, gs://, az://, ...) when its fsspec package is installed (issue 19,
point 6; not wired into the checkpoint stack yet, see the branch's note).

What the checkpoint protocol needs of storage, and how each kind gives it:

- shards: written by DCP's own writers, `FileSystemWriter` on a local root (fsync'd
  files), `FsspecWriter` elsewhere;
- a commit point: MANIFEST.json and the VALIDATED / REJECTED markers appear whole or not
  at all. Locally: a temp file, fsync, rename, fsync of the directory. On an object store
  an object PUT is atomic by itself, so the file is written in one put;
- listing the step directories, reading markers, streaming a file's digest, deleting a
  step: the filesystem's ls, cat, open and rm.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .location import LocationError


class CheckpointStore:
    """The checkpoint root named by `uri` (a path, file://, or an fsspec URL)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        except ImportError as exc:  # the protocol is known, its package is not installed
            scheme = uri.partition("://")[0]
            raise LocationError(
                f"{uri!r}: {scheme}:// checkpoints need fsspec's package for it ({exc})"
            ) from exc
        except ValueError as exc:  # an unknown protocol
            raise LocationError(f"{uri!r}: {exc}") from exc
        self.uri = uri
        self.fs: fsspec.AbstractFileSystem = fs
        self.root = root.rstrip("/") or "/"
        self.local = isinstance(fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url(self, *parts: str) -> str:
        """The full URL of a path under the root (what DCP's fsspec writer and reader take)."""
        path = self.path(*parts)
        return path if self.local else self.fs.unstrip_protocol(path)

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.path(*parts)))

    def names(self, *parts: str) -> list[str]:
        """The entries of a directory, by name ([] when it does not exist)."""
        try:
            entries = self.fs.ls(self.path(*parts), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def read_json(self, *parts: str) -> dict[str, Any] | None:
        """A JSON object, or None when the file is missing or unreadable."""
        try:
            payload = json.loads(self.fs.cat_file(self.path(*parts)))
        except (OSError, ValueError):
            return None
        return payload if isinstance(payload, dict) else None

    def write_json(self, payload: dict[str, Any], *parts: str) -> None:
        """All or nothing: a reader sees the whole file or none (the commit point)."""
        data = json.dumps(payload, indent=1, sort_keys=True).encode()
        target = self.path(*parts)
        if not self.local:
            self.fs.pipe_file(target, data)  # one PUT: atomic on an object store
            return
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def digest(self, *parts: str, chunk: int = 1 << 22) -> tuple[str, int]:
        """sha256 hex digest and size of one file, streamed."""
        h, size = hashlib.sha256(), 0
        with self.fs.open(self.path(*parts), "rb") as f:
            for block in _blocks(f, chunk):
                h.update(block)
                size += len(block)
        return h.hexdigest(), size

    def remove(self, *parts: str) -> None:
        """Delete a file or a whole directory; nothing when it is already gone."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(*parts), recursive=True)

    def dcp_writer(self, *parts: str) -> Any:
        import torch.distributed.checkpoint as dcp

        if self.local:
            return dcp.FileSystemWriter(self.path(*parts), sync_files=True, overwrite=True)
        return dcp.FsspecWriter(self.url(*parts), sync_files=False, overwrite=True)

    def dcp_reader(self, *parts: str) -> Any:
        import torch.distributed.checkpoint as dcp

        if self.local:
            return dcp.FileSystemReader(self.path(*parts))
        return dcp.FsspecReader(self.url(*parts))


def _blocks(f: Any, chunk: int) -> Iterator[bytes]:
    while block := f.read(chunk):
        yield block
