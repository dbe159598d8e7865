"""When to wake a human (seed R5): independent hardware failures restart silently and are
reported; a page goes out only on a pattern, once per pattern, with its rule and the
evidence (the interruptions that make it).

  same_node     one node caused `same_node_interruptions` interruptions of the run: the
                quarantine that should have removed it after the first did not work. A
                failure at a step that failed before (on any node) is not counted against
                its node, and the step's first failure stops counting once it repeats: a
                data or code fault is no evidence against the nodes it happens to run on
  same_step     the job failed at the same step `same_step_interruptions` times across
                restarts: data or code, not hardware (a restart will not fix it). A failure
                before the attempt completed any step counts apart, as "starting from
                checkpoint s", and pages at `same_start_interruptions` (3): a crash just after
                a checkpoint and a failure during the next restart both stop at step s by
                chance, and at 16,384 ranks with 10-minute restarts 5% of restarts are hit by
                another failure, so two in a row happen about monthly; three do not.
                What follows the page (repeat_step.py): the run stops restarting into that
                step (PauseRun, or SkipUpdate under `on_repeat_step: skip`), and the node
                quarantined at the step's first failure is released
  failure_rate  the last hour's interruptions exceed `rate_multiple` x the baseline rate
                (the run's MTBF posterior) with at least `rate_min_interruptions` of them:
                the ratio alone is weak (at 16,384 ranks any two failures in an hour are
                6x the baseline), so a count floor makes it a pattern, not bad luck

  goodput       the last hour's measured goodput is under 0.3 (processors/core/accounting/goodput.py),
                and still would be with each of its interruptions' usual price forgiven (the
                run's usual restart and up to one checkpoint interval of lost work): a stuck
                restart, a straggler nobody fixed, checkpoints that block for minutes. One
                ordinary failure is not a pattern, although with a long interval it can cost
                most of an hour. Paged again at most once per window
"""

from __future__ import annotations

from ....schemas import Envelope, GoodputReport, Interruption, Page, Reason, ReasonCode
from ..accounting.baseline import background_rate_per_h, burst_p_value, rate_1h, window_count
from ..accounting.baseline_state import BaselinePolicy, BaselineState
from ..accounting.goodput import Breakdown, GoodputPolicy
from ..ids import derived_id
from .paging_state import PagingPolicy, PagingState


def on_interruption(
    state: PagingState,
    interruption: Interruption,
    baseline: BaselineState,
    baseline_policy: BaselinePolicy,
    policy: PagingPolicy,
    starting: bool = False,
) -> list[Page]:
    """Call after the baseline has counted `interruption` (once per interruption_id);
    `starting`: its attempt had not completed a step."""
    if interruption.interruption_id in state.counted:
        return []
    state.counted.add(interruption.interruption_id)
    state.timeline.append((interruption.ts, interruption.interruption_id))
    state.nodes[interruption.interruption_id] = interruption.node
    pages: list[Page] = []
    node, step = interruption.node, interruption.step
    repeated = step >= 0 and bool(state.by_step.get((step, starting)))
    if repeated:  # data or code: neither this failure nor the step's earlier ones count against nodes
        earlier = set(state.by_step[(step, starting)])
        for ids in state.by_node.values():
            ids[:] = [i for i in ids if i not in earlier]
    if node and not repeated:
        seen = state.by_node.setdefault(node, [])
        seen.append(interruption.interruption_id)
        if len(seen) >= policy.same_node_interruptions and ("same_node", node) not in state.paged:
            state.paged.add(("same_node", node))
            text = (
                f"node {node} caused {len(seen)} interruptions of run {interruption.run_id}: "
                "its quarantine did not hold; take it out of the pool by hand"
            )
            pages.append(page(interruption, "same_node", ReasonCode.PAGE_SAME_NODE, text, seen))
    if step >= 0:
        seen = state.by_step.setdefault((step, starting), [])
        seen.append(interruption.interruption_id)
        subject = f"{step}{' starting' if starting else ''}"
        needed = policy.same_start_interruptions if starting else policy.same_step_interruptions
        if len(seen) >= needed and ("same_step", subject) not in state.paged:
            state.paged.add(("same_step", subject))
            where = f"starting from step {step}, before completing a step," if starting else f"at step {step}"
            text = (
                f"run {interruption.run_id} failed {where} {len(seen)} times across restarts: "
                "data or code, not hardware; restarting again will fail again"
            )
            pages.append(page(interruption, "same_step", ReasonCode.PAGE_SAME_STEP, text, seen))
    pages += _rate(state, interruption, baseline, baseline_policy, policy)
    return pages


def _rate(
    state: PagingState,
    interruption: Interruption,
    baseline: BaselineState,
    baseline_policy: BaselinePolicy,
    policy: PagingPolicy,
) -> list[Page]:
    now = baseline.end_ts
    if state.rate_paged_ts is not None and now - state.rate_paged_ts < baseline_policy.window_s:
        return []
    count = window_count(baseline, now, baseline_policy)
    recent, expected = (
        rate_1h(baseline, now, baseline_policy),
        background_rate_per_h(baseline, now, baseline_policy),
    )
    if count < policy.rate_min_interruptions or recent <= policy.rate_multiple * expected:
        return []
    p_value = burst_p_value(baseline, now, baseline_policy, given_one=True)
    if p_value >= policy.rate_max_p_value:
        return []
    state.rate_paged_ts = now
    window_h = baseline_policy.window_s / 3600
    text = (
        f"{count} interruptions of run {interruption.run_id} in the last {window_h:g} h: "
        f"{recent:.2f}/h against a baseline of {expected:.2f}/h ({recent / expected:.1f}x, "
        f"rule: over {policy.rate_multiple:g}x with at least {policy.rate_min_interruptions}); "
        f"p = {p_value:.1e} for the {count - 1} before it by chance at the baseline rate"
    )
    since = now - baseline_policy.window_s
    evidence = [iid for ts, iid in state.timeline if ts > since]
    return [page(interruption, "failure_rate", ReasonCode.PAGE_FAILURE_RATE, text, evidence)]


def page(cause: Envelope, rule: str, code: ReasonCode, text: str, evidence: list[str]) -> Page:
    """A page about `cause` (its run, rank, node, step and time); its id is derived from the
    rule and the cause, so a re-made decision pages once."""
    return Page(
        event_id=derived_id("page", rule, cause.event_id),
        run_id=cause.run_id,
        attempt=cause.attempt,
        rank=cause.rank,
        node=cause.node,
        step=cause.step,
        ts=cause.ts,
        reason=Reason(code=code, text=text),
        caused_by=list(evidence)[-64:],
        rule=rule,
        evidence=list(evidence),
    )


def on_goodput(
    state: PagingState,
    report: GoodputReport,
    policy: GoodputPolicy,
    usual_restart_s: float,
    interval_s: float,
) -> list[Page]:
    """R5 rule 4: the window's goodput collapsed, and not only by what its interruptions
    usually cost (call with the shortest window's report). One independent failure's
    normal price is the run's usual restart (`usual_restart_s`) plus at most one checkpoint
    interval of lost work; failures at an unusual rate page by their own rule."""
    below = policy.page_below
    if report.elapsed_s < policy.page_min_elapsed_s or report.goodput >= below:
        return []
    n = report.interruptions
    excess = Breakdown(
        report.window_s,
        report.elapsed_s,
        report.checkpoint_s,
        lost=max(0.0, report.lost_s - n * interval_s),
        restart=max(0.0, report.restart_s - n * usual_restart_s),
        straggler=report.straggler_s,
    )
    if excess.goodput >= below:
        return []
    if state.goodput_paged_ts is not None and report.ts - state.goodput_paged_ts < report.window_s:
        return []
    state.goodput_paged_ts = report.ts
    text = (
        f"run {report.run_id}: goodput {report.goodput:.2f} over the last {report.window_s / 3600:g} h "
        f"(rule: under {below:g}, and {excess.goodput:.2f} with its {n} interruption(s) charged their "
        f"usual {usual_restart_s:,.0f} s restart and up to {interval_s:,.0f} s of lost work each); "
        f"{report.reason.text}"
    )
    return [page(report, "goodput", ReasonCode.PAGE_GOODPUT, text, [report.event_id])]
