"""In-memory peer replicas of checkpoint snapshots (seed §6 item 2, revision R1; issue 5).

Each rank keeps copies of its last two staged snapshots in host memory: its *own*, and
the ones of its *source* rank, received over the network (two, because a restart names
the newest *validated* step, and the newest save may still be in validation). A rank whose process is
replaced (its memory lost) gets its state back from the rank holding its copy instead
of reading storage; ranks that survived restore from their own copy. Both are cheap next
to a storage read at scale (R1: ~1 s instead of ~30 s), and they make a host-memory
checkpoint at a tighter interval worth taking: this attacks C, not R.

Pairing (R1). Rank ``r``'s copy is held by ``holder(r) = (r + k) % W`` with
``k = ceil(W / 2)``: for even ``W`` that is the seed's ``r + W/2`` and the pairing is
symmetric (r and r + W/2 hold each other's copy), so a failure domain made of
consecutive ranks (a node, a rack: ranks are assumed numbered node-major, as torchrun
does) never holds the replica of its own ranks, unlike neighbour replication (r + 1),
which loses both copies exactly when failures are correlated. For odd ``W`` the shift is
``ceil(W/2)``: a ring, not pairs (r holds the copy of ``r - k`` and its own sits on
``r + k``); every rank still holds exactly one copy, half the ring away. ``shift``
overrides ``k`` when failure domains are laid out otherwise. ``W = 1``: no replica.

What a copy is: exactly what that rank restores, i.e. its staged ``TrainState`` state
dict (model and optimizer as this rank holds them: its shard under FSDP, where a
``DTensor`` is sent as its local shard and rebuilt on the restoring rank's mesh; the
whole model under DDP) and its per-rank entry (RNG states, sampler, extra), tagged with
run id, rank, world size and step, plus a sha256 of the bytes. It is packed into one
flat byte tensor (the tensors' bytes, 64-byte aligned, after a small pickled skeleton),
so sending is one message and restoring builds zero-copy views on it: no
``torch.save``/``torch.load`` of 300 MB (0.36 s + 0.43 s on this machine).

Exchange. :meth:`PeerReplica.push` (called by :class:`~.manager.CheckpointManager`
right after staging) packs and exchanges in a background thread, on a dedicated gloo
group (never the default one: NOTES, collectives interleaving with DDP's hang); every
rank pushes the same steps in the same order, so the sends and receives pair up. At
most ``max_queued`` pushes wait (``push`` blocks beyond that). The staged snapshot is
handed back through ``on_done`` once packed, so the manager can reuse its buffers.
Memory: four copies of one rank's state per rank (own and held, two saves each), plus
one of each being refilled.

Restore (:meth:`PeerReplica.plan` and :meth:`PeerReplica.fetch`, driven by
``CheckpointManager.load``). Every rank reports the steps of its own and held copies;
rank ``j`` can restore step ``s`` from memory if it has its own copy of ``s`` or its
holder has one. The memory step is the newest ``s`` that *every* rank can restore this way (all
ranks must resume at the same step: a mixed step is a silent divergence), excluding
steps whose storage checkpoint was ``REJECTED``. Unnamed, it is used when it is at least
as new as the newest validated checkpoint on storage (at equal steps the copies hold the same
bytes as the storage checkpoint, and memory is faster); otherwise everyone loads the
storage one; a named step (the launcher's resume step) is restored from memory when
every rank can, else from storage. Then each rank that needs its holder's copy receives
it, the others use their own.

Limits. The copies live in the processes: a full restart (every process new) loses
them all, and ``load`` falls back to storage. The case this serves is one rank (or one
failure domain) replaced while its holder keeps running and keeps its copy: the
launcher's in-process restart (``--restart in-process``, producers/launcher/hot.py),
where the survivors keep their processes, this replica among what outlives the attempt
(:meth:`rejoin`), and a warm spare takes the failed rank. A copy newer than storage has
not been through the validator (its digest protects the transfer and the time it sat in
memory, not against a corrupted state); the step's ``REJECTED`` marker, when it exists,
does exclude it. If a holder dies in the middle of an exchange, its partner's exchange
raises after the group's timeout and that partner's held copy is dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PeerCopy",
    "PeerReplica",
    "agree_restore",
    "holder_of",
    "load_into",
    "pack",
    "source_of",
    "unpack",
]

log = logging.getLogger(__name__)

_ALIGN = 64
_HEADER = 8  # int64 length of the pickled skeleton at the start of a blob
_VIEW_MIN = 1 << 20  # smaller tensors are always copied out of a blob (``unpack``)


def _shift(world_size: int, shift: int | None) -> int:
    k = (world_size + 1) // 2 if shift is None else shift
    if world_size > 1 and k % world_size == 0:
        raise ValueError(f"shift {k} maps every rank onto itself (world size {world_size})")
    return k


def holder_of(rank: int, world_size: int, shift: int | None = None) -> int:
    """The rank holding ``rank``'s copy: ``(rank + ceil(W/2)) % W`` (``r + W/2`` for even W)."""
    return (rank + _shift(world_size, shift)) % world_size


def source_of(rank: int, world_size: int, shift: int | None = None) -> int:
    """The rank whose copy ``rank`` holds."""
    return (rank - _shift(world_size, shift)) % world_size


# ------------------------------------------------------------------ packing


@dataclass(frozen=True)
class _Ref:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dtensor: bool


def _local(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if type(t) is torch.Tensor:
        return t.detach(), False
    to_local = getattr(t, "to_local", None)  # DTensor: its shard is what this rank holds
    if to_local is not None:
        return to_local().detach(), True
    return t.detach().as_subclass(torch.Tensor), False


def pack(state: Any, spare: torch.Tensor | None = None) -> torch.Tensor:
    """One flat uint8 tensor holding ``state``: skeleton length, pickled skeleton, tensor bytes.

    ``spare`` (a previous blob of the same size) is refilled instead of allocating.
    """
    tensors: list[tuple[torch.Tensor, int]] = []
    cursor = 0

    def walk(obj: Any) -> Any:
        nonlocal cursor
        if isinstance(obj, torch.Tensor):
            local, is_dt = _local(obj)
            local = local.cpu()
            nbytes = local.numel() * local.element_size()
            ref = _Ref(cursor, nbytes, local.dtype, tuple(local.shape), is_dt)
            tensors.append((local, cursor))
            cursor += -(-nbytes // _ALIGN) * _ALIGN
            return ref
        if isinstance(obj, dict):
            return {key: walk(value) for key, value in obj.items()}
        if type(obj) is list:
            return [walk(value) for value in obj]
        if type(obj) is tuple:
            return tuple(walk(value) for value in obj)
        return obj

    skeleton = pickle.dumps(walk(state), protocol=pickle.HIGHEST_PROTOCOL)
    start = -(-(_HEADER + len(skeleton)) // _ALIGN) * _ALIGN
    total = start + cursor
    blob = spare if spare is not None and spare.numel() == total else torch.empty(total, dtype=torch.uint8)
    blob[:_HEADER] = torch.tensor([len(skeleton)], dtype=torch.int64).view(torch.uint8)
    blob[_HEADER : _HEADER + len(skeleton)] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    for tensor, offset in tensors:
        if tensor.numel():
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            blob[start + offset : start + offset + flat.numel()].copy_(flat)
    return blob


def unpack(blob: torch.Tensor, *, copy: bool = True) -> Any:
    """The state packed in ``blob``: fresh tensors, or (``copy=False``) views on ``blob``.

    Views are only safe on a blob nobody reuses: ``Optimizer.load_state_dict`` keeps the
    tensors it is given (same dtype and device), so views would alias the optimizer state.
    Tensors under ``_VIEW_MIN`` bytes are copied anyway: ``torch.set_rng_state`` given a
    view at a storage offset crashed the process (SIGSEGV, torch 2.15 CPU).
    """
    length = int(blob[:_HEADER].view(torch.int64).item())
    skeleton = pickle.loads(blob[_HEADER : _HEADER + length].numpy().tobytes())
    start = -(-(_HEADER + length) // _ALIGN) * _ALIGN

    def build(obj: Any) -> Any:
        if isinstance(obj, _Ref):
            raw = blob[start + obj.offset : start + obj.offset + obj.nbytes]
            if not obj.nbytes:
                tensor = torch.empty(obj.shape, dtype=obj.dtype)
            else:
                tensor = raw.view(obj.dtype).reshape(obj.shape)
                tensor = tensor.clone() if copy or obj.nbytes < _VIEW_MIN else tensor
            return _DTensorShard(tensor) if obj.dtensor else tensor
        if isinstance(obj, dict):
            return {key: build(value) for key, value in obj.items()}
        if type(obj) is list:
            return [build(value) for value in obj]
        if type(obj) is tuple:
            return tuple(build(value) for value in obj)
        return obj

    return build(skeleton)


class _DTensorShard:
    """A packed DTensor's local shard, to be rebuilt on the live state's mesh (``rebuild_dtensors``)."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local


def rebuild_dtensors(restored: Any, live: Any) -> Any:
    """Turn the shards of ``restored`` back into DTensors placed like the ``live`` state's."""
    if isinstance(restored, _DTensorShard):
        from torch.distributed.tensor import DTensor

        if not isinstance(live, DTensor):
            raise ValueError("a DTensor shard where the live state has no DTensor")
        return DTensor.from_local(
            restored.local.to(live.device),
            live.device_mesh,
            live.placements,
            shape=live.shape,
            stride=live.stride(),
        )
    if isinstance(restored, dict):
        other = live if isinstance(live, dict) else {}
        return {key: rebuild_dtensors(value, other.get(key)) for key, value in restored.items()}
    if type(restored) in (list, tuple):
        others = (
            live if isinstance(live, list | tuple) and len(live) == len(restored) else [None] * len(restored)
        )
        items = [rebuild_dtensors(v, o) for v, o in zip(restored, others, strict=True)]
        return items if type(restored) is list else tuple(items)
    return restored


def _has_shards(obj: Any) -> bool:
    if isinstance(obj, _DTensorShard):
        return True
    if isinstance(obj, dict):
        return any(_has_shards(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_shards(v) for v in obj)
    return False


# ----------------------------------------------------------------- the copies


@dataclass
class PeerCopy:
    """One rank's packed snapshot at one step, as held in host memory."""

    run_id: str
    rank: int
    world_size: int
    step: int
    digest: str
    blob: torch.Tensor

    def meta(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "digest": self.digest,
        }

    def verify(self) -> str | None:
        """None when the bytes still match the sender's digest, else why not."""
        digest = hashlib.sha256(self.blob.numpy().data).hexdigest()
        if digest != self.digest:
            return f"peer copy of rank {self.rank} step {self.step}: digest mismatch"
        return None


Steps = int | None | Sequence[int]


def _steps(value: Steps) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(value)


def agree_restore(
    own: Sequence[Steps],
    held: Sequence[Steps],
    storage_step: int | None,
    *,
    holder: Callable[[int], int],
    rejected: Callable[[int], bool] = lambda step: False,
) -> tuple[int | None, str]:
    """Which step every rank restores, and from where: ``(step, "memory" | "storage" | "none")``.

    ``own[j]``: the step(s) of rank j's own copies; ``held[j]``: of the copies rank j
    holds (of its source); ``storage_step``: the newest validated checkpoint. Rank j can
    restore ``s`` from memory if it has its own copy of ``s`` or its holder has one; the
    memory step is the newest every rank can restore, not ``rejected``, and wins when it
    is at least as new as storage's.
    """
    world = len(own)
    owns, helds = [_steps(o) for o in own], [_steps(h) for h in held]
    candidates = sorted(set().union(*owns, *helds), reverse=True)
    for s in candidates:
        if storage_step is not None and s < storage_step:
            break
        if rejected(s):
            continue
        if all(s in owns[j] or s in helds[holder(j)] for j in range(world)):
            return s, "memory"
    if storage_step is not None:
        return storage_step, "storage"
    return None, "none"


class PeerReplica:
    """This rank's own copy and its source's copy, exchanged on a dedicated gloo group."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        run_id: str = "",
        process_group: dist.ProcessGroup | None = None,
        shift: int | None = None,
        timeout: timedelta = timedelta(minutes=5),
        max_queued: int = 1,
    ) -> None:
        if world_size < 2:
            raise ValueError("a peer replica needs at least 2 ranks")
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.shift = _shift(world_size, shift)
        self.holder = holder_of(rank, world_size, self.shift)
        self.source = source_of(rank, world_size, self.shift)
        self._own_group = process_group is None
        self._timeout = timeout
        if process_group is None:
            group = dist.new_group(backend="gloo", timeout=timeout)
            assert isinstance(group, dist.ProcessGroup)
            process_group = group
        self._group: dist.ProcessGroup | None = process_group
        self.own: PeerCopy | None = None
        self.held: PeerCopy | None = None
        #: The copies of the save before (a restore names the newest *validated* step,
        #: and the newest save may not be validated yet when a rank fails).
        self.own_older: PeerCopy | None = None
        self.held_older: PeerCopy | None = None
        self._spare_own: torch.Tensor | None = None
        self._spare_held: torch.Tensor | None = None
        self._slots = threading.Semaphore(max(1, max_queued) + 1)  # queued + the one running
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"peer-replica-{rank}")
        self._closed = False
        self.exchange_s: list[float] = []

    # ------------------------------------------------------------ exchange

    def push(self, step: int, state: Any, on_done: Callable[[], None] | None = None) -> Future[None]:
        """Pack ``state`` (a staged snapshot), keep it, send it to the holder, receive the source's.

        Returns at once (blocks only when ``max_queued`` pushes wait); ``on_done`` runs
        once ``state`` is no longer read. Every rank must push the same steps in order.
        """
        if self._closed:
            raise RuntimeError("peer replica is closed")
        self._slots.acquire()
        return self._io.submit(self._exchange, step, state, on_done)

    def _exchange(self, step: int, state: Any, on_done: Callable[[], None] | None) -> None:
        t0 = time.perf_counter()
        try:
            try:
                blob = pack(state, self._spare_own)
            finally:
                if on_done is not None:
                    on_done()
            mine = PeerCopy(
                self.run_id,
                self.rank,
                self.world_size,
                step,
                hashlib.sha256(blob.numpy().data).hexdigest(),
                blob,
            )
            oldest, self.own_older, self.own = self.own_older, self.own, mine
            self._spare_own = oldest.blob if oldest is not None else None
            try:
                received = self._swap(mine, self.holder, self.source, self._spare_held)
            except Exception:  # the older held copy, if any, is still a valid copy of that step
                log.exception(
                    "peer replica exchange of step %d with ranks %d/%d failed", step, self.holder, self.source
                )
                return
            oldest, self.held_older, self.held = self.held_older, self.held, received
            self._spare_held = oldest.blob if oldest is not None else None
            self.exchange_s.append(time.perf_counter() - t0)
        finally:
            self._slots.release()

    def _swap(
        self, outgoing: PeerCopy | None, to: int | None, frm: int | None, spare: torch.Tensor | None
    ) -> PeerCopy | None:
        """Send ``outgoing`` to rank ``to`` and receive a copy from ``frm`` (either may be None)."""
        assert self._group is not None
        works = []
        out_meta = out_sizes = None
        if to is not None:
            assert outgoing is not None
            out_meta = torch.frombuffer(bytearray(pickle.dumps(outgoing.meta())), dtype=torch.uint8)
            out_sizes = torch.tensor([out_meta.numel(), outgoing.blob.numel()], dtype=torch.int64)
            works.append(dist.isend(out_sizes, to, group=self._group, tag=1))
        sizes = torch.zeros(2, dtype=torch.int64)
        if frm is not None:
            works.append(dist.irecv(sizes, frm, group=self._group, tag=1))
        for work in works:
            assert work is not None  # point-to-point ops return a Work
            work.wait()
        works = []
        if to is not None:
            assert outgoing is not None and out_meta is not None
            works.append(dist.isend(out_meta, to, group=self._group, tag=2))
            works.append(dist.isend(outgoing.blob, to, group=self._group, tag=3))
        meta_buf = blob = None
        if frm is not None:
            meta_len, blob_len = (int(v) for v in sizes.tolist())
            meta_buf = torch.empty(meta_len, dtype=torch.uint8)
            blob = (
                spare
                if spare is not None and spare.numel() == blob_len
                else torch.empty(blob_len, dtype=torch.uint8)
            )
            works.append(dist.irecv(meta_buf, frm, group=self._group, tag=2))
            works.append(dist.irecv(blob, frm, group=self._group, tag=3))
        for work in works:
            assert work is not None  # point-to-point ops return a Work
            work.wait()
        if frm is None:
            return None
        assert meta_buf is not None and blob is not None
        meta = pickle.loads(meta_buf.numpy().tobytes())
        return PeerCopy(blob=blob, **meta)

    def wait(self) -> None:
        """Until every queued push is exchanged."""
        self._io.submit(lambda: None).result()

    def steps(self) -> tuple[int | None, int | None]:
        """``(own step, held step)`` once the queued pushes are done."""
        self.wait()
        return (
            self.own.step if self.own is not None else None,
            self.held.step if self.held is not None else None,
        )

    def rejoin(self, timeout_s: float = 30.0) -> bool:
        """In-process restart (producers/training/inprocess.py): this process outlived its
        attempt, and its copies are what it restores. Once the ended attempt's exchange is
        over (it fails at once when a peer is gone), exchange on a new group of the new
        default one; False, with no group made, when that exchange is still stuck."""
        if not self._settled(timeout_s):
            return False
        self._new_group()
        return True

    def rebind(self, rank: int, world_size: int, timeout_s: float = 30.0) -> bool:
        """Elastic training (producers/training/elastic.py): this process goes on as rank
        `rank` of a world of `world_size`, and the state it copies is the same on every
        rank (TrainState ``per_rank=False``), so its own copies are still its own under the
        new rank; the copies it held are dropped (their source is another rank now). Then
        as :meth:`rejoin`. False, nothing changed, when the ended attempt's exchange is
        stuck or the new world has no peer to hold a copy."""
        if world_size < 2 or not self._settled(timeout_s):
            return False
        self.rank, self.world_size, self.shift = rank, world_size, _shift(world_size, None)
        self.holder = holder_of(rank, world_size, self.shift)
        self.source = source_of(rank, world_size, self.shift)
        for copy in (self.own, self.own_older):
            if copy is not None:
                copy.rank, copy.world_size = rank, world_size
        self.held = self.held_older = self._spare_held = None
        self._new_group()
        return True

    def _settled(self, timeout_s: float) -> bool:
        """Until the ended attempt's exchange is over; False when it is still stuck."""
        try:
            self._io.submit(lambda: None).result(timeout=timeout_s)
        except TimeoutError:
            log.error("peer replica of rank %d: the ended attempt's exchange is stuck", self.rank)
            return False
        return True

    def _new_group(self) -> None:
        """Exchange from now on in a new group of the new default one."""
        group = dist.new_group(backend="gloo", timeout=self._timeout)
        assert isinstance(group, dist.ProcessGroup)  # this rank is a member
        self._group, self._own_group = group, True

    def all_steps(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The steps of every own copy and every held copy, once the queued pushes are done."""
        self.wait()
        return (
            tuple(c.step for c in (self.own, self.own_older) if c is not None),
            tuple(c.step for c in (self.held, self.held_older) if c is not None),
        )

    def drop(self) -> None:
        """Forget every copy (what a replaced process has: nothing)."""
        self.wait()
        self.own = self.held = self.own_older = self.held_older = self._spare_own = self._spare_held = None

    # ------------------------------------------------------------- restore

    def fetch(self, step: int, needs_peer: Sequence[bool], *, verify: bool = True) -> Any:
        """This rank's state at ``step``: its own copy, or (``needs_peer[rank]``) its holder's.

        Collective over the group: a holder whose source needs its copy sends it. Returns
        the unpacked state dict, ready for ``load_state_dict`` (:func:`load_into`);
        raises ``ValueError`` if the copy is not this rank's at ``step`` or fails its digest.
        """
        return self._io.submit(self._fetch, step, list(needs_peer), verify).result()

    def _fetch(self, step: int, needs_peer: list[bool], verify: bool) -> Any:
        send = needs_peer[self.source]
        held = next((c for c in (self.held, self.held_older) if c is not None and c.step == step), None)
        if send and held is None:
            raise ValueError(f"rank {self.rank} holds no copy of rank {self.source} at step {step}")
        copy = self._swap(
            held if send else None,
            self.source if send else None,
            self.holder if needs_peer[self.rank] else None,
            None,
        )
        mine = False
        if not needs_peer[self.rank]:
            copy = next((c for c in (self.own, self.own_older) if c is not None and c.step == step), None)
            mine = True
        if copy is None:
            raise ValueError(f"rank {self.rank} has no copy of its own state at step {step}")
        expected = (self.run_id, self.rank, self.world_size, step)
        got = (copy.run_id, copy.rank, copy.world_size, copy.step)
        if got != expected:
            raise ValueError(f"peer copy is (run, rank, world, step) = {got}, expected {expected}")
        if verify and (reason := copy.verify()):
            raise ValueError(reason)
        # a received blob is referenced by nothing else: restore from views on it (no copy)
        return unpack(copy.blob, copy=mine)

    def close(self, wait: bool = True) -> None:
        """Release the copies and the group; ``wait=False`` leaves an exchange stuck on a
        lost peer behind (in-process restart) instead of waiting for it."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=wait, cancel_futures=not wait)
        self.own = self.held = self.own_older = self.held_older = self._spare_own = self._spare_held = None
        if self._own_group and self._group is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # destroyed with its attempt's default group
                dist.destroy_process_group(self._group)
        self._group = None


def load_into(state: Any, restored: Any) -> None:
    """``state.load_state_dict(restored)``, rebuilding DTensor shards on ``state``'s mesh first."""
    if _has_shards(restored):
        restored = rebuild_dtensors(restored, state.state_dict())
    state.load_state_dict(restored)
