"""Elastic training, the rank's side (issue 45; seed §9.4): the same job at any world size.

When capacity is lost and no spare is left, trainguard can go on with the survivors in a
smaller world, in their processes, and grow back at a checkpoint boundary once capacity
returns (producers/launcher/hot.py, docs/elastic.md). For that to change nothing but the
speed, the job's data and its randomness must not depend on the world size:

* **The global batch is fixed.** It is cut into ``shards`` micro-batches (the launcher's
  full world size by default, ``TRAINGUARD_ELASTIC_SHARDS``), and rank ``r`` of a world of
  ``W`` trains shards ``r, r + W, r + 2W, ...``: at full size one each, in a smaller world
  more (a larger per-rank batch), so every optimizer step sees the same samples. Each
  shard's loss is weighted ``W / shards`` (:meth:`ElasticBatches.weight`): DDP averages
  the ranks' gradients over ``W``, so the update is the mean over the shards whatever
  ``W`` is, even when ``W`` does not divide ``shards`` (then the ranks' loads differ by one
  shard: a step takes ``ceil(shards / W)`` shard-times).
* **The data order is the step's.** Step ``s`` takes samples ``s * batch .. (s + 1) *
  batch - 1`` of its epoch's permutation (seeded by ``seed + epoch``; the epoch's last
  partial batch is dropped), so every sample of an epoch is trained exactly once across
  any number of resizes, and nothing of it is per-rank state to checkpoint.
* **Randomness is the shard's.** :meth:`ElasticBatches.rng` seeds torch's RNG from (seed,
  step, shard) around a shard's forward: its dropout masks are the same whichever rank, in
  whichever world, trains it. The learning-rate schedule counts steps, unchanged.

So a run that shrank and grew ends within floating-point tolerance (the order in which
the shards' gradients are summed differs) of one that never did, and bitwise equal to
another run that resized at the same steps. The checkpoint holds no per-rank section
(``TrainState(..., per_rank=False)``), so it loads at any world size.

A loop::

    data = ElasticBatches(len(dataset), global_batch=64, seed=3)
    for step in range(start, steps):
        with sup.step(step) as s:
            loss = 0.0
            for shard, batch in data.mine(step, rank, world):
                with data.rng(step, shard):
                    loss = loss + data.weight(world) * loss_of(batch)
            loss.backward()
            ...
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ...common.moved import deprecate_names

__all__ = ["ENV_SHARDS", "ElasticBatches", "shards_from_env"]

#: The number of data shards (micro-batches) of the global batch: the launcher's full
#: world size (``--nproc``, or ``MAX`` x ranks per host across hosts).
ENV_SHARDS = "TRAINGUARD_ELASTIC_SHARDS"


def shards_from_env(env: Mapping[str, str] | None = None) -> int:
    """The job's shard count: ``TRAINGUARD_ELASTIC_SHARDS``, else ``WORLD_SIZE``, else 1."""
    env = os.environ if env is None else env
    return int(env.get(ENV_SHARDS) or env.get("WORLD_SIZE") or 1)


class ElasticBatches:
    """A fixed global batch of ``shards`` micro-batches, the same at any world size
    (module docstring)."""

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        shards: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        shards = shards_from_env() if shards is None else shards
        if shards < 1 or global_batch % shards:
            raise ValueError(f"global_batch {global_batch} must be a positive multiple of shards {shards}")
        if num_samples < global_batch:
            raise ValueError(f"{num_samples} samples hold no global batch of {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.shards = shards
        self.seed = seed
        self.shuffle = shuffle
        self._epoch: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @property
    def shard_size(self) -> int:
        return self.global_batch // self.shards

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _order(self, epoch: int) -> list[int]:
        if self._epoch is None or self._epoch[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                order = list(range(self.num_samples))
            self._epoch = (epoch, order)
        return self._epoch[1]

    def shard(self, step: int, shard: int) -> list[int]:
        """The sample indices of micro-batch `shard` at `step` (any rank's, any world's)."""
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} outside 0..{self.shards - 1}")
        if step < 0:
            raise ValueError(f"step {step} is negative")
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch + shard * self.shard_size
        return self._order(epoch)[start : start + self.shard_size]

    def shards_of(self, rank: int, world: int) -> range:
        """The shards rank `rank` of a world of `world` trains: ``rank, rank + world, ...``."""
        if not 0 <= rank < world <= self.shards:
            raise ValueError(f"rank {rank} of world {world} with {self.shards} shards")
        return range(rank, self.shards, world)

    def mine(self, step: int, rank: int, world: int) -> list[tuple[int, list[int]]]:
        """(shard, its indices) for each shard this rank trains at `step`."""
        return [(s, self.shard(step, s)) for s in self.shards_of(rank, world)]

    def weight(self, world: int) -> float:
        """Each shard's loss weight: DDP divides the summed gradient by `world`, so the
        update is the mean over all shards at any world size."""
        return world / self.shards

    @contextlib.contextmanager
    def rng(self, step: int, shard: int) -> Iterator[None]:
        """Torch's CPU (and CUDA) RNG seeded for (step, shard) inside, restored after: the
        shard's dropout masks do not depend on who trains it."""
        digest = hashlib.blake2b(f"{self.seed}/{step}/{shard}".encode(), digest_size=8).digest()
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            yield

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records: the configuration only (the position is the step)."""
        keys = ("num_samples", "global_batch", "shards", "seed", "shuffle")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            now = getattr(self, key, value)
            if now != value:
                raise ValueError(f"elastic data {key} changed: checkpoint {value!r}, now {now!r}")


# A script's old path keeps working for a while, with a warning naming the public one.
deprecate_names(__name__, "trainguard.torch", ("ElasticBatches", "shards_from_env"))
