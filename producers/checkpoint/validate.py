"""Checkpoint validation (seed §7 failure 4): is this checkpoint safe to resume from?

A checkpoint directory ``step-000000123/`` (local, or on any fsspec filesystem:
storage.py) exists only once its ``MANIFEST.json`` is in
place (written last, atomically, by :mod:`.manager`). :func:`validate` checks, in order:

1. the manifest is present and readable;
2. every shard it lists is present with the recorded size;
3. every shard's sha256 matches the manifest (a flipped byte fails here);
4. a test load succeeds: ``dcp.load`` of *every* stored item into fresh CPU memory
   (shapes, dtypes and the serialized objects all deserialize);
5. parameter norms are sane: finite, and within the run's historical band
   (:class:`NormBand`).

The verdict is recorded next to the checkpoint in a marker written atomically: ``VALIDATED``
or ``REJECTED`` (json with the reason). Resume only considers ``VALIDATED`` ones. A storage
error other than a missing file in steps 1-3 (an object store's 5xx, a timeout) is no
verdict: the result says ``storage_error`` and the manager validates again later; a good
checkpoint is never rejected for the store's hiccup.

Norm band rule. Per model tensor the band works on the RMS (norm / sqrt(numel)), so
tensors of any size compare alike. Over the last ``history`` validated checkpoints a
tensor's RMS spanned ``[lo, hi]``; a new RMS ``r`` passes when
``lo / factor - floor <= r <= hi * factor + floor`` (``factor`` 10, ``floor`` 1e-3). Normal
training drift between checkpoints is far inside 10x; a tensor scaled by 100 fails as
soon as its RMS exceeds ~1e-5. The absolute ``floor`` lets a zero-initialised bias start
moving. With no history (the first checkpoint) only finiteness is checked.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .markers import MANIFEST, REJECTED, VALIDATED
from .storage import CheckpointStore, atomic_write_json, file_digest

__all__ = [
    "MANIFEST",
    "REJECTED",
    "VALIDATED",
    "NormBand",
    "ValidationResult",
    "atomic_write_json",
    "file_digest",
    "model_norms",
    "read_manifest",
    "validate",
    "verify_files",
    "write_marker",
]


#: A tensor's (norm, numel), by fully qualified parameter name.
Norms = dict[str, tuple[float, int]]


#: A checkpoint directory: a local path, a URL fsspec knows, or a store (storage.py).
Location = Path | str | CheckpointStore


def read_manifest(directory: Location, strict: bool = False) -> dict[str, Any] | None:
    """The manifest (None: missing or unreadable); `strict`: a storage error is raised."""
    return CheckpointStore.of(directory).read_json(MANIFEST, strict=strict)


def write_marker(directory: Location, ok: bool, payload: dict[str, Any]) -> None:
    CheckpointStore.of(directory).write_json(payload, VALIDATED if ok else REJECTED)


def model_norms(state: dict[str, Any]) -> Norms:
    """Per-tensor (norm, numel) of the model's floating tensors.

    Accepts the app state (``{"model": {...}}``, as staged) or a flat test-loaded
    checkpoint (``{"app.model.<fqn>": tensor, ...}``).
    """
    if "model" in state and isinstance(state["model"], dict):
        items = list(state["model"].items())
    else:
        prefix = "app.model."
        items = [(key[len(prefix) :], value) for key, value in state.items() if key.startswith(prefix)]
    out: Norms = {}
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            out[name] = (float(torch.linalg.vector_norm(local.detach().float()).item()), local.numel())
    return out


@dataclass
class NormBand:
    """The run's historical per-tensor RMS band (see the module docstring for the rule)."""

    history: int = 8
    factor: float = 10.0
    floor: float = 1e-3
    _seen: deque[dict[str, float]] = field(default_factory=deque)

    def add(self, norms: Norms) -> None:
        self._seen.append({name: _rms(n, k) for name, (n, k) in norms.items()})
        while len(self._seen) > self.history:
            self._seen.popleft()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, norms: Norms) -> str | None:
        """None when every tensor is within the band, else the first reason it is not."""
        for name, (norm, numel) in norms.items():
            if not math.isfinite(norm):
                return f"parameter {name} norm is not finite ({norm})"
            past = [seen[name] for seen in self._seen if name in seen]
            if not past:
                continue
            rms, lo, hi = _rms(norm, numel), min(past), max(past)
            if rms > hi * self.factor + self.floor:
                return (
                    f"parameter {name} norm {norm:.6g} jumped out of band: rms {rms:.6g} > "
                    f"{self.factor:g} x historical max {hi:.6g}"
                )
            if rms < lo / self.factor - self.floor:
                return (
                    f"parameter {name} norm {norm:.6g} collapsed out of band: rms {rms:.6g} < "
                    f"historical min {lo:.6g} / {self.factor:g}"
                )
        return None


def _rms(norm: float, numel: int) -> float:
    return norm / math.sqrt(max(numel, 1))


@dataclass(frozen=True)
class ValidationResult:
    ok: bool
    reason: str
    step: int
    norms: Norms = field(default_factory=dict)
    seconds: float = 0.0
    #: The store failed, not the checkpoint (an error other than a missing file while
    #: reading the manifest or a shard's size or digest): validate again, never reject.
    storage_error: bool = False


def verify_files(directory: Location, manifest: dict[str, Any]) -> str | None:
    """None when every listed file is present with its size and digest, else the reason."""
    store = CheckpointStore.of(directory)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no shard files"
    for name, meta in sorted(files.items()):
        size = store.size(name)
        if size is None:
            return f"missing shard {name}"
        if size != meta["size"]:
            return f"shard {name} has {size} bytes, manifest says {meta['size']}"
    for name, meta in sorted(files.items()):
        digest, _ = store.digest(name)
        if digest != meta["sha256"]:
            return (
                f"digest mismatch in shard {name}: sha256 {digest[:16]}..., manifest {meta['sha256'][:16]}..."
            )
    return None


def _expected_shards(manifest: dict[str, Any]) -> str | None:
    world = manifest.get("world_size")
    ranks = manifest.get("ranks")
    if not isinstance(world, int) or not isinstance(ranks, dict):
        return "manifest lacks world_size or ranks"
    missing = [r for r in range(world) if str(r) not in ranks]
    if missing:
        return f"manifest has no shard list for ranks {missing} of {world}"
    if ".metadata" not in manifest.get("files", {}):
        return "manifest does not list the .metadata file"
    return None


_UNLOADED = object()


def test_load(directory: Location) -> dict[str, Any]:
    """Load every stored item into fresh CPU memory, flat by key (raises on any failure).

    The template is built from DCP's ``.metadata``: an empty tensor of the recorded shape
    and dtype per tensor, a placeholder per serialized object; ``dcp.load`` fills both.
    """
    store = CheckpointStore.of(directory)
    reader = store.dcp_reader()
    state: dict[str, Any] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            state[key] = _UNLOADED
    dcp.load(state, storage_reader=store.dcp_reader(), no_dist=True)
    missing = [key for key, value in state.items() if value is _UNLOADED]
    if missing:
        raise ValueError(f"{len(missing)} items did not load, e.g. {missing[0]}")
    return state


# pytest would collect a module-level function named test_*
test_load.__test__ = False  # type: ignore[attr-defined]


def validate(directory: Location, *, norm_band: NormBand | None = None) -> ValidationResult:
    """Validate one checkpoint directory; never raises (a failure is a result with a reason)."""
    t0 = time.perf_counter()
    directory = CheckpointStore.of(directory)
    step = _step_of(directory.name)

    def fail(reason: str) -> ValidationResult:
        return ValidationResult(False, reason, step, seconds=time.perf_counter() - t0)

    try:
        manifest = read_manifest(directory, strict=True)
        if manifest is None:
            return fail("no readable manifest: the checkpoint was never committed")
        step = int(manifest.get("step", step))
        if reason := _expected_shards(manifest):
            return fail(reason)
        if reason := verify_files(directory, manifest):
            return fail(reason)
    except FileNotFoundError as exc:  # a shard listed, then gone: the checkpoint's fault
        return fail(f"missing file: {exc}"[:2000])
    except OSError as exc:  # the store's (a 5xx, a timeout): not a verdict on the checkpoint
        result = fail(f"storage error while validating: {type(exc).__name__}: {exc}"[:2000])
        return dataclasses.replace(result, storage_error=True)
    try:
        loaded = test_load(directory)
    except (Exception, CheckpointException) as exc:  # any failure to deserialize is a reason to reject
        return fail(f"test load failed: {type(exc).__name__}: {exc}"[:2000])
    norms = model_norms(loaded)
    if not norms:
        return fail("test load found no model parameters")
    if reason := (norm_band or NormBand()).check(norms):
        return fail(reason)
    return ValidationResult(True, "ok", step, norms=norms, seconds=time.perf_counter() - t0)


def _step_of(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[-1])
    except ValueError:
        return -1
