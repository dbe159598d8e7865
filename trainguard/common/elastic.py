"""Wait for a replacement, or go on at a smaller world (issue 45; seed §9.4, "elastic
training": turn an interruption into a slowdown). The one rule, shared by the policy core
(processors/core/decisions/capacity.py), which decides it for every loss, and the launcher, which
applies it itself when the processor does not answer. Pure: it imports nothing.

When nodes are lost and no proven spare is ready to take their place, the job can

  wait    stay down until a replacement arrives (expected in `replacement_eta_s`), then
          restart at the full world W (`restart_s`); or
  shrink  go on with the survivors at once, at the largest allowed world W' < W
          (`shrink_s` to re-form it in their processes), with the same global batch: each
          rank does W/W' times the micro-batches, so a step takes W/W' as long and the
          learning-rate schedule and the data order do not change; once the replacement
          is there, grow back to W at the next checkpoint boundary (a planned stop,
          `grow_s`), after `boundary_s` more at W' (half a checkpoint interval, expected).

Each is priced in seconds of the full world's training lost until the full world trains
again (goodput's unit: a second at W' is W'/W of a second's work, f = W'/W):

  wait    = eta + restart_s
  shrink  = shrink_s + (1 - f)·max(0, eta - shrink_s) + (1 - f)·boundary_s + grow_s

The work re-done after the loss (back to the last checkpoint) is the same either way and
is left out. The smaller loss wins; a tie waits (one restart fewer to go wrong). With no
replacement expected (eta None) waiting never ends: shrink. With no allowed W' at or above
`min_world`: wait if a replacement is expected, else stop, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

Action = Literal["wait", "shrink", "stop"]


@dataclass(frozen=True, slots=True)
class ElasticChoice:
    """What to do about lost capacity, what each option was expected to lose, and why.

    `world_size` is the world the job trains at next: the full one for wait (once the
    replacement is in), W' for shrink, 0 for stop. `wait_loss_s` and `shrink_loss_s` are
    seconds of the full world's training lost until it trains again (inf: never;
    `shrink_loss_s` None: no smaller world allowed)."""

    action: Action
    world_size: int
    full_world: int
    survivors: int
    replacement_eta_s: float | None
    wait_loss_s: float
    shrink_loss_s: float | None
    reason: str

    @property
    def fraction(self) -> float:
        """The width the job trains at next, of the full world (0 when it stops)."""
        return self.world_size / self.full_world if self.full_world else 0.0

    @property
    def saving_s(self) -> float:
        """Full-world seconds shrinking saves over waiting (negative: it costs); 0 when
        one of them is not possible."""
        if self.shrink_loss_s is None or math.isinf(self.wait_loss_s):
            return 0.0
        return self.wait_loss_s - self.shrink_loss_s


def _pct(x: float) -> str:
    """A share as a percentage with the digits it needs (99.95%, not 100.0%; 0.05%, not 0.0%)."""
    digits = 1
    while digits < 4 and 0 < x < 1 and round(x * 100, digits) in (0, 100):
        digits += 1
    return f"{x * 100:.{digits}f}%"


def worlds(limit: int, multiple: int = 1, divides: int = 0) -> tuple[int, ...]:
    """The world sizes up to `limit` a job can train at: multiples of `multiple` (a node,
    a tensor- or pipeline-parallel group), and, with `divides`, those that divide it (the
    global batch in micro-batches, or the job's data shards, split evenly over the ranks)."""
    step = max(1, multiple)
    return tuple(w for w in range(step, max(0, limit) + 1, step) if divides <= 0 or divides % w == 0)


def shrink_loss_s(
    fraction: float, eta_s: float, shrink_s: float, grow_s: float, boundary_s: float = 0.0
) -> float:
    """Full-world seconds lost by going on at `fraction` of the world until a replacement
    arrives in `eta_s`, then growing back at the next checkpoint boundary."""
    narrow = 1.0 - fraction
    return shrink_s + narrow * max(0.0, eta_s - shrink_s) + narrow * boundary_s + grow_s


def choose(
    world_size: int,
    survivors: int,
    min_world: int,
    replacement_eta_s: float | None,
    restart_s: float,
    shrink_s: float,
    grow_s: float,
    allowed: Collection[int] | None = None,
    boundary_s: float = 0.0,
) -> ElasticChoice:
    """The rule (module docstring). `world_size` is the full world W; `survivors` the
    ranks left after the loss (they may already train at less than W); `min_world` the
    smallest world worth training at; `allowed` the worlds the job can train at (None:
    any); `replacement_eta_s` when a replacement is expected, from now (None: none is)."""
    eta = replacement_eta_s
    wait = math.inf if eta is None else eta + restart_s
    if survivors >= world_size:
        reason = f"no capacity lost: {survivors:,} of {world_size:,} ranks are there; go on at the full world"
        return ElasticChoice("wait", world_size, world_size, survivors, eta, 0.0, None, reason)
    fits = [w for w in (allowed if allowed is not None else (survivors,)) if min_world <= w <= survivors]
    smaller = max(fits, default=0)
    lost = f"{world_size - survivors:,} of {world_size:,} ranks lost"
    if not smaller:
        below = (
            f"{lost}: no world the job can train at between the minimum {min_world:,} and the "
            f"{survivors:,} survivors"
        )
        if eta is None:
            reason = f"{below}, and no replacement is expected: stop"
            return ElasticChoice("stop", 0, world_size, survivors, None, wait, None, reason)
        reason = (
            f"{below}: wait for the replacement, expected in {eta:,.0f} s, then restart ({restart_s:,.0f} s)"
        )
        return ElasticChoice("wait", world_size, world_size, survivors, eta, wait, None, reason)
    f = smaller / world_size
    at = f"{smaller:,} of {world_size:,} ranks ({_pct(f)})"
    if eta is None:
        reason = f"{lost} and no replacement is expected: shrink to {at}, {_pct(1 - f)} of every second lost"
        return ElasticChoice("shrink", smaller, world_size, survivors, None, wait, math.inf, reason)
    shrink = shrink_loss_s(f, eta, shrink_s, grow_s, boundary_s)
    narrow, trained = 1.0 - f, max(0.0, eta - shrink_s)
    waiting = (
        f"waiting loses {eta:,.0f} s for the replacement + {restart_s:,.0f} s restart = {wait:,.0f} s "
        "of the full world's training"
    )
    shrinking = (
        f"shrinking to {at} loses {shrink_s:,.0f} s re-forming + {_pct(narrow)} of {trained:,.0f} s "
        f"at {smaller:,} ranks ({narrow * trained:,.0f} s) + {_pct(narrow)} of {boundary_s:,.0f} s to "
        f"the next checkpoint ({narrow * boundary_s:,.0f} s) + {grow_s:,.0f} s growing back = {shrink:,.0f} s"
    )
    why = f"{lost}, a replacement expected in {eta:,.0f} s: {waiting}; {shrinking}"
    if shrink < wait:
        reason = f"shrink ({wait - shrink:,.0f} s saved): {why}"
        return ElasticChoice("shrink", smaller, world_size, survivors, eta, wait, shrink, reason)
    reason = f"wait ({shrink - wait:,.0f} s saved): {why}"
    return ElasticChoice("wait", world_size, world_size, survivors, eta, wait, shrink, reason)
