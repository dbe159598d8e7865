"""When to wake a human (seed R5): independent hardware failures restart silently and are
reported; a page goes out only on a pattern, once per pattern, with its rule and the
evidence (the interruptions that make it).

  same_node     one node caused `same_node_interruptions` interruptions of the run: the
                quarantine that should have removed it after the first did not work
  same_step     the job failed at the same step `same_step_interruptions` times across
                restarts: data or code, not hardware (a restart will not fix it)
  failure_rate  the last hour's interruptions exceed `rate_multiple` x the baseline rate
                (the run's MTBF posterior) with at least `rate_min_interruptions` of them:
                the ratio alone is weak (at 16,384 ranks any two failures in an hour are
                6x the baseline), so a count floor makes it a pattern, not bad luck

  goodput       the last hour's measured goodput is under 0.3 (processors/core/goodput.py):
                restarts are eating the run; paged again at most once per window
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ...schemas import Envelope, GoodputReport, Interruption, Page, Reason, ReasonCode
from .baseline import BaselinePolicy, BaselineState, baseline_rate_per_h, rate_1h, window_count
from .ids import derived_id


class PagingPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    same_node_interruptions: int = Field(2, ge=2, description="Page when one node caused this many.")
    same_step_interruptions: int = Field(2, ge=2, description="Page when one step failed this many times.")
    rate_multiple: float = Field(
        5.0, gt=1, description="Page when the last hour's rate exceeds this x baseline."
    )
    rate_min_interruptions: int = Field(
        3, ge=1, description="...and at least this many interruptions fell in that hour."
    )


@dataclass
class PagingState:
    """One run's interruptions by node and by step (kept across attempts)."""

    counted: set[str] = field(default_factory=set)
    #: (detection ts, interruption_id) in the order counted: the failure-rate evidence.
    timeline: list[tuple[float, str]] = field(default_factory=list)
    by_node: dict[str, list[str]] = field(default_factory=dict)
    by_step: dict[int, list[str]] = field(default_factory=dict)
    #: (rule, subject) already paged: a pattern pages once.
    paged: set[tuple[str, str]] = field(default_factory=set)
    #: ts of the last failure-rate page (re-armed once its window has passed).
    rate_paged_ts: float | None = None
    #: ts of the last goodput page (likewise).
    goodput_paged_ts: float | None = None


def on_interruption(
    state: PagingState,
    interruption: Interruption,
    baseline: BaselineState,
    baseline_policy: BaselinePolicy,
    policy: PagingPolicy,
) -> list[Page]:
    """Call after the baseline has counted `interruption` (once per interruption_id)."""
    if interruption.interruption_id in state.counted:
        return []
    state.counted.add(interruption.interruption_id)
    state.timeline.append((interruption.ts, interruption.interruption_id))
    pages: list[Page] = []
    node, step = interruption.node, interruption.step
    if node:
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
        seen = state.by_step.setdefault(step, [])
        seen.append(interruption.interruption_id)
        if len(seen) >= policy.same_step_interruptions and ("same_step", str(step)) not in state.paged:
            state.paged.add(("same_step", str(step)))
            text = (
                f"run {interruption.run_id} failed at step {step} {len(seen)} times across restarts: "
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
    recent, expected = rate_1h(baseline, now, baseline_policy), baseline_rate_per_h(baseline, baseline_policy)
    if count < policy.rate_min_interruptions or recent <= policy.rate_multiple * expected:
        return []
    state.rate_paged_ts = now
    window_h = baseline_policy.window_s / 3600
    text = (
        f"{count} interruptions of run {interruption.run_id} in the last {window_h:g} h: "
        f"{recent:.2f}/h against a baseline of {expected:.2f}/h ({recent / expected:.1f}x, "
        f"rule: over {policy.rate_multiple:g}x with at least {policy.rate_min_interruptions})"
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


def on_goodput(state: PagingState, report: GoodputReport, below: float, min_elapsed_s: float) -> list[Page]:
    """R5 rule 4: the window's goodput collapsed (call with the shortest window's report)."""
    if report.elapsed_s < min_elapsed_s or report.goodput >= below:
        return []
    if state.goodput_paged_ts is not None and report.ts - state.goodput_paged_ts < report.window_s:
        return []
    state.goodput_paged_ts = report.ts
    text = (
        f"run {report.run_id}: goodput {report.goodput:.2f} over the last {report.window_s / 3600:g} h "
        f"(rule: under {below:g}); {report.reason.text}"
    )
    return [page(report, "goodput", ReasonCode.PAGE_GOODPUT, text, [report.event_id])]
