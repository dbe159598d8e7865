"""Writing one checkpoint to storage and committing it: every rank's shard through
``torch.distributed.checkpoint`` (fsynced locally, uploaded whole on an object store:
storage.py), then ``MANIFEST.json`` written LAST and
atomically by rank 0, with every file's sha256 and size: a directory without it is not a
checkpoint, so a crash mid-write leaves nothing resumable.

The collectives (DCP's own, the gather of the ranks' digests, the verdict's broadcast)
run on the manager's dedicated gloo group, in its background thread, never on the
training's default group. A failure anywhere is the same verdict on every rank, so all
ranks keep and retry the same snapshots (manager.py).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .storage import CheckpointStore
from .validate import MANIFEST, VALIDATED, model_norms

#: name -> {"sha256", "size"} of this rank's shard files.
Shards = dict[str, dict[str, Any]]


class ShardCommitter:
    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        storage_hook: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group  # None: a single process (no collectives)
        self.storage_hook = storage_hook

    def write(
        self, state: dict[str, Any], directory: CheckpointStore, manifest: dict[str, Any]
    ) -> Shards | str:
        """Write `state` into `directory` and commit it with `manifest`'s fields (run id,
        step, ...) plus the files, the world size and the parameter norms. This rank's
        shards, or the reason it failed (the same on every rank)."""
        try:
            if self.rank == 0:
                # A re-save of a step (after a rollback or a rejection): the old commit goes,
                # VALIDATED before the manifest it implies. A REJECTED marker stays, its reason
                # on record, until this save is validated (catalog.py: mark_validated).
                for stale in (VALIDATED, MANIFEST):
                    directory.remove(stale)
            writer = directory.dcp_writer(self.storage_hook)
            if self.group is not None:
                dcp.save({"app": state}, storage_writer=writer, process_group=self.group)
            else:
                dcp.save({"app": state}, storage_writer=writer, no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP wraps each rank's error (BaseException)
            return f"storage write failed: {describe_failure(exc)}"[:2000]
        mine: Shards | str
        try:
            mine = {
                name: dict(zip(("sha256", "size"), directory.digest(name), strict=True))
                for name in directory.names()
                if name.startswith(f"__{self.rank}_") and name.endswith(".distcp")
            }
        except Exception as exc:  # any store error: every rank must still reach the verdict
            mine = f"rank {self.rank} could not read back its shard: {exc}"
        parts = self.all_gather(mine)
        error: str | None = next((p for p in parts if isinstance(p, str)), None)
        if error is None and self.rank == 0:
            try:
                self._commit(state, directory, parts, manifest)
            except Exception as exc:
                error = f"manifest write failed: {exc}"
        if self.group is not None:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0, group=self.group)
            error = verdict[0]
        if error is not None:
            return error
        return mine if isinstance(mine, dict) else {}

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, on the checkpoint group (just ours in a single process)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _commit(
        self, state: dict[str, Any], directory: CheckpointStore, parts: list[Any], fields: dict[str, Any]
    ) -> None:
        files: dict[str, dict[str, Any]] = {}
        ranks: dict[str, list[str]] = {}
        for rank, part in enumerate(parts):
            ranks[str(rank)] = sorted(part)
            for name, meta in part.items():
                files[name] = {**meta, "rank": rank}
        digest, size = directory.digest(".metadata")
        files[".metadata"] = {"sha256": digest, "size": size, "rank": 0}
        manifest = {
            "format": 1,
            "run_id": fields["run_id"],
            "step": fields["step"],
            "world_size": self.world_size,
            "created": time.time(),
            "staged_at": fields["staged_at"],
            "last_verified_step": fields["last_verified_step"],
            "blocking_s": fields["blocking_s"],
            "files": files,
            "ranks": ranks,
            "param_norms": {name: list(v) for name, v in model_norms(state).items()},
            **fields.get("layout", {}),  # where the state keeps what (its buffers: train_state.py)
        }
        directory.write_json(manifest, MANIFEST)


def quiet_intended_overwrite(root: CheckpointStore) -> None:
    """Silence DCP's "Detected an existing checkpoint in ..., overwriting since
    self.overwrite=True" for the step directories under `root`, and only those. A re-save
    of a step (the run reaches again a step it saved before a resume or a rollback)
    overwrites it on purpose, its old commit removed first (ShardCommitter.write); every
    rank printed the warning at each such save, and it read as an alarm. The filter names
    `root`'s step directories as DCP's writers format their path (storage.py: dcp_writer),
    so a DCP save anywhere else in the process still warns. Call it from the thread that
    builds the manager: warning filters are process-wide and not thread-safe to change."""
    where = str(Path(root.root)) if root.local else root.url()
    message = re.escape(f"Detected an existing checkpoint in {where}/") + r"step-\d+, overwriting since "
    warnings.filterwarnings("ignore", message + re.escape("self.overwrite=True."), UserWarning)


def describe_failure(exc: BaseException) -> str:
    """A DCP failure as one line: every rank's error (DCP gathers them), else the exception."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(err).__name__}: {err}"
            for rank, (err, _trace) in sorted(exc.failures.items())
        )
    return f"{type(exc).__name__}: {exc}"
