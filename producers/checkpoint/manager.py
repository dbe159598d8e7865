"""Validated, atomic, asynchronous checkpoints: the rank side (seed §5, §7 failure 4, §8).

One :class:`CheckpointManager` per rank. ``save(step)`` copies the :class:`TrainState`
into host memory (:class:`HostStager`) and returns: that copy is the blocking cost C.
A background thread then writes it with ``torch.distributed.checkpoint`` (one file per
rank, fsynced) and commits, under a local directory or any fsspec URL (s3://...,
storage.py)::

    root/step-000000123/
        __0_0.distcp __1_0.distcp ... .metadata   every rank's shard (DCP)
        MANIFEST.json                             written LAST, atomically: the commit
        VALIDATED | REJECTED                      the validator's verdict (marker)

A directory without ``MANIFEST.json`` is not a checkpoint (a crash mid-write leaves
nothing resumable). The manifest holds step, world size, every file's sha256 and size,
the creation time, the caller's ``last_verified_step`` (R6 watermark) and per-tensor
parameter norms. Rank 0 then validates the checkpoint in another background thread
(:mod:`.validate`) and reports ``checkpoint_validated`` or
``checkpoint_failed``; :meth:`CheckpointManager.load` only ever restores a ``VALIDATED``
one, re-checking its digests first and falling back to the previous one when they fail
(marking the failed one ``REJECTED``: it is never chosen again).

Storage unavailable. A failed write (any exception from DCP, an ``OSError`` in
particular, or a ``storage_hook`` that raises) keeps the snapshot in host memory,
reports ``checkpoint_failed`` once for that step, and training goes on. Every later
``save`` (before it makes room for its own snapshot) and :meth:`flush` retry the kept
snapshots oldest first; at most ``max_pending`` are kept (the oldest is dropped, and
reported). A write that *hangs*
rather than fails cannot be bounded without blocking: ``save`` then waits once more than
``max_pending`` saves are queued.

Multi-rank. All ranks call ``save``/``flush``/``load``/``close`` at the same steps (it is
a synchronous job). DCP's collectives and the commit's run on a dedicated gloo group in
the single background thread, so they never interleave with the training's collectives
on the default group (NOTES: ``async_save`` on the default group hung DDP). DCP raises
a write failure on every rank, so all ranks keep and retry the same snapshots.

Peer replica (R1, :mod:`.peer_replica`). With ``replica=True`` (or a
:class:`~.peer_replica.PeerReplica`), every staged snapshot is also handed to the replica,
which keeps it and exchanges it with the rank ``W/2`` away in the background; the staged
buffers are reused only once both the write and the replica are done with them.
``load()`` then restores from host memory when every rank can restore the same step
from its own copy or its holder's and that step is at least as new as the newest
validated checkpoint on storage; otherwise (or if a copy fails its checks on any rank)
every rank loads storage's. ``last_restore`` says which step and from where.

Retention (catalog.py: the rule). After each validation rank 0, and only it, deletes the
step directories below the oldest of the ``keep`` most recently validated checkpoints
(``keep``: the constructor's, else ``TRAINGUARD_CHECKPOINT_KEEP``, default 5), never a
pinned one nor one this manager is still writing or validating. It runs wherever the
manager runs, offline or under a processor, on a directory or an object store; a
deletion that fails is logged and retried at the next validation, never raised.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ...common.moved import deprecate_names
from ..training import inprocess
from ..training.config import checkpoint_keep
from .catalog import CheckpointCatalog, step_dir_name
from .commit import ShardCommitter, describe_failure, quiet_intended_overwrite
from .host_stager import HostStager, state_nbytes
from .peer_replica import PeerReplica, agree_restore, holder_of, load_into
from .storage import CheckpointStore
from .train_state import TrainState, buffer_keys
from .validate import (
    REJECTED,
    NormBand,
    ValidationResult,
    read_manifest,
    validate,
    verify_files,
    write_marker,
)

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointReporter", "SaveHandle", "step_dir_name"]

log = logging.getLogger(__name__)

#: Waits before validating again after a storage error (validate.py's `storage_error`): a
#: transient outage of an object store passes; a longer one leaves the step unvalidated.
VALIDATE_RETRY_S = (0.5, 2.0, 8.0)

# dcp warns on every single-process save/load that it assumes a single process: it does.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class CheckpointReporter(Protocol):
    """What the manager reports; :class:`~trainguard.producers.rank.agent.RankAgent` satisfies it."""

    def checkpoint_written(
        self,
        checkpoint_step: int,
        uri: str,
        shards: int,
        digest: str,
        nbytes: int,
        blocking_s: float,
        write_s: float,
    ) -> None: ...

    def checkpoint_validated(self, checkpoint_step: int, uri: str, last_verified_step: int) -> None: ...

    def checkpoint_failed(self, checkpoint_step: int, uri: str, error: str) -> None: ...


class CheckpointError(RuntimeError):
    """No resumable checkpoint, or the one named is not validated."""


@dataclass
class SaveHandle:
    """What ``save`` returns once the state is staged (``blocking_s`` is C).

    ``attempted`` resolves after the first write attempt: ``"committed"`` or ``"pending"``
    (kept in host memory, storage unavailable). ``committed`` resolves True once the
    manifest is written (possibly by a later flush) or False if the snapshot was dropped.
    """

    step: int
    blocking_s: float
    nbytes: int
    attempted: Future[str] = field(default_factory=Future)
    committed: Future[bool] = field(default_factory=Future)

    def wait(self, timeout: float | None = None) -> str:
        return self.attempted.result(timeout)


@dataclass
class _Snapshot:
    step: int
    state: dict[str, Any]
    last_verified_step: int
    handle: SaveHandle
    staged_at: float
    failure_reported: bool = False
    holds: int = 1  # readers of ``state`` (the write, the replica); released at 0


class CheckpointManager:
    """Saves, commits, validates and restores one rank's checkpoints (module docstring)."""

    def __init__(
        self,
        root: Path | str | CheckpointStore,
        state: TrainState,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        reporter: CheckpointReporter | None = None,
        keep: int | None = None,
        max_pending: int = 2,
        process_group: dist.ProcessGroup | None = None,
        storage_hook: Callable[[], None] | None = None,
        on_committed: Callable[[int, CheckpointStore], None] | None = None,
        norm_band: NormBand | None = None,
        replica: PeerReplica | bool | None = None,
    ) -> None:
        if keep is None:  # the operator's, through the launcher's environment (config.py)
            keep = checkpoint_keep(os.environ)
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.catalog = CheckpointCatalog(root)
        self.root = self.catalog.store  # a local directory or any fsspec location (storage.py)
        quiet_intended_overwrite(self.root)
        self.state = state
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.reporter = reporter
        #: Validated checkpoints retention keeps (module docstring).
        self.keep = keep
        #: Steps of the latest cross-rank checks this rank ran (the Supervisor's): retention
        #: keeps each one's rollback ancestor (catalog.py).
        self.watermarks: deque[int] = deque(maxlen=2)
        #: Steps saved and not yet validated, failed or dropped: retention leaves them be.
        self._busy: Counter[int] = Counter()
        self._busy_lock = threading.Lock()
        #: In-process restart ended this attempt: its validator deletes nothing more (the
        #: next attempt's manager, unseen here, may be writing below this one's kept ones).
        self._abandoned = False
        self.max_pending = max(1, max_pending)
        self.storage_hook = storage_hook
        self.on_committed = on_committed
        self.results: dict[int, ValidationResult] = {}
        self._dist = world_size > 1
        if self._dist and not dist.is_initialized():
            raise RuntimeError("world_size > 1 needs an initialized default process group")
        self._own_group = self._dist and process_group is None
        self._group = process_group
        if self._own_group:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # this rank is a member
            self._group = group
        self._committer = ShardCommitter(rank, world_size, self._group if self._dist else None, storage_hook)
        self._stager = HostStager()
        self._pending: list[_Snapshot] = []  # touched by the io thread only
        self._queued = 0
        self._cond = threading.Condition()
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-io-{rank}")
        self._validator = ThreadPoolExecutor(1, thread_name_prefix="ckpt-validate") if rank == 0 else None
        self._band = norm_band if norm_band is not None else NormBand()
        self._closed = False
        self._holds = threading.Lock()
        restartable = inprocess.current()
        if replica is None:  # under in-process restart the memory copies are what it restores
            replica = restartable is not None
        self._own_replica = replica is True and self._dist and restartable is None
        self.replica: PeerReplica | None = None
        if isinstance(replica, PeerReplica):
            self.replica = replica
        elif self._own_replica:
            self.replica = PeerReplica(rank, world_size, run_id=run_id)
        elif replica is True and self._dist and restartable is not None:
            self.replica = _kept_replica(restartable, rank, world_size, run_id, _portable(state))
        if restartable is not None:
            restartable.on_restart(self._abandon)
        self.last_restore: tuple[int, str] | None = None  # (step, "own" | "peer" | "storage")
        #: TRAINGUARD_RESTORE_FROM=storage: never restore from host memory (an operator who
        #: trusts only validated files; the benchmark's storage side).
        self.memory_restore = os.environ.get("TRAINGUARD_RESTORE_FROM", "memory") != "storage"
        #: Checkpoints the last load() rejected (rank 0), step -> reason.
        self.rejected: dict[int, str] = {}
        self.last_load_s: float | None = None
        if rank == 0:
            self._seed_band()

    # ------------------------------------------------------------------ saving

    def step_dir(self, step: int) -> CheckpointStore:
        return self.catalog.step_dir(step)

    def save(self, step: int, last_verified_step: int = -1) -> SaveHandle:
        """Stage the state into host memory and return; write and commit in the background."""
        if self._closed:
            raise RuntimeError("checkpoint manager is closed")
        with self._cond:
            while self._queued > self.max_pending:  # only when writes hang (module docstring)
                self._cond.wait()
            self._queued += 1
        with self._busy_lock:
            self._busy[step] += 1
        t0 = time.perf_counter()
        staged = self._stager.stage(self.state.saved_state_dict())
        blocking = time.perf_counter() - t0
        handle = SaveHandle(step, blocking, state_nbytes(staged))
        snap = _Snapshot(step, staged, last_verified_step, handle, time.time())
        if self.replica is not None:
            snap.holds = 2
            self.replica.push(step, staged, on_done=lambda: self._release(snap))
        self._io.submit(self._run_save, snap)
        return handle

    def _release(self, snap: _Snapshot) -> None:
        with self._holds:
            snap.holds -= 1
            if snap.holds == 0:
                self._stager.release(snap.state)

    def flush(self, timeout: float | None = None) -> int:
        """Retry writing the snapshots kept in host memory; returns how many are still kept."""
        return self._io.submit(self._flush_pending).result(timeout)

    def pending_steps(self) -> list[int]:
        """Steps kept in host memory (waits for queued saves to be attempted)."""
        return self._io.submit(lambda: [s.step for s in self._pending]).result()

    def wait(self) -> None:
        """Until every queued save has been attempted (not validated)."""
        self._io.submit(lambda: None).result()

    def wait_validated(self) -> None:
        """Until every queued save has been attempted and every commit validated (rank 0)."""
        self.wait()
        if self._validator is not None:
            self._validator.submit(lambda: None).result()

    def _run_save(self, snap: _Snapshot) -> None:
        try:
            if self._pending:  # storage may be back: write the kept ones before making room
                self._flush_pending()
            self._pending.append(snap)
            while len(self._pending) > self.max_pending:
                old = self._pending.pop(0)
                self._drop(old, f"dropped from host memory: more than {self.max_pending} checkpoints pending")
            self._flush_pending()
        except (Exception, CheckpointException):  # never let the background thread die silently
            log.exception("checkpoint save of step %d failed unexpectedly", snap.step)
        finally:
            if not snap.handle.attempted.done():
                snap.handle.attempted.set_result("pending" if snap in self._pending else "dropped")
            with self._cond:
                self._queued -= 1
                self._cond.notify_all()

    def _drop(self, snap: _Snapshot, reason: str) -> None:
        log.warning("checkpoint step %d %s", snap.step, reason)
        self._done_with(snap.step)
        self._report_failed(snap.step, reason)
        snap.handle.committed.set_result(False)
        if not snap.handle.attempted.done():
            snap.handle.attempted.set_result("dropped")

    def _flush_pending(self) -> int:
        while self._pending:
            snap = self._pending[0]
            error = self._write(snap)
            if error is not None:
                for kept in self._pending:  # the ones behind it wait for the same storage
                    if not kept.handle.attempted.done():
                        kept.handle.attempted.set_result("pending")
                    if not kept.failure_reported:
                        kept.failure_reported = True
                        self._report_failed(kept.step, f"{error}; kept in host memory, will retry")
                return len(self._pending)
            self._pending.pop(0)
            self._release(snap)
            if not snap.handle.attempted.done():
                snap.handle.attempted.set_result("committed")
            snap.handle.committed.set_result(True)
        return 0

    def _write(self, snap: _Snapshot) -> str | None:
        """Write and commit one snapshot; None on success, else the reason (same on all ranks)."""
        directory = self.step_dir(snap.step)
        t0 = time.perf_counter()
        manifest = {
            "run_id": self.run_id,
            "step": snap.step,
            "staged_at": snap.staged_at,
            "last_verified_step": snap.last_verified_step,
            "blocking_s": snap.handle.blocking_s,
            "layout": self.state.manifest(),
        }
        written = self._committer.write(snap.state, directory, manifest)
        if isinstance(written, str):
            return written
        own = written
        write_s = time.perf_counter() - t0
        digest = hashlib.sha256("".join(meta["sha256"] for meta in own.values()).encode()).hexdigest()
        nbytes = sum(meta["size"] for meta in own.values())
        self._report(
            "checkpoint_written",
            snap.step,
            str(directory),
            len(own),
            digest,
            nbytes,
            snap.handle.blocking_s,
            write_s,
        )
        if self.rank == 0:
            if self.on_committed is not None:
                self.on_committed(snap.step, directory)
            assert self._validator is not None
            self._validator.submit(self._validate, snap.step, snap.last_verified_step)
        else:
            self._done_with(snap.step)
        return None

    def _done_with(self, step: int) -> None:
        with self._busy_lock:
            self._busy[step] -= 1
            if self._busy[step] <= 0:
                del self._busy[step]

    # -------------------------------------------------------------- validation

    def _seed_band(self) -> None:
        for step in self.validated_steps()[-self._band.history :]:
            manifest = read_manifest(self.step_dir(step)) or {}
            norms = manifest.get("param_norms") or {}
            self._band.add({name: (float(n), int(k)) for name, (n, k) in norms.items()})

    def _validate(self, step: int, last_verified_step: int) -> None:
        directory = self.step_dir(step)
        try:
            result = validate(directory, norm_band=self._band)
            for wait_s in VALIDATE_RETRY_S:  # the store failed, not the checkpoint: again
                if not result.storage_error or self._abandoned:
                    break
                log.warning("checkpoint step %d: %s; validating again in %.1f s", step, result.reason, wait_s)
                time.sleep(wait_s)
                result = validate(directory, norm_band=self._band)
            self.results[step] = result
            if result.storage_error:  # no verdict: neither marker; not resumable until validated
                self._report_failed(step, f"validation could not finish: {result.reason}")
            elif result.ok:
                marker = {"step": step, "validated_at": time.time(), "last_verified_step": last_verified_step}
                self.catalog.mark_validated(step, marker)
                self._band.add(result.norms)
                self._report("checkpoint_validated", step, str(directory), last_verified_step)
            else:
                log.warning("checkpoint step %d rejected: %s", step, result.reason)
                write_marker(directory, False, {"step": step, "reason": result.reason, "at": time.time()})
                self._report_failed(step, f"validation failed: {result.reason}")
        except Exception as exc:
            log.exception("validating checkpoint step %d failed", step)
            self._report_failed(step, f"validation could not run: {type(exc).__name__}: {exc}")
        finally:
            self._done_with(step)
        self._retain()

    def _retain(self) -> None:
        """Rank 0, after a validation: delete what retention does not keep (catalog.py).
        Housekeeping: an error (the store's listing down) is logged, never raised."""
        if self._abandoned:
            return
        with self._busy_lock:
            busy = set(self._busy)
        try:
            deleted = self.catalog.retain(self.keep, busy, tuple(self.watermarks))
        except Exception as exc:
            log.warning("checkpoint retention skipped this time under %s: %s", self.root, exc)
            return
        if deleted:
            log.info("checkpoint retention deleted steps %s (keeping %d validated)", deleted, self.keep)

    # ---------------------------------------------------------------- resuming

    def committed_steps(self) -> list[int]:
        return self.catalog.committed_steps()

    def validated_steps(self) -> list[int]:
        """Committed, ``VALIDATED`` and not ``REJECTED`` checkpoints, oldest first."""
        return self.catalog.validated_steps()

    def latest_validated(self) -> int | None:
        return self.catalog.latest_validated()

    def rejection_reason(self, step: int) -> str | None:
        """Why a checkpoint is not resumable, or None when it is validated."""
        return self.catalog.rejection_reason(step)

    def _choose(self, step: int | None, verify: bool, below: int | None = None) -> tuple[int | None, str]:
        """Rank 0: the newest resumable checkpoint at or before `step` (all when None).

        A named `step` that does not exist or was never validated is the caller's error (no
        fallback); `below` limits an unnamed choice to older steps. A checkpoint that fails
        re-verification is marked ``REJECTED`` (never chosen again, by this manager nor by
        the launcher) and reported; the next older validated one is tried. Returns (the
        step, "") or (None, every reason)."""
        if step is not None and not self.step_dir(step).exists(REJECTED):
            reason = self.rejection_reason(step)  # absent or never validated
            if reason is not None:
                return None, reason
        bound = step if step is not None else below
        older = [s for s in reversed(self.validated_steps()) if bound is None or s < bound]
        candidates = ([] if step is None else [step]) + older
        reasons = []
        for s in candidates:
            if reason := self.rejection_reason(s):
                reasons.append(reason)
                continue
            d = self.step_dir(s)
            if verify:
                manifest = read_manifest(d) or {}
                if reason := verify_files(d, manifest):
                    self._reject(s, f"re-verification before resume failed: {reason}")
                    reasons.append(f"checkpoint step {s}: {reason}")
                    continue
            return s, ""
        if not candidates:
            return None, f"no validated checkpoint under {self.root}"
        return None, f"no valid checkpoint left under {self.root}: " + "; ".join(reasons)

    def _reject(self, step: int, reason: str) -> None:
        """Rank 0: mark a checkpoint REJECTED (atomically: the launcher reads the marker to
        choose the next attempt's resume step) and report the failure."""
        write_marker(self.step_dir(step), False, {"step": step, "reason": reason, "at": time.time()})
        self._report_failed(step, reason)
        self.rejected[step] = reason

    def load(self, step: int | None = None, *, verify: bool = True, peer: bool = True) -> int:
        """Restore the newest validated checkpoint (or ``step``) into the state; returns its step.

        Waits for queued saves first. ``verify`` re-checks the digests (a checkpoint whose
        files changed since validation is marked ``REJECTED``, and the previous one is
        tried; a peer copy's sha256). A named ``step`` that is rejected (now, or before)
        or whose load fails falls back the same way, to the newest validated checkpoint
        older than it: the caller resumes from the step returned, and rank 0 reports each
        rejection (``checkpoint_rejected``) with that step. Every rank returns the same
        step. With a replica, ``peer`` and no ``step``, host memory is preferred when it
        is at least as new (module docstring). Raises
        :class:`CheckpointError` when there is nothing resumable. Its duration is kept in
        ``last_load_s`` (a restart phase: the launcher reads it through the Supervisor).
        """
        started = time.perf_counter()
        try:
            return self._load(step, verify=verify, peer=peer)
        finally:
            self.last_load_s = time.perf_counter() - started

    def _load(self, step: int | None, *, verify: bool, peer: bool) -> int:
        self.wait()
        self.rejected = {}
        copies: list[Any] = []
        if peer and self.memory_restore and self.replica is not None:
            copies = self._committer.all_gather(self.replica.all_steps())
            memory: list[int | None] = [None]
            if self.rank == 0:
                memory = [self._memory_step(step, copies)]
            if self._dist:
                dist.broadcast_object_list(memory, src=0, group=self._group)
            if memory[0] is not None and self._load_memory(int(memory[0]), copies, verify):
                return int(memory[0])
        choice: list[Any] = [None, ""]
        if self.rank == 0:
            choice = list(self._choose(step, verify))
        if self._dist:
            dist.broadcast_object_list(choice, src=0, group=self._group)
        chosen, why = choice
        while True:  # every rank runs this loop alike: the choice and DCP's errors are collective
            if chosen is None:
                self._report_rejections(step, -1)
                raise CheckpointError(why)
            reader = self.step_dir(chosen).dcp_reader()
            # Load what this checkpoint holds where it holds it (older ones: buffers in "model").
            saved = read_manifest(self.step_dir(chosen)) or {}
            self.state.load_layout = saved.get("buffers", "model")
            try:
                if self._dist:
                    dcp.load({"app": self.state}, storage_reader=reader, process_group=self._group)
                else:
                    dcp.load({"app": self.state}, storage_reader=reader, no_dist=True)
                break
            except CheckpointException as exc:  # a BaseException: callers catching Exception would miss it
                # It failed on some rank (DCP gathers every rank's error, so all see it):
                # the ranks that loaded fine load the older one with it, so all agree.
                failed = f"loading checkpoint step {chosen} failed: {describe_failure(exc)}"
                choice = [None, failed]
                if self.rank == 0:
                    self._reject(int(chosen), failed)
                    older, why = self._choose(None, verify, below=int(chosen))
                    choice = [older, f"{failed}; {why}" if why else failed]
                if self._dist:
                    dist.broadcast_object_list(choice, src=0, group=self._group)
                chosen, why = choice
        self._report_rejections(step, int(chosen))
        self.last_restore = (int(chosen), "storage")
        return int(chosen)

    def _memory_step(self, step: int | None, copies: list[Any]) -> int | None:
        """Rank 0: the step every rank restores from host memory (its own copy or its
        holder's), or None for storage. Unnamed: the newest such step at least as new as
        the newest validated checkpoint; named (the launcher's resume step): that step
        exactly, and only if it is validated. No storage read either way."""
        assert self.replica is not None
        shift = self.replica.shift
        own = [set(mine) for mine, _ in copies]
        held = [set(theirs) for _, theirs in copies]
        if step is not None:
            if self.rejection_reason(step) is not None:
                return None
            holder = [holder_of(j, self.world_size, shift) for j in range(self.world_size)]
            every = all(step in own[j] or step in held[holder[j]] for j in range(self.world_size))
            return step if every else None
        agreed, source = agree_restore(
            [tuple(o) for o in own],
            [tuple(h) for h in held],
            self.latest_validated(),
            holder=lambda j: holder_of(j, self.world_size, shift),
            rejected=lambda s: self.step_dir(s).exists(REJECTED),
        )
        return agreed if source == "memory" else None

    def _report_rejections(self, asked: int | None, resumed: int) -> None:
        """Rank 0: each checkpoint rejected by this load, on the console with its reason
        (otherwise only in its REJECTED marker) and as CheckpointRejected (the reporter's
        optional ``checkpoint_rejected``), with the step resumed from instead."""
        if self.rank != 0 or not self.rejected:
            return
        rejected = sorted(self.rejected.items(), reverse=True)
        then = f"resuming from step {resumed}" if resumed >= 0 else "no checkpoint left to resume from"
        log.warning(
            "checkpoint steps %s rejected before resume (asked for %s): %s; %s",
            sorted(self.rejected), asked, "; ".join(f"step {s}: {why}" for s, why in rejected), then,
        )  # fmt: skip
        report = getattr(self.reporter, "checkpoint_rejected", None)
        if report is None:
            return
        for step, reason in rejected:
            try:
                report(step, str(self.step_dir(step)), reason, resumed)
            except Exception:
                log.exception("checkpoint reporter checkpoint_rejected failed")

    def _load_memory(self, step: int, copies: list[Any], verify: bool) -> bool:
        """Every rank restores ``step`` from its own copy or its holder's; False (on all
        ranks) when any rank failed, and then storage is loaded instead."""
        assert self.replica is not None
        needs_peer = [step not in own for own, _ in copies]
        error = None
        try:
            restored = self.replica.fetch(step, needs_peer, verify=verify)
            load_into(self.state, restored)
        except Exception as exc:
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            log.warning("restoring step %d from host memory failed: %s", step, error)
        errors = [e for e in self._committer.all_gather(error) if e is not None]
        if errors:
            # ranks that did restore overwrite it from storage next; report once
            self._report_failed(step, "peer restore failed, loading storage: " + "; ".join(errors))
            return False
        self.last_restore = (step, "peer" if needs_peer[self.rank] else "own")
        return True

    # ------------------------------------------------------------------ misc

    def close(self) -> None:
        """Wait for queued writes (one last flush of kept snapshots) and validations."""
        if self._closed:
            return
        self._closed = True
        left = self.flush()
        if left:
            for snap in self._io.submit(lambda: list(self._pending)).result():
                log.error("checkpoint step %d was never written: storage unavailable at close", snap.step)
                snap.handle.committed.set_result(False)
        self._io.shutdown(wait=True)
        if self._validator is not None:
            self._validator.shutdown(wait=True)
        if self._own_replica and self.replica is not None:
            self.replica.close()
        if self._own_group and self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def _abandon(self, error: BaseException | None) -> None:
        """In-process restart: the attempt ended with its peers gone. Queued saves are
        dropped (never committed: the next attempt resumes from a validated one) and no
        thread is waited for (one may be failing in a collective of the ended attempt)."""
        if self._closed:
            return
        self._closed = True
        self._abandoned = True
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._validator is not None:
            self._validator.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _report(self, method: str, *args: Any) -> None:
        if self.reporter is None:
            return
        try:
            getattr(self.reporter, method)(*args)
        except Exception:
            log.exception("checkpoint reporter %s failed", method)

    def _report_failed(self, step: int, reason: str) -> None:
        if self.rank == 0:
            self._report("checkpoint_failed", step, str(self.step_dir(step)), reason)


def _portable(state: TrainState) -> bool:
    """The state is the same on every rank, whole in each rank's copy (an elastic job's,
    with no buffers kept by one rank only): a copy restores any rank of any world."""
    if getattr(state, "per_rank", True):  # any Stateful may be checkpointed: only ours says
        return False
    return state.buffers != "rank0" or not buffer_keys(state.model, get_model_state_dict(state.model))


def _kept_replica(
    restartable: inprocess.Restartable, rank: int, world_size: int, run_id: str, portable: bool = False
) -> PeerReplica:
    """The peer replica this process kept from its last attempt (its copies are the
    in-memory restore), on a new group; a new one in a new process or for another rank,
    unless the state is `portable` (elastic training): then its own copies go on under
    its new rank (PeerReplica.rebind). Either way one new group per rank, as every rank
    creates its groups in the same order."""
    made: list[PeerReplica] = []

    def make() -> PeerReplica:
        made.append(PeerReplica(rank, world_size, run_id=run_id))
        return made[0]

    kept = restartable.keep("peer-replica", make)
    if made:
        return kept
    if (kept.rank, kept.world_size, kept.run_id) == (rank, world_size, run_id) and kept.rejoin():
        return kept
    if portable and kept.run_id == run_id and kept.rebind(rank, world_size):
        return kept
    kept.close(wait=False)  # its exchange may be stuck on the lost peer
    restartable.forget("peer-replica")
    return restartable.keep("peer-replica", make)


# A script's old path keeps working for a while, with a warning naming the public one.
deprecate_names(__name__, "trainguard.torch", ("CheckpointManager", "CheckpointError"))
