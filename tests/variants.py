"""Scale cases of two library-wide checks: the columnar fold against the per-event fold,
and capacity's shrink-or-wait, on the labelled library's 1,024- to 16,384-rank scenarios
(minutes of a core each, up to 2.2 M events). The suite runs representative scenarios of
both; ``TRAINGUARD_SLOW_VARIANTS=1`` (bench/bench_slow_variants.py) adds the rest to the
parameters; without it they are not collected (not skipped: a skip is not a pass). Every
end-to-end test, whatever its length, is in the suite."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _pytest.mark.structures import ParameterSet

ENV = "TRAINGUARD_SLOW_VARIANTS"


def slow_variants() -> bool:
    return os.environ.get(ENV) == "1"


#: The mark of a slow variant's case (`-m "not slow_variant"` leaves them out of a run).
SLOW_MARK = "slow_variant"


def with_slow(suite: list[Any], slow: list[Any]) -> list[Any]:
    """`suite`, plus `slow` when the slow variants are asked for, each marked as one (a
    tuple is one case's several arguments)."""
    if not slow_variants():
        return suite
    mark = getattr(pytest.mark, SLOW_MARK)
    marked = []
    for case in slow:
        if isinstance(case, ParameterSet):
            marked.append(pytest.param(*case.values, marks=[*case.marks, mark], id=case.id))
        else:
            marked.append(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=mark))
    return suite + marked
