"""A checkpoint location on any filesystem fsspec knows: a local or shared directory, or an
object store (s3://, gs://, az://, ...) when its fsspec package is installed.

What the checkpoint protocol needs of storage, and how each kind gives it:

- shards: written by DCP's own writers, `FileSystemWriter` on a local directory (fsync'd
  files), `FsspecWriter` elsewhere;
- a commit point: MANIFEST.json and the VALIDATED / REJECTED markers appear whole or not
  at all. Locally: a temp file, fsync, rename, fsync of the directory. On an object store
  an object PUT is atomic by itself, so the file is written in one put (no rename, which
  an object store only emulates by copy and delete);
- listing the step directories, reading markers, streaming a file's digest, deleting a
  step: the filesystem's ls, cat, open and rm. Listings skip fsspec's directory cache: the
  launcher polls a location other processes write.

Credentials and endpoints come from the filesystem package's own configuration (for s3fs:
the AWS variables and files, `AWS_ENDPOINT_URL`) or fsspec's `FSSPEC_<PROTOCOL>_<OPTION>`
variables, never from trainguard's arguments, so no secret is on a command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ...common.checkpoint_location import LocationError


def file_digest(path: Path, chunk: int = 1 << 22) -> tuple[str, int]:
    """sha256 hex digest and size of one local file."""
    with open(path, "rb") as f:
        return _digest(f, chunk)


def atomic_write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write-to-temp, fsync, ``os.replace``, fsync the directory: all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """The directory named by `uri` (a path, file://, or an fsspec URL); `child` names one
    below it on the same filesystem. `str()` is its URL (its path when local)."""

    def __init__(self, uri: str) -> None:
        try:
            fs, root = fsspec.core.url_to_fs(uri)
        except ImportError as exc:  # the protocol is known, its package is not installed
            scheme = uri.partition("://")[0]
            raise LocationError(
                f"{uri!r}: {scheme}:// checkpoints need fsspec's package for {scheme} ({exc})"
            ) from exc
        except ValueError as exc:  # an unknown protocol
            raise LocationError(f"{uri!r}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root = root.rstrip("/") or "/"
        self.local = isinstance(fs, LocalFileSystem)

    @classmethod
    def of(cls, location: Path | str | CheckpointStore) -> CheckpointStore:
        """`location` as a store (a store is returned as it is)."""
        return location if isinstance(location, CheckpointStore) else cls(str(location))

    def child(self, *parts: str) -> CheckpointStore:
        out = object.__new__(CheckpointStore)
        out.fs, out.root, out.local = self.fs, self.path(*parts), self.local
        return out

    @property
    def name(self) -> str:
        return self.root.rsplit("/", 1)[-1]

    @property
    def local_dir(self) -> Path:
        if not self.local:
            raise ValueError(f"{self} is not a local directory")
        return Path(self.root)

    def __str__(self) -> str:
        return self.url()

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url(self, *parts: str) -> str:
        """The full URL of a path under the root (what DCP's fsspec writer and reader take)."""
        path = self.path(*parts)
        return path if self.local else str(self.fs.unstrip_protocol(path))

    def exists(self, *parts: str) -> bool:
        path = self.path(*parts)
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def names(self, *parts: str) -> list[str]:
        """The entries of a directory, by name ([] when it does not exist)."""
        path = self.path(*parts)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def size(self, *parts: str) -> int | None:
        """A file's size, or None when there is no such file."""
        path = self.path(*parts)
        if self.local:
            return os.stat(path).st_size if os.path.isfile(path) else None
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def mtime(self, *parts: str) -> float:
        """A file's modification time (OSError when it is missing)."""
        path = self.path(*parts)
        if self.local:
            return os.stat(path).st_mtime
        try:
            return float(self.fs.modified(path).timestamp())
        except FileNotFoundError as exc:
            raise OSError(str(exc)) from exc

    def read_json(self, *parts: str, strict: bool = False) -> dict[str, Any] | None:
        """A JSON object, or None when the file is missing or unreadable. `strict`: a
        storage error other than the file's absence (an object store's 5xx, a timeout) is
        raised, not taken for a missing file."""
        try:
            raw = self.fs.cat_file(self.path(*parts))
        except FileNotFoundError:
            return None
        except OSError:
            if strict:
                raise
            return None
        try:
            payload = json.loads(raw)
        except ValueError:
            return None
        return payload if isinstance(payload, dict) else None

    def write_json(self, payload: dict[str, Any], *parts: str) -> None:
        """All or nothing: a reader sees the whole file or none (the commit point)."""
        target = self.path(*parts)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            atomic_write_json(Path(target), payload)
            return
        data = json.dumps(payload, indent=1, sort_keys=True).encode()
        self.fs.pipe_file(target, data)  # one PUT: atomic on an object store

    def digest(self, *parts: str, chunk: int = 1 << 22) -> tuple[str, int]:
        """sha256 hex digest and size of one file, streamed."""
        with self.fs.open(self.path(*parts), "rb") as f:
            return _digest(f, chunk)

    def remove(self, *parts: str) -> None:
        """Delete a file or a whole directory; nothing when it is already gone."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(*parts), recursive=True)

    def dcp_writer(self, before_write: Callable[[], None] | None = None) -> Any:
        """DCP's writer for this directory; `before_write` runs before any data is written
        (a storage probe: raising makes the write fail as an unavailable store would)."""
        import torch.distributed.checkpoint as dcp

        if self.local:
            writer = dcp.FileSystemWriter(self.root, sync_files=True, overwrite=True)
        else:  # an object's upload is its durability point: there is no fd to fsync
            writer = dcp.FsspecWriter(self.url(), sync_files=False, overwrite=True)
        if before_write is not None:
            write_data = writer.write_data

            def probed(plan: Any, planner: Any) -> Any:
                before_write()
                return write_data(plan, planner)

            writer.write_data = probed  # type: ignore[method-assign]  # this writer only
        return writer

    def dcp_reader(self) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemReader(self.root) if self.local else dcp.FsspecReader(self.url())


def _digest(f: Any, chunk: int) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    for block in _blocks(f, chunk):
        h.update(block)
        size += len(block)
    return h.hexdigest(), size


def _blocks(f: Any, chunk: int) -> Iterator[bytes]:
    while block := f.read(chunk):
        yield block
