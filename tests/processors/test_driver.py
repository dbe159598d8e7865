"""The driver's guard around the core: an event the core fails on (a bug) is parked in
the dead-letter topic with the reason `core_error`, the record's other events and the
stream go on, and a replay meets the same error at the same event. A record the decoder
fails on is parked whole, with the same reason."""

from __future__ import annotations

import pytest

from harness.streams import Job
from trainguard.processors import driver as driver_module
from trainguard.processors.core import CorePolicy
from trainguard.processors.driver import CoreDriver
from trainguard.schemas import StepTiming, decode, encode, encode_batch
from trainguard.schemas.codec import RejectReason

SECRET = b"driver-test-secret-0123456789ab"


def batch(job: Job, events: list) -> bytes:
    header = dict(run_id=job.run_id, node=events[0].node, world_size=job.world_size, producer_id="p", seq=0)
    return encode_batch(header, [encode(e) for e in events])


def test_an_event_the_core_fails_on_is_dead_lettered_and_the_rest_is_folded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = Job(world_size=4, ranks_per_node=4).start().steps(3)
    poison = next(e for e in job.events if isinstance(e, StepTiming) and e.step == 2 and e.rank == 1)
    real_step = driver_module.step

    def failing_step(state, event, *args):  # type: ignore[no-untyped-def]
        if event.event_id == poison.event_id:
            raise RuntimeError("a bug in a detector")
        return real_step(state, event, *args)

    monkeypatch.setattr(driver_module, "step", failing_step)
    driver = CoreDriver(CorePolicy(), SECRET)
    driver.handle(encode(job.events[0]))
    results = [driver.handle(batch(job, [e for e in job.events[1:] if e.step == s])) for s in range(3)]
    (rejection,) = [r for result in results for r in result.rejections]
    assert rejection.reason is RejectReason.CORE_ERROR
    assert "RuntimeError: a bug in a detector" in rejection.detail
    assert decode(rejection.raw).event_id == poison.event_id  # the event's own bytes
    run = driver.state.runs[job.run_id]
    assert run.job_step == 2 and run.ranks[0].last_step == 2 and run.ranks[1].last_step == 1


def test_a_record_the_decoder_fails_on_is_dead_lettered_whole_and_the_next_is_folded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = Job(world_size=4, ranks_per_node=4).start().steps(2)
    poison = batch(job, [e for e in job.events[1:] if e.step == 0])
    real_decode = driver_module.decode_parts

    def failing_decode(value, *args, **kwargs):  # type: ignore[no-untyped-def]
        if value == poison:
            raise TypeError("a bug in the decoder")
        return real_decode(value, *args, **kwargs)

    monkeypatch.setattr(driver_module, "decode_parts", failing_decode)
    driver = CoreDriver(CorePolicy(), SECRET)
    driver.handle(encode(job.events[0]))
    (rejection,) = driver.handle(poison).rejections
    assert rejection.reason is RejectReason.CORE_ERROR and rejection.raw == poison  # the record's own bytes
    assert "TypeError: a bug in the decoder" in rejection.detail
    driver.handle(batch(job, [e for e in job.events[1:] if e.step == 1]))
    assert driver.state.runs[job.run_id].job_step == 1
