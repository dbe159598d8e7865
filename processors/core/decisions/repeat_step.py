"""What follows a `same_step` page (seed R5, issue 14 item 4): the run failed at one step
again and again, on different nodes. That is data or code, not hardware, so

- the run stops restarting into that step: PauseRun (the launcher restarts nothing and
  exits paused, with the reason, for a human), or, under `paging.on_repeat_step: skip`,
  SkipUpdate of that step and the run goes on;
- no node is quarantined for those failures (quarantine.py skips a step that failed
  before), and the node quarantined at the step's first failure, before anyone could tell,
  is released: ReleaseNode (the launcher returns it to the pool) and QuarantineReleased
  (the record, with the reason).

Pure: ids derived from the page and the quarantine they answer.
"""

from __future__ import annotations

from ....schemas import (
    Command,
    Derived,
    Interruption,
    InterruptionCause,
    Page,
    PauseRun,
    QuarantineReleased,
    Reason,
    ReasonCode,
    ReleaseNode,
    SkipUpdate,
)
from ..ids import derived_id
from .paging_state import PagingPolicy, PagingState


def on_pages(
    state: PagingState,
    interruption: Interruption,
    pages: list[Page],
    policy: PagingPolicy,
    starting: bool = False,
) -> list[Derived | Command]:
    """Call after paging and quarantine have seen `interruption`, with the pages it made."""
    page = next((p for p in pages if p.rule == "same_step"), None)
    if page is None:
        return []
    step = interruption.step
    failures = state.by_step.get((step, starting), [])
    # An interruption's step is the last one the job completed: a crash or hang struck in
    # the next (an attempt resumed from checkpoint s that completed none dies in s + 1);
    # a non-finite loss is reported for the step that computed it.
    failing = step if interruption.cause == InterruptionCause.NON_FINITE else step + 1
    nodes = sorted({n for iid in failures if (n := state.nodes.get(iid))})
    where = f"{len(nodes)} different nodes" if len(nodes) > 1 else "one node"
    verdict = f"step {failing} failed {len(failures)} times on {where}: data or code, not hardware"
    outputs: list[Derived | Command] = [_stop(interruption, page, failing, verdict, policy)]
    if len(nodes) > 1:  # on one node only, the node stays suspect
        outputs += _releases(state, interruption, page, failures, failing, len(nodes))
    return outputs


def _stop(
    interruption: Interruption, page: Page, failing: int, verdict: str, policy: PagingPolicy
) -> Command:
    common = dict(
        run_id=interruption.run_id,
        attempt=interruption.attempt,
        ranks=None,
        issued_ts=interruption.ts,
        caused_by=[page.event_id],
    )
    if policy.on_repeat_step == "skip":
        text = f"{verdict}; skipping the batch of step {failing} and continuing (policy on_repeat_step: skip)"
        return SkipUpdate(
            command_id=derived_id("skip_update", page.event_id),
            reason=Reason(code=ReasonCode.SKIP_BATCH, text=text),
            step=failing,
            **common,
        )
    text = (
        f"{verdict}; restarting again would fail again: the run is paused for a human "
        "(fix the data or code, or skip the batch, then relaunch)"
    )
    return PauseRun(
        command_id=derived_id("pause_run", page.event_id),
        reason=Reason(code=ReasonCode.PAUSE_RUN, text=text),
        step=failing,
        **common,
    )


def _releases(
    state: PagingState,
    interruption: Interruption,
    page: Page,
    failures: list[str],
    failing: int,
    n_nodes: int,
) -> list[Derived | Command]:
    outputs: list[Derived | Command] = []
    for iid in failures:
        quarantined = state.quarantined.get(iid)
        if quarantined is None or quarantined[1] in state.released:
            continue
        node, quarantine_id = quarantined
        if node in state.self_test_failed:
            continue  # it failed a known-answer test too: its own fault as well, it stays out
        state.released.add(quarantine_id)
        reason = Reason(
            code=ReasonCode.QUARANTINE_RELEASED,
            text=f"step {failing} failed on {n_nodes} different nodes: data or code, not {node}; "
            f"{node} returns to the pool (quarantined at the step's first failure, {iid[:12]})",
        )
        released = QuarantineReleased(
            event_id=derived_id("quarantine_released", quarantine_id, page.event_id),
            run_id=interruption.run_id,
            attempt=interruption.attempt,
            rank=-1,
            node=node,
            step=failing,
            ts=interruption.ts,
            reason=reason,
            caused_by=[quarantine_id, page.event_id],
            quarantine_id=quarantine_id,
        )
        outputs.append(released)
        outputs.append(
            ReleaseNode(
                command_id=derived_id("release_node", quarantine_id),
                run_id=interruption.run_id,
                attempt=interruption.attempt,
                ranks=None,
                issued_ts=interruption.ts,
                reason=reason,
                caused_by=[released.event_id],
                node=node,
            )
        )
    return outputs
