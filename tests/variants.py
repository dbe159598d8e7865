"""Slow variants of end-to-end tests: the suite runs one representative case of each, the
benchmark `bench/bench_slow_variants.py` runs them all (the suite must stay well under 30
minutes on 2 cores). ``TRAINGUARD_SLOW_VARIANTS=1`` adds the slow cases to the parameters;
without it they are not collected (not skipped: a skip is not a pass)."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

ENV = "TRAINGUARD_SLOW_VARIANTS"


def with_slow(suite: list[T], slow: list[T]) -> list[T]:
    """`suite`, plus `slow` when the slow variants are asked for."""
    return suite + (slow if os.environ.get(ENV) == "1" else [])
