"""Which telemetry records a worker's core has folded, partition by partition: the pure
bookkeeping behind state recovery (no I/O, no clock: time is passed in).

The invariant: for each partition it holds, the worker's core state is exactly the fold
of that partition's records below `next_offset`, and every output of those records is
delivered. A run shard's records all sit on one partition (ticks and forwards go to
shard 0's), so a partition's run states depend on nothing else and can be dropped,
snapshotted and recovered on their own. Then, for a record at `offset`:

- `offset == next_offset`: fold it;
- `offset < next_offset`: already folded, outputs delivered: a redelivery (the worker
  committed less than it processed), skip it;
- a partition not held, or `offset > next_offset` (records folded by another worker in
  between): recover the partition up to `offset` first (processors/recovery.py).

A rebalance revokes every partition of every worker before it assigns them again (the
eager protocol), most of them to the worker that held them. A revoked partition is
suspended, not dropped: if the very next generation gives it back, nobody can have
folded it in between (only its holder had it in the previous generation, and nobody holds
anything between a revocation and the next assignment), so its state is kept and the
worker goes on where it stopped. Dropping it would make every rebalance, a worker's
restart included, cost each surviving worker a recovery of the partitions it keeps
(issue 49: seconds of 2,048-rank snapshot and refold, the run's aborts waiting).

Recovery also lists the outputs already on the output topics since the snapshot: those
of records the previous holder processed but had not committed. Re-folding those
records re-makes the same outputs with the same ids (ids derive from their cause); they
are dropped here instead of published twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from .driver import DriverResult

#: A snapshot may take at most 1/SNAPSHOT_BUDGET of the worker's time. The other side of
#: the trade: a worker taking the partition over refolds every record since the last one.
#: At 1% (100), a 2,048-rank partition of 0.2 s steps on a loaded 2-core machine (0.1-0.35 s
#: a snapshot) went up to 30 s between snapshots, and a takeover refolded them for 9 s
#: while the run's aborts waited (issue 49); at 5% it refolds a few seconds' worth.
SNAPSHOT_BUDGET = 20.0


class Action(StrEnum):
    FOLD = "fold"
    SKIP = "skip"
    RECOVER = "recover"


@dataclass
class Held:
    """One partition this worker holds."""

    next_offset: int
    #: Keys of CoreState.runs folded from this partition.
    keys: set[str] = field(default_factory=set)
    #: Ids of outputs already published (decision ids, dead-letter sources).
    published: set[str] = field(default_factory=set)
    #: Below this offset a record may have been processed before; from it on, none was.
    published_until: int = 0
    snapshot_at: float = 0.0
    #: Seconds the last snapshot took to encode: the loop stalls that long.
    snapshot_cost_s: float = 0.0
    #: A snapshot is being sealed and sent (off the loop): the next waits for it, so that
    #: a partition's snapshots reach their topic in the order they were taken.
    sending: bool = False


@dataclass
class PartitionBook:
    held: dict[int, Held] = field(default_factory=dict)
    skipped: int = 0
    suppressed: int = 0
    #: Held partitions revoked by a rebalance under way, with the group generation
    #: they were held in: kept or released at the next assignment (:meth:`reassigned`).
    suspended: dict[int, int] = field(default_factory=dict)
    #: Partitions kept through a rebalance without a recovery.
    kept: int = 0

    def action(self, partition: int, offset: int) -> Action:
        held = self.held.get(partition)
        if held is None or offset > held.next_offset:
            return Action.RECOVER
        return Action.FOLD if offset == held.next_offset else Action.SKIP

    def hold(self, partition: int, held: Held) -> set[str]:
        """Take over `partition` as recovered; returns the keys of the state it replaces."""
        old = self.held.pop(partition, None)
        self.held[partition] = held
        return old.keys if old is not None else set()

    def release(self, partition: int) -> set[str]:
        """Forget a partition: returns the keys of its run states to drop."""
        self.suspended.pop(partition, None)
        held = self.held.pop(partition, None)
        return held.keys if held is not None else set()

    def suspend(self, partition: int, generation: int) -> None:
        """A rebalance revoked `partition`, held in group generation `generation`."""
        if partition in self.held:
            self.suspended[partition] = generation

    def reassigned(self, partitions: set[int], generation: int) -> set[str]:
        """The assignment of `generation`: a suspended partition in it is kept if the
        generation is the very next one (no other holder can have come between), any
        other suspended one is released. Returns the keys of the run states to drop."""
        drop: set[str] = set()
        for partition, held_in in list(self.suspended.items()):
            if partition in partitions and generation == held_in + 1:
                del self.suspended[partition]
                self.kept += 1
            else:
                drop |= self.release(partition)
        return drop

    def suspended_keys(self) -> set[str]:
        """Keys of the run states of suspended partitions (no timer may speak for them)."""
        return {key for p in self.suspended for key in self.held[p].keys}

    def folded(self, partition: int, offset: int, key: str | None) -> None:
        held = self.held[partition]
        held.next_offset = offset + 1
        if key is not None:
            held.keys.add(key)
        if held.published and held.next_offset >= held.published_until:
            held.published = set()  # past what anyone processed: nothing more to drop

    def unpublished(self, partition: int, result: DriverResult, source: str) -> DriverResult:
        """`result` without the outputs the previous holder already published."""
        published = self.held[partition].published
        if not published:
            return result
        derived = [d for d in result.derived if d.event_id not in published]
        commands = [c for c in result.commands if c.command_id not in published]
        rejections = [] if source in published else result.rejections
        self.suppressed += (
            len(result.derived) - len(derived)
            + len(result.commands) - len(commands)
            + len(result.rejections) - len(rejections)
        )  # fmt: skip
        return replace(result, derived=derived, commands=commands, rejections=rejections)

    def snapshot_due(self, partition: int, now: float, interval_s: float) -> bool:
        """Every `interval_s`, but no more often than keeps snapshots under 5% of the time:
        encoding stalls the worker's loop, and a 16,384-rank partition takes ~1 s; never
        while the partition's last snapshot is still being sent."""
        held = self.held[partition]
        if held.sending or now - held.snapshot_at < max(interval_s, SNAPSHOT_BUDGET * held.snapshot_cost_s):
            return False
        held.snapshot_at = now
        return True
