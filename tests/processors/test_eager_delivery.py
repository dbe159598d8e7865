"""The processor's faust transport (processors/eager_delivery.py): a delivery that does not
wait is done without tasks, one that waits is raced against a suspended flow as faust
races it. The end-to-end tests (rebalances, kills, static members) run every processor on
this transport through a real broker; these pin the race itself."""

from __future__ import annotations

import asyncio
import gc
import warnings

import faust
import pytest

from trainguard.processors import eager_delivery
from trainguard.processors.eager_delivery import run_until_suspended


async def _put(queue: asyncio.Queue[int], item: int, trail: list[str], yields: bool = True) -> int:
    """A delivery like faust's: a put that waits while the buffer is full."""
    trail.append("started")
    try:
        await queue.put(item)
        trail.append("put")
        if yields:
            await asyncio.sleep(0)  # a bare yield after the wait
        return item
    finally:
        trail.append("finally")


def test_a_coroutine_that_never_waits_finishes_eagerly() -> None:
    async def body() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)

        async def deliver() -> int:
            queue.put_nowait(7)
            return 7

        finished, value = run_until_suspended(deliver())
        assert (finished, value) == (True, 7)
        assert queue.get_nowait() == 7

    asyncio.run(body())


def test_a_coroutine_that_waits_is_finished_by_a_task() -> None:
    async def body() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        queue.put_nowait(0)  # full
        trail: list[str] = []
        finished, rest = run_until_suspended(_put(queue, 1, trail))
        assert not finished and trail == ["started"]
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0.01)
        assert not task.done()
        assert queue.get_nowait() == 0  # room: the waiting put goes on
        assert await asyncio.wait_for(task, 1) == 1
        assert trail == ["started", "put", "finally"]
        assert queue.get_nowait() == 1

    asyncio.run(body())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    async def body() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        queue.put_nowait(0)
        trail: list[str] = []
        _, rest = run_until_suspended(_put(queue, 1, trail))
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert trail == ["started", "finally"]
        assert queue.get_nowait() == 0
        queue.put_nowait(2)  # the cancelled put left no waiter behind: it would have taken the slot
        assert queue.qsize() == 1 and queue.get_nowait() == 2

    asyncio.run(body())


def test_an_error_after_the_wait_reaches_the_awaiter() -> None:
    async def body() -> None:
        event = asyncio.Event()

        async def fails() -> None:
            await event.wait()
            raise ValueError("bad record")

        _, rest = run_until_suspended(fails())
        task = asyncio.ensure_future(rest)
        event.set()
        with pytest.raises(ValueError, match="bad record"):
            await task

    asyncio.run(body())


def _consumer() -> eager_delivery.Consumer:
    """The processor's consumer, as its app makes it (not started: no broker needed)."""
    app = faust.App("test-eager-delivery", broker="kafka://127.0.0.1:1", web_enabled=False)
    eager_delivery.install(app)
    assert app.transport.Consumer is eager_delivery.Consumer

    async def nothing(*_: object) -> None:
        return None

    return eager_delivery.Consumer(
        app.transport,
        callback=nothing,
        on_partitions_revoked=nothing,
        on_partitions_assigned=nothing,
        loop=asyncio.get_running_loop(),
    )


def test_a_delivery_with_room_wins_without_starting_the_race() -> None:
    async def body() -> None:
        consumer = _consumer()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        trail: list[str] = []
        delivery = _put(queue, 1, trail, yields=False)
        before = len(asyncio.all_tasks())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a suspend-wait left unawaited would warn
            done = await consumer.wait_first(delivery, consumer.suspend_flow.wait())
            gc.collect()
        assert done.done == [delivery] and done.results == [1] and not done.stopped
        assert queue.get_nowait() == 1 and trail == ["started", "put", "finally"]
        assert len(asyncio.all_tasks()) == before

    asyncio.run(body())


def test_a_delivery_waiting_on_a_full_buffer_loses_to_a_suspended_flow() -> None:
    """faust#229: a rebalance suspends the flow while the stream's buffer is full; the
    delivery is abandoned (the record is read again after the rebalance)."""

    async def body() -> None:
        consumer = _consumer()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        queue.put_nowait(0)
        trail: list[str] = []
        race = asyncio.ensure_future(consumer.wait_first(_put(queue, 1, trail), consumer.suspend_flow.wait()))
        await asyncio.sleep(0.01)
        assert not race.done() and trail == ["started"]
        consumer.suspend_flow.set()
        done = await asyncio.wait_for(race, 1)
        await asyncio.sleep(0)  # the cancelled delivery runs its cleanup
        assert len(done.done) == 1 and not done.stopped
        assert trail == ["started", "finally"]
        assert queue.get_nowait() == 0 and queue.empty()

    asyncio.run(body())


def test_a_delivery_waiting_on_a_full_buffer_wins_when_room_comes() -> None:
    async def body() -> None:
        consumer = _consumer()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        queue.put_nowait(0)
        trail: list[str] = []
        delivery = _put(queue, 1, trail)
        race = asyncio.ensure_future(consumer.wait_first(delivery, consumer.suspend_flow.wait()))
        await asyncio.sleep(0.01)
        assert queue.get_nowait() == 0
        done = await asyncio.wait_for(race, 1)
        assert done.done == [delivery] and done.results == [1]
        assert queue.get_nowait() == 1

    asyncio.run(body())


def test_a_suspended_flow_delivers_nothing() -> None:
    """The flow is already suspended: faust's own race, the delivery never puts."""

    async def body() -> None:
        consumer = _consumer()
        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=1)
        consumer.suspend_flow.set()
        trail: list[str] = []

        async def deliver() -> int:
            await consumer.can_resume_flow.wait()  # faust's flow control: blocks while suspended
            return await _put(queue, 1, trail)

        done = await asyncio.wait_for(consumer.wait_first(deliver(), consumer.suspend_flow.wait()), 1)
        await asyncio.sleep(0)
        assert len(done.done) == 1 and queue.empty() and trail == []

    asyncio.run(body())
