"""What one checkpoint holds for a rank: model, optimizer, RNG states and data position.

:class:`TrainState` is a :class:`~torch.distributed.checkpoint.stateful.Stateful`: its
``state_dict()`` returns live references (model parameters and optimizer state, through
``torch.distributed.checkpoint.state_dict.get_state_dict``, so plain, DDP and FSDP models
all work), and ``load_state_dict()`` puts a loaded one back. Everything a resumed run
needs to continue *bitwise* identically sits in that one dictionary, so it is written in
one atomic checkpoint (seed §4: weights and data position in separate writes repeat data
silently after a crash between them).

Layout (flattened by DCP to ``app.model.<fqn>``, ``app.rank3.rng.torch`` ...)::

    {"model": ..., "optim": ..., "rank<r>": {"rng": ..., "sampler": ..., "extra": ...}}

Model and optimizer are keyed by name and deduplicated across ranks by DCP; the RNG
states, the sampler position and ``extra`` differ per rank, so they sit under the rank's
own key (a shared key would be written by one rank only and the others' states lost).
An elastic job's state (``per_rank=False``, producers/training/elastic.py) is the same on
every rank, so it sits under ``job`` instead, with no RNG states, and loads at any world
size.

Buffers (BatchNorm's running statistics) are not replicated like parameters: every rank
updates its own copy in its forward, so the ranks' copies differ, and DCP's deduplication
would store an arbitrary rank's copy of each. Which copy the job uses decides where they
go (:func:`buffer_layout`, said in the checkpoint's manifest):

* ``rank0``: DDP broadcasts its group's rank-0 buffers at every forward
  (``broadcast_buffers``, its default), so the job's copy is that rank's: only it saves
  them under ``model`` and every rank loads that copy back (the others' own copies are
  overwritten at the next forward anyway, so they need not be kept);
* ``per-rank``: nothing synchronises them (no DDP, ``broadcast_buffers=False``, FSDP):
  each rank's own copy matters, so each saves and loads its own under ``rank<r>.buffers``;
* ``model``: checkpoints written before buffers had a layout (DCP's arbitrary copy),
  still loadable.

Two pitfalls the training loop must respect (docs in /work/shared/NOTES.md):

* ``iter(DataLoader)`` draws a base seed from the global torch RNG, even with
  ``num_workers=0``. Create the iterator *before* ``load`` restores the RNG, or give the
  loader its own ``torch.Generator`` and put it in ``extra`` (generators are saved).
* :class:`ResumableSampler` counts what it *yielded*. With ``num_workers > 0`` the loader
  prefetches, so the position runs ahead of what was trained; use ``num_workers=0`` or a
  loader whose own state is checkpointed (torchdata's ``StatefulDataLoader`` in ``extra``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.utils.data import Sampler

from ...common.moved import deprecate_names

__all__ = ["BufferLayout", "ResumableSampler", "TrainState", "buffer_layout", "capture_rng", "restore_rng"]

#: Where a checkpoint keeps the model's buffers (module docstring).
BufferLayout = Literal["rank0", "per-rank", "model"]


class ResumableSampler(Sampler[int]):
    """A deterministic, resumable, rank-strided sampler.

    Epoch ``e`` visits ``randperm(num_samples, seed + e)`` (or ``range`` unshuffled); rank
    ``r`` of ``W`` takes every ``W``-th index starting at ``r`` (the tail is padded by
    wrapping so all ranks yield the same count, as ``DistributedSampler`` does). The state
    is ``(epoch, position)``: ``position`` counts the indices this rank has yielded in the
    epoch, so a sampler restored from ``state_dict()`` continues with exactly the next
    index, repeating and skipping none. When an epoch is exhausted the epoch advances.
    """

    def __init__(
        self, num_samples: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True
    ) -> None:
        if num_samples <= 0:
            raise ValueError("num_samples must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Indices per rank per epoch."""
        return -(-self.num_samples // self.world_size)

    def _order(self, epoch: int, rank: int | None = None) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = len(self) * self.world_size
        order += order[: total - len(order)]
        return order[self.rank if rank is None else rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        mine = self._order(self.epoch)
        while self.position < len(mine):
            index = mine[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def indices(self, rank: int, start: int, count: int) -> list[int]:
        """Indices ``start .. start + count - 1`` of what rank `rank` yields, epoch after
        epoch from epoch 0, position 0: ANY rank's batch, whatever this sampler's own state
        (a loop drawing `b` indices per step from step 0 trains rank r at step s on
        ``indices(r, s * b, b)``; the ring cross-rank check's ``batch_fn``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        per_epoch = len(self)
        out: list[int] = []
        epoch, position = divmod(start, per_epoch)
        while len(out) < count:
            theirs = self._order(epoch, rank)
            out += theirs[position : position + count - len(out)]
            epoch, position = epoch + 1, 0
        return out

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch = epoch
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_samples", "world_size", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler {key} changed: checkpoint {state[key]!r}, now {getattr(self, key)!r}"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def capture_rng() -> dict[str, Any]:
    """The global RNG states: torch CPU (and CUDA when present), numpy, python ``random``."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def buffer_layout(module: nn.Module) -> tuple[BufferLayout, int]:
    """Where `module`'s buffers are saved from, and the global rank whose copy the job
    uses (rank0) or -1 (per-rank). Pass the *wrapped* model (DDP, not its ``.module``)."""
    ddp = module if isinstance(module, nn.parallel.DistributedDataParallel) else None
    if ddp is None or not ddp.broadcast_buffers:
        return "per-rank", -1
    group = ddp.process_group
    owner = dist.get_global_rank(group, 0) if dist.is_initialized() and group is not None else 0
    return "rank0", owner


def buffer_keys(module: nn.Module, model_sd: dict[str, Any]) -> set[str]:
    """The keys of `model_sd` (``get_state_dict``'s: wrapper prefixes removed) that hold
    buffers; non-persistent buffers are not in it."""
    found: set[str] = set()
    for name, _ in module.named_buffers():
        found |= set(_get_fqns(module, name))
    return found & model_sd.keys()


def _extra_state(value: Any) -> Any:
    if isinstance(value, torch.Generator):
        return value.get_state()
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return value.state_dict()
    return value


class TrainState:
    """Model, optimizer, RNG states, sampler position and ``extra`` of one rank (Stateful).

    ``extra`` maps names to picklable values (restored into the dict), ``torch.Generator``
    objects (their state is saved), or objects with ``state_dict``/``load_state_dict``
    (a ``StatefulDataLoader``, an LR scheduler), restored in place.

    ``buffers`` says where the model's buffers are saved from (module docstring); by
    default from the model given (:func:`buffer_layout`); a framework whose model is not
    the DDP wrapper passes the wrapper's. :meth:`state_dict` is what a load fills in;
    :meth:`saved_state_dict` what a save writes.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ResumableSampler | Any | None = None,
        extra: dict[str, Any] | None = None,
        *,
        rank: int | None = None,
        buffers: tuple[BufferLayout, int] | None = None,
        per_rank: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.extra: dict[str, Any] = extra if extra is not None else {}
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        #: Where this run's checkpoints keep the buffers, and the rank whose copy (rank0).
        self.buffers, self.buffer_owner = buffers if buffers is not None else buffer_layout(model)
        #: False: an elastic job's state (producers/training/elastic.py), the same on every
        #: rank and loadable at any world size: no per-rank section, no RNG states (its
        #: randomness is seeded per shard and step); the sampler and ``extra`` under "job".
        self.per_rank = per_rank
        if not per_rank and self.buffers == "per-rank":
            self.buffers, self.buffer_owner = "model", -1  # no rank's section to keep them in
        #: The layout of the checkpoint being loaded (its manifest's; CheckpointManager sets it).
        self.load_layout: BufferLayout = self.buffers

    @property
    def rank_key(self) -> str:
        """Where this rank's own state sits: ``rank<r>``, or ``job`` (not per rank)."""
        return f"rank{self.rank}" if self.per_rank else "job"

    def manifest(self) -> dict[str, Any]:
        """What a checkpoint's manifest says of this state's layout."""
        return {"buffers": self.buffers, "buffer_rank": self.buffer_owner}

    def state_dict(self) -> dict[str, Any]:
        """The state as a load of a `load_layout` checkpoint fills it in."""
        return self._state(self.load_layout, saving=False)

    def saved_state_dict(self) -> dict[str, Any]:
        """The state as this rank writes it (a rank0 layout: only the owner's buffers)."""
        return self._state(self.buffers, saving=True)

    def _state(self, layout: BufferLayout, saving: bool) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        own: dict[str, Any] = {"extra": {name: _extra_state(value) for name, value in self.extra.items()}}
        if self.per_rank:
            own["rng"] = capture_rng()
        if self.sampler is not None:
            own["sampler"] = self.sampler.state_dict()
        if layout == "per-rank":
            own["buffers"] = {key: model_sd.pop(key) for key in buffer_keys(self.model, model_sd)}
        elif layout == "rank0" and saving and self.rank != self.buffer_owner:
            for key in buffer_keys(self.model, model_sd):
                del model_sd[key]
        return {"model": model_sd, "optim": optim_sd, self.rank_key: own}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put a loaded state back: a whole one (`state_dict`'s shape), or this rank's own
        snapshot from host memory (`saved_state_dict`'s: under rank0, a non-owner's lacks
        the buffers, which keep their live values until DDP's next broadcast)."""
        own = state_dict[self.rank_key]
        model_sd = {**state_dict["model"], **own.get("buffers", {})}
        if self.buffers == "rank0" and self.rank != self.buffer_owner:
            live = get_model_state_dict(self.model)  # the buffers' live values: no optimizer state
            for key in buffer_keys(self.model, live) - model_sd.keys():
                model_sd[key] = live[key]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=state_dict["optim"],
        )
        if self.sampler is not None:
            self.sampler.load_state_dict(own["sampler"])
        for name, saved in own["extra"].items():
            current: Any = self.extra.get(name)
            if isinstance(current, torch.Generator):
                current.set_state(saved)
            elif hasattr(current, "load_state_dict"):
                current.load_state_dict(saved)
            else:
                self.extra[name] = saved
        if "rng" in own:
            restore_rng(own["rng"])  # last: nothing after it may draw


# A script's old path keeps working for a while, with a warning naming the public one.
deprecate_names(__name__, "trainguard.torch", ("TrainState", "ResumableSampler"))
