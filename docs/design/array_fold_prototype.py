"""Sizing the array fold (docs/design/array_fold.md): the per-row effects of a quiet step
timing (processors/core/folds/block.py) done as array operations on array state, over folds of
20 to 10,000 rows. NOT the core's fold: the checks are simplified and every row is taken
as quiet; it only measures what such a fold costs a row as the number of rows folded at
once grows.

    .venv/bin/python docs/design/array_fold_prototype.py
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

RANKS = 16_384
WINDOW = 200_000
rng = np.random.default_rng(0)


class Pending:
    """A step's buffers, as the straggler detector keeps them."""

    def __init__(self) -> None:
        self.values = np.full(RANKS, np.nan)
        self.stamps = np.zeros(RANKS)
        self.seen = np.zeros(RANKS, np.int8)
        self.ids = np.empty(RANKS, object)
        self.count, self.need = 0, RANKS


Poll = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]


def make_poll(n: int, first_step: int) -> Poll:
    """n rows: ranks reporting three consecutive steps."""
    k = -(-n // 3)
    ranks = np.resize(np.arange(k) % RANKS, n).astype(np.int64)
    steps = np.repeat(np.arange(3) + first_step, k)[:n].astype(np.int64)
    ts = 1000.0 + steps * 2.0 + rng.random(n)
    compute = rng.random(n)
    ids = [f"sim-{s}-{r}" for s, r in zip(steps.tolist(), ranks.tolist(), strict=True)]
    return ranks, steps, ts, compute, compute + 0.5, ids


def fold(state: dict[str, Any], poll: Poll) -> bool:
    ranks, steps, ts, compute, total, ids = poll
    seen: OrderedDict[str, None] = state["seen"]
    n = len(ids)
    quiet = bool(
        seen.keys().isdisjoint(ids)
        and len(set(ids)) == n
        and ranks.min() >= 0
        and ranks.max() < RANKS
        and state["known"][ranks].all()
    )
    unique, counts = np.unique(steps, return_counts=True)
    masks = {s: steps == s for s in unique.tolist()}
    for s, c in zip(unique.tolist(), counts.tolist(), strict=True):
        pending = state["pending"][s]
        quiet = quiet and not pending.seen[ranks[masks[s]]].any() and pending.need - c > 0
    running = np.maximum.accumulate(ts)
    moves = np.flatnonzero(np.diff(running, prepend=state["clock"]) > 0)
    seen.update(dict.fromkeys(ids))
    for _ in range(len(seen) - WINDOW):
        seen.popitem(last=False)
    state["first"], state["last"] = min(state["first"], float(ts.min())), max(state["last"], float(ts.max()))
    for clock in running[moves].tolist():  # the goodput clock through the running maxima, in order
        state["clock"] = clock
    np.maximum.at(state["last_seen"], ranks, ts)
    np.maximum.at(state["last_step"], ranks, steps)
    np.maximum.at(state["progress"], ranks, ts)
    _, from_end = np.unique(ranks[::-1], return_index=True)
    last = n - 1 - from_end  # each rank's last row: its times win
    state["compute"][ranks[last]], state["total"][ranks[last]] = compute[last], total[last]
    id_array = np.array(ids, dtype=object)
    for s, mask in masks.items():
        pending, rows = state["pending"][s], ranks[mask]
        pending.values[rows], pending.stamps[rows], pending.seen[rows] = compute[mask], ts[mask], 1
        pending.ids[rows] = id_array[mask]
        reported = int(mask.sum())
        pending.count += reported
        pending.need -= reported
    return quiet


def fresh() -> dict[str, Any]:
    return {
        "seen": OrderedDict(), "known": np.ones(RANKS, bool), "pending": {s: Pending() for s in range(300)},
        "clock": 0.0, "first": float("inf"), "last": 0.0, "last_seen": np.zeros(RANKS),
        "last_step": np.full(RANKS, -1), "progress": np.zeros(RANKS), "compute": np.zeros(RANKS),
        "total": np.zeros(RANKS),
    }  # fmt: skip


def main() -> None:
    for n in (20, 200, 2_000, 10_000):
        polls = [make_poll(n, 3 * (i % 100)) for i in range(max(1, 200_000 // n))]
        state = fresh()
        t0 = time.perf_counter()
        for poll in polls:
            fold(state, poll)
        seconds = time.perf_counter() - t0
        print(f"{n:6,d} rows a fold: {seconds / (len(polls) * n) * 1e6:.2f} us a row")


if __name__ == "__main__":
    main()
