"""The soak's account of each hang (issue 14): whom the verdict named and how, and how
soon after the timeout its stack-dump abort was acknowledged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from harness.devtools.soak import HangOutcome, _hangs
from harness.streams import Job
from trainguard.processors.core import CorePolicy, HangPolicy, run_all
from trainguard.producers.simulator.cluster import FiredFault
from trainguard.schemas import Abort, Ack, AckStatus, Command, Derived, HangDetected, ReasonCode

POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))


def test_a_hang_named_from_its_stack_and_acked_two_seconds_after_its_timeout() -> None:
    job = Job(world_size=32, ranks_per_node=8).start().steps(40)
    start_ts = job.events[0].ts
    job.stall(5.0)
    state, outputs = run_all(job.events, POLICY)
    (hang,) = [o for o in outputs if isinstance(o, HangDetected)]
    (abort,) = [o for o in outputs if isinstance(o, Abort)]
    n = len(job.events)
    job.abort_all(culprit=13)
    _, more = run_all(job.events[n:], POLICY, state)
    derived = [o for o in outputs + more if isinstance(o, Derived)]
    commands = [o for o in outputs + more if isinstance(o, Command)]
    acked_at = abort.issued_ts + 2.0
    acks = [
        Ack(command_id=abort.command_id, command_kind="abort", run_id=job.run_id, attempt=0, rank=r,
            node=job.node(r), status=AckStatus.EXECUTED, ts=acked_at + 0.01 * r)
        for r in range(job.world_size)
    ]  # fmt: skip
    fired = [FiredFault("hang", 13, job.node(13), 40, 0, hang.ts - hang.stalled_s)]
    result = cast(Any, SimpleNamespace(fired=fired))
    (outcome,) = _hangs(result, derived, commands, acks, start_ts, speed=1.0)
    struck = fired[0].ts - start_ts
    assert outcome == HangOutcome(13, 13, ReasonCode.ODD_STACK.value, outcome.ack_s, at_s=struck)
    assert outcome.from_stack and outcome.ack_s is not None and abs(outcome.ack_s - 2.0) < 1e-6


def test_a_hang_without_a_verdict_or_an_ack_is_reported_as_such() -> None:
    fired = [FiredFault("hang", 5, "node-000", 40, 0, 1_800_000_050.0)]
    (outcome,) = _hangs(cast(Any, SimpleNamespace(fired=fired)), [], [], [], 1_800_000_000.0, speed=1.0)
    assert outcome == HangOutcome(rank=5, named=-1, code="", ack_s=None, at_s=50.0) and not outcome.from_stack
