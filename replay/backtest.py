"""`trainguard backtest`: one recorded run replayed under several policies, the decisions
that differ side by side, and the counterfactual goodput of each policy.

The first policy is the baseline (normally the one the run used: its replay is the
recorded run, see :mod:`.replay`). Decisions are matched across policies by what they
are about, not by id (an id is derived from its cause, and the cause moves when the
policy does): a straggler flagged or evicted is keyed by its rank, a hang or an
interruption by its attempt, a page by its rule, a quarantine by its node, a rollback
by its attempt, a capacity decision (elastic training: wait for a replacement or shrink)
by the attempt that lost the node, a drain (failure prediction) by its node. For each
decision one policy takes at another time, or alone, the row says when each acts and
what the difference is worth under :mod:`.cost_model`, whose rules are explicit there.
Each policy's failure predictions are also scored against the recording's failures
(:mod:`.prediction_backtest`). The checkpoint interval is compared as a schedule over the
run. Counterfactual goodput = the baseline's measured goodput + the candidate's modelled
saving / the run's elapsed time.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..processors.core import CorePolicy
from ..schemas import (
    DrainNode,
    EvictionDecision,
    EvictRank,
    HangDetected,
    Interruption,
    InterruptionCause,
    InterruptionDecided,
    InterruptionRecovered,
    IntervalUpdate,
    MtbfUpdate,
    Page,
    QuarantineNode,
    Rollback,
    StragglerCleared,
    StragglerFlagged,
)
from . import cost_model
from .cost_model import RunFacts
from .decoded import LogColumns
from .log import Recording
from .parallel import replay_spread
from .prediction_backtest import (
    PredictionBacktest,
    RecordedFailure,
    backtest_prediction,
    drain_value,
    node_count,
    recorded_failures,
)
from .replay import Replayed

Key = tuple[str, str]


@dataclass(frozen=True)
class Act:
    """The first decision of a policy about one subject."""

    key: Key
    step: int
    ts: float
    text: str


@dataclass(frozen=True)
class Row:
    """One decision that differs between the baseline and a candidate."""

    decision: str
    subject: str
    baseline: Act | None
    candidate: Act | None
    saving_s: float | None  # modelled seconds of job time the candidate saves; None: not modelled
    rule: str
    counts: tuple[int, int] | None = None  # for decisions compared by count only

    @property
    def acts_at(self) -> float | None:
        """When the candidate acts differently: its own act, else the baseline's it skips."""
        act = self.candidate or self.baseline
        return act.ts if act is not None else None


@dataclass
class PolicyRun:
    name: str
    policy: CorePolicy
    replayed: Replayed
    rows: list[Row] = field(default_factory=list)
    saving_s: float = 0.0
    goodput: float | None = None  # counterfactual (the baseline's: measured)
    #: Failure prediction against the recording's failures (replay/prediction_backtest.py).
    prediction: PredictionBacktest | None = None


@dataclass
class Backtest:
    run_id: str
    facts: RunFacts
    #: What the pass kept of the decoded telemetry: the step timings as columns (the
    #: report's charts read them) and the cost model's inputs.
    log: LogColumns
    runs: list[PolicyRun]

    @property
    def baseline(self) -> PolicyRun:
        return self.runs[0]


def acts_of(replayed: Replayed) -> dict[Key, Act]:
    """The first decision per subject, for the kinds the backtest matches."""
    out: dict[Key, Act] = {}

    def add(key: Key, step: int, ts: float, text: str) -> None:
        out.setdefault(key, Act(key, step, ts, text))

    for d in replayed.derived:
        if isinstance(d, StragglerFlagged):
            add(("straggler flagged", f"rank {d.rank} attempt {d.attempt}"), d.step, d.ts, d.reason.text)
        elif isinstance(d, HangDetected):
            add(("hang detected", f"attempt {d.attempt}"), d.step, d.ts, d.reason.text)
        elif isinstance(d, Interruption):
            add((f"interruption ({d.cause.value})", f"attempt {d.attempt}"), d.step, d.ts, d.reason.text)
        elif isinstance(d, Page):
            add(("page", d.rule), d.step, d.ts, d.reason.text)
    for c in replayed.commands:
        if isinstance(c, EvictRank):
            add(("evict", f"rank {c.rank}"), -1, c.issued_ts, c.reason.text)
        elif isinstance(c, QuarantineNode):
            add(("quarantine", c.node), -1, c.issued_ts, c.reason.text)
        elif isinstance(c, Rollback):
            add(("rollback", f"attempt {c.attempt}"), c.checkpoint_step, c.issued_ts, c.reason.text)
        elif isinstance(c, InterruptionDecided) and c.capacity is not None:  # step: the world it goes on at
            text = f"{c.capacity}: {c.reason.text}"
            add(("capacity", f"attempt {c.attempt}"), c.world_size or -1, c.issued_ts, text)
        elif isinstance(c, DrainNode):
            add(("drain", c.node), -1, c.issued_ts, c.reason.text)
    return out


def _counts(replayed: Replayed) -> Counter[str]:
    kinds = [r.KIND for r in (*replayed.derived, *replayed.commands)]
    return Counter(k for k in kinds if k not in _MATCHED)


_MATCHED = {
    "straggler_flagged",
    "hang_detected",
    "interruption",
    "page",
    "evict_rank",
    "quarantine_node",
    "rollback",
    "drain_node",
}


def _straggler_cost(replayed: Replayed, rank: int) -> float:
    costs = [d.straggler_cost for d in replayed.derived if isinstance(d, EvictionDecision) and d.rank == rank]
    return max(costs) if costs else 0.0


def _straggle_end(baseline: Replayed, rank: int, facts: RunFacts) -> float:
    """When the straggle ended without an eviction: its clearing in the recording, else
    the run's end (an eviction in the recording hides the rest of it: open loop)."""
    cleared = [d.ts for d in baseline.derived if isinstance(d, StragglerCleared) and d.rank == rank]
    return min(cleared) if cleared else facts.end_ts


def _price(key: Key, base: Act | None, cand: Act | None, b: Replayed, c: Replayed, facts: RunFacts) -> Row:
    kind, subject = key
    if kind == "evict":
        rank = int(subject.split()[1])
        f = max(_straggler_cost(b, rank), _straggler_cost(c, rank))
        saving = cost_model.eviction_saving(
            facts, f, base.ts if base else None, cand.ts if cand else None, _straggle_end(b, rank, facts)
        )
        rule = f"eviction: {f:.3f} of throughput until evicted, R {facts.restart_s:.1f} s"
        return Row(kind, subject, base, cand, saving, rule)
    if kind == "hang detected":
        saving = cost_model.detection_saving(base.ts if base else None, cand.ts if cand else None)
        return Row(kind, subject, base, cand, saving, "hang: the job is stalled until detection")
    if kind == "rollback" and base is not None and cand is not None:
        saving = cost_model.rollback_saving(facts, base.step, cand.step)
        return Row(kind, subject, base, cand, saving, f"rollback: steps re-done x {facts.step_s:.3f} s")
    return Row(kind, subject, base, cand, None, "not modelled (no job time)")


def _capacity_row(
    key: Key, x: Act | None, y: Act | None, base: PolicyRun, cand: PolicyRun, facts: RunFacts
) -> Row:
    """Wait against shrink for one loss (cost_model: capacity), from what the recording
    measured of the baseline's choice."""
    attempt = int(key[1].split()[1])
    b, c = _capacity_of(base.replayed, attempt), _capacity_of(cand.replayed, attempt)
    if b is None or c is None or b.capacity == c.capacity:
        return Row(key[0], key[1], x, y, None, "not modelled (no capacity decision to compare)")
    recovered = {r.interruption_id: r for r in base.replayed.derived if isinstance(r, InterruptionRecovered)}
    # R: restarts onto a ready node (not a wait for a replacement, a shrink or a grow-back)
    elastic_ids = {
        d.interruption_id for d in base.replayed.commands if isinstance(d, InterruptionDecided) and d.capacity
    }
    elastic_ids |= {
        d.interruption_id
        for d in base.replayed.derived
        if isinstance(d, Interruption) and d.cause == InterruptionCause.ELASTIC
    }
    ready = [r.restart_s for r in recovered.values() if r.interruption_id not in elastic_ids]
    restart = statistics.median(ready) if ready else cand.policy.eviction.default_restart_s
    updates = [d for d in cand.replayed.derived if isinstance(d, IntervalUpdate)]
    schedule = cost_model.interval_schedule(updates, cand.policy.interval.initial_s)
    boundary = [s for start, s in schedule if start <= c.issued_ts][-1] / 2
    shrinking = c if c.capacity == "shrink" else b
    full = max(facts.world_size, shrinking.world_size or 0)
    width = (shrinking.world_size or full) / full
    waited = recovered.get(b.interruption_id)
    if b.capacity == "wait":  # the recording waited the replacement out
        if waited is None:
            return Row(key[0], key[1], x, y, None, "not modelled (the wait never ended in the recording)")
        elastic = cand.policy.elastic
        saving = cost_model.waited_saving(
            waited.restart_s, restart, width, elastic.shrink_prior_s, elastic.grow_prior_s, boundary
        )
        rule = (
            f"capacity: waited {waited.restart_s:,.0f} s (R {restart:,.0f} s); at {width:.2%} of the world: "
            f"re-forming {elastic.shrink_prior_s:,.0f} s, growing back {elastic.grow_prior_s:,.0f} s, "
            f"{boundary:,.0f} s to the checkpoint"
        )
        return Row(key[0], key[1], x, y, saving, rule)
    grow = next(
        (
            d
            for d in base.replayed.derived
            if isinstance(d, Interruption)
            and d.cause == InterruptionCause.ELASTIC
            and d.caused_by[:1] == [b.interruption_id]
        ),
        None,
    )
    grown = recovered.get(grow.interruption_id) if grow is not None else None
    if waited is None or grow is None or grown is None:
        return Row(key[0], key[1], x, y, None, "not modelled (the smaller world never grew back)")
    cost = waited.restart_s + (1 - width) * max(0.0, grow.ts - waited.ts) + grown.restart_s
    saving = cost_model.shrunk_saving(cost, grow.ts - b.issued_ts, restart, boundary)
    rule = (
        f"capacity: the smaller world cost {cost:,.0f} s (shrink, {1 - width:.2%} of its time, grow); "
        f"grown back {grow.ts - b.issued_ts:,.0f} s after the loss, R {restart:,.0f} s"
    )
    return Row(key[0], key[1], x, y, saving, rule)


def _capacity_of(replayed: Replayed, attempt: int) -> InterruptionDecided | None:
    return next(
        (
            c
            for c in replayed.commands
            if isinstance(c, InterruptionDecided) and c.capacity is not None and c.attempt == attempt
        ),
        None,
    )


def _interval_row(base: PolicyRun, cand: PolicyRun, facts: RunFacts) -> Row | None:
    def schedule(run: PolicyRun) -> list[tuple[float, float]]:
        updates = [d for d in run.replayed.derived if isinstance(d, IntervalUpdate)]
        return cost_model.interval_schedule(updates, run.policy.interval.initial_s)

    b, c = schedule(base), schedule(cand)
    if [s for _, s in b] == [s for _, s in c]:
        return None
    saving = cost_model.interval_saving(facts, b, c)
    text = f"C/T + T/2M with C {facts.checkpoint_s:.3f} s, M {facts.mtbf_s / 3600:.1f} h"

    def act(schedule_: list[tuple[float, float]]) -> Act:
        start, interval = schedule_[-1]
        return Act(("checkpoint interval", "run"), -1, max(start, facts.start_ts), f"{interval:.0f} s")

    return Row("checkpoint interval", "run", act(b), act(c), saving, text)


def _drain_row(
    key: Key,
    x: Act | None,
    y: Act | None,
    base: PolicyRun,
    cand: PolicyRun,
    facts: RunFacts,
    failures: list[RecordedFailure],
) -> Row:
    """A node drained by one policy only, or at another time (replay/prediction_backtest.py)."""
    node = key[1]
    b = drain_value(node, x.ts, failures, facts, base.policy) if x is not None else None
    c = drain_value(node, y.ts, failures, facts, cand.policy) if y is not None else None
    saving = (c.value_s if c else 0.0) - (b.value_s if b else 0.0)
    valued = c if c is not None else b
    return Row(key[0], node, x, y, saving, valued.rule if valued is not None else "")


def differences(base: PolicyRun, cand: PolicyRun, facts: RunFacts) -> list[Row]:
    a, b = acts_of(base.replayed), acts_of(cand.replayed)
    failures = recorded_failures(base.replayed)
    rows = []
    for key in sorted(
        set(a) | set(b), key=lambda k: min(x.ts for x in (a.get(k), b.get(k)) if x is not None)
    ):
        x, y = a.get(key), b.get(key)
        if x is not None and y is not None and (x.step, x.ts) == (y.step, y.ts):
            continue
        if key[0] == "capacity":
            rows.append(_capacity_row(key, x, y, base, cand, facts))
            continue
        if key[0] == "drain":
            rows.append(_drain_row(key, x, y, base, cand, facts, failures))
            continue
        rows.append(_price(key, x, y, base.replayed, cand.replayed, facts))
    if (interval := _interval_row(base, cand, facts)) is not None:
        rows.append(interval)
    counts_a, counts_b = _counts(base.replayed), _counts(cand.replayed)
    for kind in sorted(set(counts_a) | set(counts_b)):
        if counts_a[kind] != counts_b[kind]:
            counts = (counts_a[kind], counts_b[kind])
            rows.append(Row(kind, "count", None, None, None, "compared by count; not modelled", counts))
    return rows


def measured_goodput(replayed: Replayed) -> float | None:
    """The core's goodput accounting of the run at the end of the replay (the same as the
    widest GoodputReport it would publish next)."""
    return replayed.goodput


def backtest(
    recording: Recording,
    policies: Sequence[tuple[str, CorePolicy]],
    progress: Callable[[str, int, int], None] | None = None,
    processes: int | None = None,
) -> Backtest:
    """Replay `recording` under each policy (the first is the baseline) and price the
    decisions that differ from the baseline's. The policies are spread over `processes`
    (default: one a usable CPU, replay/parallel.py); each process makes one pass over
    the log, each record decoded once and folded into every policy's core of its share."""
    if not policies:
        raise ValueError("backtest needs at least one policy")
    log = LogColumns()
    shares = [policy for _, policy in policies]
    replayed = replay_spread(
        recording,
        shares,
        progress=progress,
        observe=log.add,
        processes=processes,
        observe_stored=log.add_stored,
    )
    runs = [PolicyRun(name, policy, r) for (name, policy), r in zip(policies, replayed, strict=True)]
    base = runs[0]
    mtbf = [d.mtbf_s for d in base.replayed.derived if isinstance(d, MtbfUpdate)]
    recovered = [d for d in base.replayed.derived if isinstance(d, InterruptionRecovered)]
    facts = cost_model.measure(
        log, recovered, mtbf[-1] if mtbf else float("inf"), base.policy.eviction.default_restart_s
    )
    base.goodput = measured_goodput(base.replayed)
    failures, nodes = recorded_failures(base.replayed), node_count(facts.world_size, log.ranks_per_node)
    for run in runs:
        run.prediction = backtest_prediction(run.replayed, failures, facts, run.policy, nodes)
    for run in runs[1:]:
        run.rows = differences(base, run, facts)
        run.saving_s = sum(r.saving_s for r in run.rows if r.saving_s is not None)
        if base.goodput is not None and facts.elapsed_s > 0:
            run.goodput = min(1.0, max(0.0, base.goodput + run.saving_s / facts.elapsed_s))
    return Backtest(recording.run_id, facts, log, runs)


def decisions_count(run: PolicyRun) -> int:
    return len(run.replayed.derived) + len(run.replayed.commands)
