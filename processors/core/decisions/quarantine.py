"""Quarantine (seed §8, R5): before the restart, the node that
caused an interruption leaves the pool, with the reason, and the quarantine names the run
it affected, so that "which node killed the most jobs" is one query over the archive.

Which interruptions name a node worth removing:
  crash           the rank that died first
  hang            the rank whose stack differs, else the rank whose last reported phase
                  differs from everyone waiting in the collective; never a rank only for
                  not answering the stack dump, nor a hang whose culprit is unknown
  not quarantined a non-finite loss (the first reporter is not evidence against its
                  node: abort and investigate), an operator's restart, an SDC mismatch
                  (the SDC detector quarantines the node it proved wrong itself), and a
                  failure at a step that already failed before: that is data or code
                  (paging says so), and removing node after node would not fix it. Once
                  the step's repeat is paged, the node quarantined at its first failure is
                  released (repeat_step.py).
"""

from __future__ import annotations

from ....schemas import Interruption, InterruptionCause, Quarantine, QuarantineNode, Reason, ReasonCode
from ..ids import derived_id
from .paging_state import PagingState

#: Causes whose culprit node is removed from the pool.
QUARANTINED_CAUSES = frozenset({InterruptionCause.CRASH, InterruptionCause.HANG})


def on_interruption(
    paging: PagingState, interruption: Interruption, starting: bool = False
) -> list[Quarantine | QuarantineNode]:
    """Call after paging has recorded `interruption` (its by-step history is read here)."""
    node = interruption.node
    if interruption.cause not in QUARANTINED_CAUSES or not node or interruption.rank < 0:
        return []
    if len(paging.by_step.get((interruption.step, starting), ())) > 1:
        return []  # the same step failed before: data or code, not this node
    reason = Reason(
        code=ReasonCode.QUARANTINE,
        text=f"node {node} caused interruption {interruption.interruption_id[:12]} of run "
        f"{interruption.run_id} ({interruption.cause.value}: {interruption.reason.text}); "
        "out of the pool before the restart",
    )
    quarantine, command = take_out(
        interruption.run_id,
        interruption.attempt,
        interruption.rank,
        node,
        interruption.step,
        interruption.ts,
        reason,
        cause_id=interruption.interruption_id,
    )
    paging.quarantined[interruption.interruption_id] = (node, quarantine.event_id)
    return [quarantine, command]


def take_out(
    run_id: str, attempt: int, rank: int, node: str, step: int, ts: float, reason: Reason, cause_id: str
) -> tuple[Quarantine, QuarantineNode]:
    """The Quarantine event (named after the record that caused it) and its QuarantineNode
    command. The command's id is one per node and attempt, whoever asks for it (the SDC
    detector and a failed self-test derive theirs the same way)."""
    quarantine = Quarantine(
        event_id=derived_id("quarantine", cause_id),
        run_id=run_id,
        attempt=attempt,
        rank=rank,
        node=node,
        step=step,
        ts=ts,
        reason=reason,
        caused_by=[cause_id],
        run_ids_affected=[run_id],
    )
    command = QuarantineNode(
        command_id=derived_id("quarantine_node", run_id, attempt, node),
        run_id=run_id,
        attempt=attempt,
        ranks=None,
        issued_ts=ts,
        reason=reason,
        caused_by=[quarantine.event_id],
        node=node,
    )
    return quarantine, command
