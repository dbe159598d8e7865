"""The partition book (processors/partitions.py): which record to fold, skip or recover
from, and which re-made outputs not to publish again."""

from __future__ import annotations

from harness.streams import Job
from trainguard.processors.core.policy import CorePolicy
from trainguard.processors.driver import CoreDriver, DriverResult
from trainguard.processors.partitions import Action, Held, PartitionBook
from trainguard.schemas import encode


def crash_outputs() -> DriverResult:
    """What the driver returns for a rank's crash report: an interruption and a quarantine."""
    job = Job(run_id="run-book", world_size=8).start().steps(5)
    job.exit(3, signal=9)
    driver = CoreDriver(CorePolicy(), b"book-test-secret-0123456789")
    results = [driver.handle(encode(e)) for e in job.events]
    return next(r for r in results if r.derived and r.commands)


def test_a_partition_not_held_is_recovered_first_whatever_the_offset() -> None:
    book = PartitionBook()
    assert book.action(0, 0) is Action.RECOVER
    assert book.action(3, 1234) is Action.RECOVER


def test_records_fold_in_order_redeliveries_are_skipped_and_a_gap_recovers() -> None:
    book = PartitionBook()
    book.hold(1, Held(next_offset=10))
    assert book.action(1, 10) is Action.FOLD
    book.folded(1, 10, "run-a")
    assert book.action(1, 11) is Action.FOLD
    assert book.action(1, 4) is Action.SKIP  # folded before, its outputs delivered
    assert book.action(1, 10) is Action.SKIP
    assert book.action(1, 12) is Action.RECOVER  # 11 was folded elsewhere


def test_holding_again_or_releasing_returns_the_run_states_to_drop() -> None:
    book = PartitionBook()
    book.hold(2, Held(next_offset=0))
    book.folded(2, 0, "run-a")
    book.folded(2, 1, "run-b#1")
    book.folded(2, 2, None)  # a record of garbage touches no run
    assert book.hold(2, Held(next_offset=7, keys={"run-a"})) == {"run-a", "run-b#1"}
    assert book.release(2) == {"run-a"}
    assert book.release(2) == set()
    assert book.action(2, 7) is Action.RECOVER


def test_a_partition_given_straight_back_by_the_next_generation_keeps_its_state() -> None:
    """Issue 49: a rebalance revokes everything; what the next generation gives straight
    back was folded by nobody else, so it goes on without a recovery."""
    book = PartitionBook()
    for partition in (0, 1):
        book.hold(partition, Held(next_offset=10))
        book.folded(partition, 10, f"run-{partition}")
    book.suspend(0, generation=4)
    book.suspend(1, generation=4)
    book.suspend(5, generation=4)  # not held: nothing to suspend
    assert book.suspended == {0: 4, 1: 4}
    assert book.suspended_keys() == {"run-0", "run-1"}
    assert book.reassigned({0, 3}, generation=5) == {"run-1"}  # 1 went to another worker
    assert book.suspended == {} and book.kept == 1
    assert book.action(0, 11) is Action.FOLD  # no recovery: on where it stopped
    assert book.action(0, 9) is Action.SKIP  # redelivered from the committed offset
    assert book.action(1, 11) is Action.RECOVER
    assert book.action(3, 0) is Action.RECOVER


def test_a_partition_back_after_a_generation_without_this_worker_is_recovered() -> None:
    """Revoked in generation 4, assigned again in 6: in 5 another worker may have held it
    (this one was out of the group), so its state may be stale."""
    book = PartitionBook()
    book.hold(2, Held(next_offset=3))
    book.folded(2, 3, "run-a")
    book.suspend(2, generation=4)
    assert book.reassigned({2}, generation=6) == {"run-a"}
    assert book.action(2, 4) is Action.RECOVER and book.kept == 0


def test_outputs_published_by_the_previous_holder_are_dropped_until_past_its_reach() -> None:
    result = crash_outputs()
    interruption, command = result.derived[0], result.commands[0]
    book = PartitionBook()
    book.hold(0, Held(next_offset=50, published={interruption.event_id, "p:0:50"}, published_until=52))
    book.folded(0, 50, "run-book")
    again = book.unpublished(0, result, "p:0:50")
    assert [d.event_id for d in again.derived if d.event_id == interruption.event_id] == []
    assert again.commands == result.commands  # the command never made it out: publish it
    assert command.command_id not in book.held[0].published
    assert book.suppressed == 1
    book.folded(0, 51, "run-book")  # 52 reached: no one processed beyond, nothing to drop
    assert book.unpublished(0, result, "p:0:51").derived == result.derived
    assert book.suppressed == 1


def test_a_dead_letter_is_recognised_by_its_source_record() -> None:
    book = PartitionBook()
    book.hold(0, Held(next_offset=5, published={"t:0:5"}, published_until=9))
    driver = CoreDriver(CorePolicy(), b"book-test-secret-0123456789")
    bad = driver.handle(b"\x00 not json")
    assert bad.rejections
    book.folded(0, 5, bad.state_key)
    assert book.unpublished(0, bad, "t:0:5").rejections == []
    book.folded(0, 6, None)
    assert book.unpublished(0, bad, "t:0:6").rejections == bad.rejections


def test_snapshots_are_due_once_per_interval() -> None:
    book = PartitionBook()
    book.hold(0, Held(next_offset=0, snapshot_at=100.0))
    assert not book.snapshot_due(0, 110.0, 30.0)
    assert book.snapshot_due(0, 130.0, 30.0)
    assert not book.snapshot_due(0, 131.0, 30.0)
    assert book.snapshot_due(0, 160.0, 30.0)


def test_no_snapshot_is_due_while_the_last_one_is_being_sent() -> None:
    book = PartitionBook()
    book.hold(0, Held(next_offset=0, snapshot_at=100.0, sending=True))  # sealed off the loop
    assert not book.snapshot_due(0, 200.0, 30.0)  # a newer one could land before it
    book.held[0].sending = False
    assert book.snapshot_due(0, 200.0, 30.0)


def test_a_costly_snapshot_is_taken_less_often() -> None:
    book = PartitionBook()
    book.hold(0, Held(next_offset=0, snapshot_at=0.0, snapshot_cost_s=3.0))  # a costly state
    assert not book.snapshot_due(0, 40.0, 30.0)  # 3 s each 30 s would be 10% of the loop
    assert book.snapshot_due(0, 61.0, 30.0)  # each 60 s: 5%
