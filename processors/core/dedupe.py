"""A run's dedupe window: the newest event ids it folded, the oldest forgotten first.

Delivery is at-least-once, so every event id is checked here before it changes state. The
window is a set (membership) beside a list (age) read from `head` on: on the hot path
(every telemetry event, issue 20) a compiled list's append and index are C calls where a
deque's append and popleft are Python method calls, and both are cheaper than an
OrderedDict's linked entries, with the same exact FIFO eviction. The forgotten ids before
`head` are cut off the list now and then (a memmove of its pointers, amortised over a
quarter of the window's adds).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class DedupeWindow:
    """Event ids, oldest first. Hot loops (engine.step, folds/block.py) test and add to `ids`
    directly and then `push` the id, as `add` does: an id is added only when it is not in
    the window."""

    def __init__(self, ids: Iterable[str] = ()) -> None:
        #: The window is order[head:]; order[:head] is forgotten, not yet cut off.
        self.order: list[str] = list(ids)
        self.head: int = 0
        self.ids: set[str] = set(self.order)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self.ids

    def __len__(self) -> int:
        return len(self.order) - self.head

    def __iter__(self) -> Iterator[str]:
        return iter(self.order[self.head :])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DedupeWindow) and self.order[self.head :] == other.order[other.head :]

    def add(self, event_id: str, limit: int) -> None:
        """Remember `event_id` (not in the window), forgetting the oldest past `limit`."""
        self.ids.add(event_id)
        self.push(event_id, limit)

    def push(self, event_id: str, limit: int) -> None:
        """Queue `event_id`, already added to `ids`, forgetting the oldest past `limit`."""
        order = self.order
        order.append(event_id)
        head = self.head
        if len(order) - head > limit:
            self.ids.remove(order[head])
            head += 1
            if head > 1024 and head * 4 > len(order):
                del order[:head]
                head = 0
            self.head = head
