"""faust's Kafka transport, delivering a record to its stream without four tasks when
nothing can race the delivery (issue 20).

faust's fetch loop (``Consumer._drain_messages``) hands every record to the stream with
``await self.wait_first(callback(message), self.suspend_flow.wait())``: a race against a
rebalance suspending the flow, so that a delivery blocked on a full stream buffer never
holds a rebalance up (faust-streaming/faust#229 is a deadlock on this very call).
``Service.wait_first`` wraps each argument, and the service's stopped and crashed events,
in a task and waits on all four with ``asyncio.wait``: more than half of what a faust
worker that does nothing costs per record on this machine (docs/benchmarks.md).

Nearly always the delivery does not wait at all: the flow is on, the buffer has room, the
record is decoded and put. So the callback first runs eagerly, up to its first suspension
(what Python 3.12's eager tasks do; this is 3.11). When it finishes there, nothing could
have raced it: the outcome is the one faust's race gives when the callback's task runs
first, and no task was made. When it suspends, the rest of it becomes one task, raced
against the same events exactly as faust races it (``Service.wait_first``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import AppT
from mode.services import WaitArgT, WaitResults


def run_until_suspended(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run `coro` to its first suspension. (True, its result) when it finished without
    one; else (False, an awaitable that finishes it: hand it to a task)."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, _Resumed(coro, yielded)


class _Resumed:
    """The rest of a coroutine that `run_until_suspended` started: awaiting it waits for
    what the coroutine was waiting for, then drives the coroutine on, as a task would."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro, self._yielded = coro, yielded

    def __await__(self) -> Generator[Any, None, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                # A future the coroutine awaits (asyncio's protocol: the future itself is
                # yielded), or None for a bare yield (asyncio.sleep(0)): pass it up to our
                # task, which waits for it and resumes us.
                yield yielded
            except BaseException as exc:  # our task was cancelled: the coroutine is told
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                return stop.value


def _close(arg: WaitArgT) -> None:
    """An argument of a race that was never started: close a coroutine so that Python
    does not warn that it was never awaited (events have nothing to close)."""
    if asyncio.iscoroutine(arg):
        arg.close()


class Consumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer; only the delivery race of its fetch loop differs."""

    async def wait_first(self, *coros: WaitArgT, timeout: Any = None) -> WaitResults:
        # The fetch loop's call: (callback(message), suspend_flow.wait()), no timeout.
        if (
            len(coros) != 2
            or timeout is not None
            or not asyncio.iscoroutine(coros[0])
            or self.suspend_flow.is_set()
            or self._stopped.is_set()
            or self._crashed.is_set()
        ):
            return await super().wait_first(*coros, timeout=timeout)
        delivery, *others = coros
        assert asyncio.iscoroutine(delivery)  # checked above; narrows the type
        finished, outcome = run_until_suspended(delivery)
        if finished:
            for other in others:
                _close(other)
            return WaitResults([delivery], [outcome], False)
        # It waits (a full buffer, the flow's control): race the rest as faust does.
        rest = asyncio.ensure_future(outcome)
        result = await super().wait_first(rest, *others)
        winners = [delivery if d is rest else d for d in result.done]  # the caller's own argument
        return WaitResults(winners, result.results, result.stopped)


class Transport(faust_aiokafka.Transport):
    """faust's aiokafka transport with the eager :class:`Consumer`."""

    Consumer = Consumer


def install(app: AppT) -> None:
    """Give `app` the eager transport; call right after ``faust.App(...)``, before the
    app makes its first topic (which creates the stock transport)."""
    app.transport = Transport(app.conf.broker_consumer, app)
