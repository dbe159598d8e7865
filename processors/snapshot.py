"""Snapshots of the core's state of one telemetry partition, so that a restarted or new
worker recovers a partition by loading its newest snapshot and folding only the records
after it, instead of the whole log (which retention trims anyway).

A snapshot is the pickled run states of one partition with the offset they reflect:
every record below `offset` is folded in, and every output of those records was
delivered before the snapshot was taken (the worker takes it between records, after
awaiting their outputs). Pickle, because the state is a tree of plain dataclasses,
deques and ordered dicts that must come back exactly (dedupe windows, streaks, sample
buffers); a JSON mapping of it would be a second model to keep in step. Unpickling
runs code, so a snapshot is signed: HMAC-SHA256 under a key derived from the master
secret that only processors hold, checked before anything is unpickled. A snapshot of
another code version is refused too: its classes may not mean the same thing.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import zlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from .core.state import RunState

_MAGIC = b"TGS1"
_MAC_BYTES = 32


def code_version() -> str:
    try:
        return version("trainguard")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


class SnapshotError(ValueError):
    """A snapshot that must not be loaded (bad signature, other version, garbage)."""


@dataclass
class Snapshot:
    #: The telemetry topic and partition whose records the runs were folded from.
    topic: str
    partition: int
    #: The next offset to fold: records [.., offset) are in `runs`.
    offset: int
    #: The taking worker's wall clock, to bound the search for outputs made after it.
    wall_ts: float
    runs: dict[str, RunState]
    code_version: str = ""


def snapshot_key(master_secret: bytes) -> bytes:
    return hmac.new(master_secret, b"trainguard-snapshot", hashlib.sha256).digest()


def encode_snapshot(snapshot: Snapshot, key: bytes) -> bytes:
    return seal(freeze(snapshot), key)


def freeze(snapshot: Snapshot) -> bytes:
    """The snapshot's state as bytes: what must happen while nothing folds into it."""
    snapshot.code_version = snapshot.code_version or code_version()
    return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)


def seal(frozen: bytes, key: bytes) -> bytes:
    """Compressed and signed: pure work on bytes (zlib releases the GIL), so a worker does
    it off its event loop (a fifth of a 16,384-rank snapshot's cost, issue 20)."""
    body = zlib.compress(frozen, 1)
    return _MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def decode_snapshot(value: bytes, key: bytes) -> Snapshot:
    if not value.startswith(_MAGIC) or len(value) < len(_MAGIC) + _MAC_BYTES:
        raise SnapshotError("not a trainguard snapshot")
    mac, body = value[len(_MAGIC) : len(_MAGIC) + _MAC_BYTES], value[len(_MAGIC) + _MAC_BYTES :]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise SnapshotError("bad signature (another master secret, or tampered)")
    try:
        snapshot = pickle.loads(zlib.decompress(body))  # signed by a processor: safe to unpickle
    except (
        ImportError,
        AttributeError,
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        ValueError,
        zlib.error,
    ) as exc:
        # Written by code whose classes lived elsewhere (a module moved or renamed): not
        # loadable, and not fatal: the state is rebuilt from the log instead.
        raise SnapshotError(f"written by other code ({type(exc).__name__}: {exc})") from exc
    if not isinstance(snapshot, Snapshot):
        raise SnapshotError(f"signed payload is a {type(snapshot).__name__}, not a Snapshot")
    if snapshot.code_version != code_version():
        raise SnapshotError(f"taken by trainguard {snapshot.code_version}, this is {code_version()}")
    return snapshot
