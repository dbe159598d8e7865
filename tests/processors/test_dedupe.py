"""The dedupe window forgets exactly the oldest ids past its limit, across the cuts of its
forgotten ids (processors/core/dedupe.py), as the deque it replaced did."""

from __future__ import annotations

import random
import uuid
from collections import deque

import pytest

from trainguard.processors.core.dedupe import DedupeWindow


@pytest.mark.parametrize("limit", [1, 7, 1000, 5000])
def test_the_window_is_the_newest_ids_in_order_across_its_cuts(limit: int) -> None:
    rng = random.Random(limit)
    window, reference = DedupeWindow(), deque[str]()
    ids = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(4 * limit + 5000)]
    for n, event_id in enumerate(ids, 1):
        if rng.random() < 0.5:
            window.add(event_id, limit)
        else:  # the hot loops' way: the set first, then the age
            window.ids.add(event_id)
            window.push(event_id, limit)
        reference.append(event_id)
        if len(reference) > limit:
            reference.popleft()
        if n % 997 == 0 or n == len(ids):
            assert list(window) == list(reference) and len(window) == len(reference)
            assert window.ids == set(reference)
    assert len(window.order) < len(ids)  # (cut at least once: the list did not keep every id)


def test_windows_equal_by_their_ids_not_by_what_they_have_not_cut_yet() -> None:
    ids = [f"e{i}" for i in range(3000)]
    cut, fresh = DedupeWindow(), DedupeWindow(ids[-1000:])
    for event_id in ids:
        cut.add(event_id, 1000)
    assert cut.head > 0 and len(cut.order) < len(ids)  # cut once, and holding forgotten ids again
    assert cut == fresh and list(cut) == list(fresh) == ids[-1000:]
    fresh.add("another", 1000)
    assert cut != fresh
