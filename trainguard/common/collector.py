"""Python's cyclic collector held off while a replay builds or folds a whole log."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def old_objects_left_alone() -> Iterator[None]:
    """No automatic collection inside: its full collections traverse every object alive,
    and a replay keeps the log alive (on the 1,024-rank recording they were a third of a
    backtest's time, and half of the archive's read of its columns into rows). A caller
    that makes garbage for long collects the young generations itself (``gc.collect(1)``,
    replay/replay.py), so only cyclic garbage that outlives those waits for the collector
    to be back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
