"""Slow variants of end-to-end tests: the suite runs one representative case of each, the
benchmark `bench/bench_slow_variants.py` runs them all (the suite must stay well under 30
minutes on 2 cores). ``TRAINGUARD_SLOW_VARIANTS=1`` adds the slow cases to the parameters;
without it they are not collected (not skipped: a skip is not a pass)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _pytest.mark.structures import ParameterSet

ENV = "TRAINGUARD_SLOW_VARIANTS"


#: Whole modules that only the benchmark runs: the suite covers what they show otherwise.
#: test_rebalance_broker (90 s: two workers, one SIGKILLed mid-load and restarted): the
#: chaos soak's CI case kills and restarts workers under load with the same oracle.
#: test_multihost_hang_broker (70 s: a host lost, then a hang with no spare left): the
#: suite covers the loss, the stop with no spare left and hangs named from the stacks apart.
#: test_multihost_bucket (45 s: two hosts checkpointing to a bucket): the suite covers the
#: bucket under launch on one host and the state directory's files across hosts.
#: test_supervised_straggler (40 s: the hand-written loop's straggler flagged, diagnosed and
#: evicted): test_frameworks_launch does the same for Lightning, the HF Trainer and FSDP.
SLOW_MODULES = [
    "processors/test_rebalance_broker.py",
    "producers/launcher/test_multihost_hang_broker.py",
    "producers/launcher/test_multihost_bucket.py",
    "producers/test_supervised_straggler.py",
]


def slow_variants() -> bool:
    return os.environ.get(ENV) == "1"


#: Modules whose slow cases are the longest of all (minutes each: the library's 2,048- and
#: 16,384-rank scenarios): scheduled before the other slow groups (tests/conftest.py).
LONGEST = ["schemas/test_columnar.py", "harness/scoring/test_capacity.py"]

#: The mark of a slow variant's case: each is scheduled as a group of its own, ahead of the
#: rest (tests/conftest.py), so that the longest cases start first on parallel workers.
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
