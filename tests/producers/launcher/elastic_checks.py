"""The elastic tests' checks (issue 45) on what docs/examples/train_elastic.py leaves: which
samples each step's update was made of (TRAIN_SAMPLES_FILE), and the final weights."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any


def trained(path: Path) -> dict[int, list[int]]:
    """step -> the sample ids of its update: the last attempt that trained the step (an
    attempt resumed from a checkpoint redoes the steps after it), every rank's shards."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    last: dict[int, int] = {}
    for row in rows:
        last[row["s"]] = max(last.get(row["s"], -1), row["a"])
    ids: dict[int, list[int]] = collections.defaultdict(list)
    for row in rows:
        if row["a"] == last[row["s"]]:
            ids[row["s"]] += row["ids"]
    return ids


def assert_each_sample_once(steps: dict[int, list[int]], count: int, samples: int, batch: int) -> None:
    """Every one of `count` steps trained the same global batch of `batch` distinct samples,
    and every epoch (samples // batch steps) each of the `samples` samples exactly once."""
    assert sorted(steps) == list(range(count))
    for step, ids in steps.items():
        assert len(ids) == batch == len(set(ids)), step
    per_epoch = samples // batch
    for epoch in range(count // per_epoch):
        ids = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in steps[s]]
        assert sorted(ids) == list(range(samples)), epoch


def assert_like_clean(steps: dict[int, list[int]], clean: dict[int, list[int]]) -> None:
    """The same samples at every step as the uninterrupted run (in any rank order)."""
    assert {s: sorted(ids) for s, ids in steps.items()} == {s: sorted(ids) for s, ids in clean.items()}


def assert_weights(
    reference: dict[str, Any], first: dict[str, Any], second: dict[str, Any], atol: float
) -> None:
    """Two elastic runs that resized at the same steps: within `atol` of the uninterrupted
    run's weights (the shards' gradients summed in another order), bitwise equal to each other."""
    import torch

    for name, value in reference.items():
        assert torch.allclose(first[name], value, rtol=0, atol=atol), name
        assert torch.equal(first[name], second[name]), name  # the elastic path is deterministic
