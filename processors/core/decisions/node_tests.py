"""What the core does with a node self-test's result (seed §SDC (c), issue 15 item 6).

The launcher runs the self-test (producers/launcher/node_selftest.py: a known-answer GEMM on each
device, an all-reduce across them) on a quarantined node before it may return to the
pool and on a spare before it joins, and reports NodeSelfTestResult. Here:

- failed: the node stays out for the rest of the run. It is recorded (PagingState
  .self_test_failed), so that no later release returns it (a repeat-step release, a
  passing test after the failure, a release on pass); a node that was not out yet (a spare
  that failed before joining, an operator's test of a node in the job) is quarantined now:
  Quarantine (the record, with the result's reason) and QuarantineNode.
- passed on a node the core sent out: released only where the policy allows it
  (``release_on_self_test_pass``, off by default: a node proven wrong by an SDC check that
  then passes a short test may still be wrong under load, so a human decides); then
  QuarantineReleased and ReleaseNode with the result as the reason.
- passed otherwise (a spare before it joins): nothing to decide; the result is the record.

Pure: ids derived from the result's event id.
"""

from __future__ import annotations

from ....schemas import (
    Command,
    Derived,
    NodeSelfTestResult,
    QuarantineNode,
    QuarantineReleased,
    Reason,
    ReasonCode,
    ReleaseNode,
)
from ..ids import derived_id
from .paging_state import PagingState
from .quarantine import take_out


def note_leaving(state: PagingState, command: QuarantineNode) -> None:
    """The core sent `command.node` out of the pool (any detector): remember by which command."""
    state.out.setdefault(command.node, command.command_id)


def note_released(state: PagingState, command: ReleaseNode) -> None:
    state.out.pop(command.node, None)


def on_result(
    state: PagingState, event: NodeSelfTestResult, release_on_pass: bool
) -> list[Derived | Command]:
    node = event.node
    if not node:
        return []
    if not event.passed:
        first = node not in state.self_test_failed
        state.self_test_failed.setdefault(node, event.event_id)
        if not first or node in state.out:
            return []  # already out: it stays out (no release will take it back)
        return _quarantine(state, event)
    if node in state.self_test_failed or node not in state.out or not release_on_pass:
        return []
    return _release(state, event)


def _quarantine(state: PagingState, event: NodeSelfTestResult) -> list[Derived | Command]:
    reason = Reason(
        code=ReasonCode.NODE_SELF_TEST_FAILED,
        text=f"node {event.node} failed its {event.purpose} self-test ({event.reason.text}); "
        "out of the pool for the rest of the run",
    )
    quarantine, command = take_out(
        event.run_id, event.attempt, -1, event.node, event.step, event.ts, reason, cause_id=event.event_id
    )
    return [quarantine, command]


def _release(state: PagingState, event: NodeSelfTestResult) -> list[Derived | Command]:
    sent_out_by = state.out[event.node]
    reason = Reason(
        code=ReasonCode.NODE_SELF_TEST_PASSED,
        text=f"node {event.node} passed its self-test ({event.reason.text}); back in the pool "
        "(policy release_on_self_test_pass)",
    )
    released = QuarantineReleased(
        event_id=derived_id("quarantine_released", sent_out_by, event.event_id),
        run_id=event.run_id,
        attempt=event.attempt,
        rank=-1,
        node=event.node,
        step=event.step,
        ts=event.ts,
        reason=reason,
        caused_by=[event.event_id],
        quarantine_id=sent_out_by,
    )
    command = ReleaseNode(
        command_id=derived_id("release_node", sent_out_by, event.event_id),
        run_id=event.run_id,
        attempt=event.attempt,
        ranks=None,
        issued_ts=event.ts,
        reason=reason,
        caused_by=[released.event_id],
        node=event.node,
    )
    return [released, command]
