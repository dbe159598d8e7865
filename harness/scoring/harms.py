"""What a user suffers in a scored run, besides missed faults and false detections.

A run is judged by its decisions, not only by its detections: a page that wakes a human
for nothing, a healthy node taken out of the pool, a rollback to a checkpoint that already
holds corrupt weights, a restart into a step known to fail, a record from a rank that
does not exist reaching a detector, and the training time each fault cost.

  false page          a Page whose rule the scenario neither expects (Scenario.expect.pages)
                      nor tolerates (expect.allow_pages), and that no true fault explains:
                      `same_step` is explained by a data fault repeating at that step
                      (FaultTruth.repeat), `facilities` by a hot rack (environmental). An
                      expected rule that never paged is a missing page.
  false quarantine    a node quarantined (Quarantine, QuarantineNode) or evicted (an EVICT
                      EvictionDecision, EvictRank) that holds no hardware fault: hardware is a
                      crash or hang that strikes once, an SDC, a wrong GPU, a bit flip, or a
                      node or rank slowed; not a data fault (`repeat`), not a rack-wide slowdown
                      (environmental: evicting cannot help), never a spare. Counted in nodes,
                      not ranks. A node released afterwards with its reason (a derived event
                      or command whose kind is in RELEASE_KINDS) counts as `released` instead.
  wrong rollback      a rollback (an SDC interruption, or its Rollback command) to checkpoint
                      s for a corruption fault (sdc, wrong_gpu, bitflip) with onset o < s (the
                      issue's "at or before the onset" is right). Strictly, a checkpoint "at
                      step s" is taken after step s ran, so s = o holds the fault's output too:
                      the library places onsets off the checkpoint steps. A bit flip's onset is
                      the step of the self-check that saw it (it is armed at truth.step and
                      strikes there). The fault answered is the corruption truth on the
                      mismatch's node, else the newest one struck before the mismatch.
  restart after       an interruption at a step after a `same_step` page about that step: the
  same_step           run restarted into a step known to fail (data or code).
  phantom accepted    records from ranks >= world size that the processors did not reject
                      (sent - rejected, when the driver counts both), plus any decision that
                      names such a rank.

Goodput lost per fault (seconds of the run's time; the core's own accounting, attributed):
  - each interruption the fault caused: detection + restart + re-done work, as its
    InterruptionRecovered reports them (phases["detect"] + restart_s + lost_s; the engine's
    GPU-hour cost is world_size x that). An interruption the run never recovered from
    (the launcher gave up) costs its lost_steps x the median step time. A smaller world's
    planned grow-back (issue 45) is a cost of the loss it followed, with the time trained at
    the smaller world: (1 - W'/W) of it (the core's goodput counts it too: narrow_s).
  - a slowdown before its detection (or, undetected, until it ends): (detection - onset) x
    (1 - 1/slowdown), the share of the training time a rank `slowdown` x slower costs a
    synchronous job (goodput.py); `slowdown` is the first flag's measured compute ratio,
    or the injected factor when nothing flagged it (an upper bound: it is compute time,
    and the collective does not slow down).
Interruptions that answer no fault (a false hang, an operator restart) are `unattributed`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from trainguard.producers.simulator.scenario import Expect, FaultTruth
from trainguard.schemas import (
    Command,
    Derived,
    Diagnosis,
    EvictionDecision,
    EvictRank,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    Page,
    Quarantine,
    QuarantineNode,
    Rollback,
    SdcMismatch,
)
from trainguard.schemas.events import EvictionVerdict

#: Kinds that return a quarantined node to the pool (WP-C's release after a same_step page).
RELEASE_KINDS = frozenset({"quarantine_released", "node_released", "release_node"})
#: Truth kinds that are a fault of the node's hardware (a quarantine of their node is right).
HARDWARE = frozenset({"crash", "hang", "sdc", "wrong_gpu", "bitflip"})
#: Truth kinds a rollback answers.
CORRUPTION = frozenset({"sdc", "wrong_gpu", "bitflip"})
UNATTRIBUTED = "unattributed"
#: Flags that detect a slowdown: a rank's (straggler), a rack's or group's (WP-B).
SLOW_FLAG_KINDS = frozenset({"straggler_flagged", "group_slowdown_flagged"})


@dataclass
class Harms:
    """One run's harms; each list holds a line per harm, naming what and why."""

    false_pages: list[str] = field(default_factory=list)
    pages_right: list[str] = field(default_factory=list)
    pages_tolerated: list[str] = field(default_factory=list)
    pages_missing: list[str] = field(default_factory=list)
    false_quarantines: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    wrong_rollbacks: list[str] = field(default_factory=list)
    rollbacks: int = 0
    restarts_after_same_step: list[str] = field(default_factory=list)
    phantoms_sent: int = 0
    phantoms_rejected: int = 0
    phantoms_accepted: int = 0
    #: Truth label (truth_label) -> seconds of run time lost to it.
    lost_s: dict[str, float] = field(default_factory=dict)

    def violations(self, expect: Expect) -> list[str]:
        """What the scenario's truth forbids and happened, one line each."""
        out = [f"page missing: {rule}" for rule in self.pages_missing]
        forbidden = set(expect.must_not)
        checks = {
            "page_false": self.false_pages,
            "quarantine_innocent": self.false_quarantines,
            "rollback_after_onset": self.wrong_rollbacks,
            "restart_after_same_step": self.restarts_after_same_step,
            "phantom_accepted": [f"{self.phantoms_accepted} phantom record(s) accepted"]
            if self.phantoms_accepted
            else [],
        }
        for name, found in checks.items():
            if name in forbidden:
                out += [f"{name}: {line}" for line in found]
        return out


def truth_label(truth: FaultTruth) -> str:
    where = truth.node if truth.rank is None else f"rank {truth.rank}"
    return f"{truth.kind} {where or truth.rack} @{truth.step}"


def assess(
    truths: Sequence[FaultTruth],
    outputs: Iterable[Derived | Command],
    expect: Expect | None = None,
    world_size: int | None = None,
    phantoms: tuple[int, int] | None = None,
    racks: dict[str, str] | None = None,
    step_started_ts: dict[int, float] | None = None,
) -> Harms:
    """The harms of one run's decisions (derived events, and commands where the driver
    kept them) against its truth. `phantoms`: (records sent, records rejected)."""
    expect = expect or Expect()
    outputs = list(outputs)
    racks = racks or {}
    harms = Harms()
    _pages(harms, truths, outputs, expect, racks)
    _quarantines(harms, truths, outputs)
    _rollbacks(harms, truths, outputs)
    _phantoms(harms, outputs, world_size, phantoms)
    harms.lost_s = _lost(truths, outputs, racks, step_started_ts or {})
    return harms


# --------------------------------------------------------------------------- pages


def _page_explained(page: Page, truths: Sequence[FaultTruth], racks: dict[str, str]) -> bool:
    if page.rule == "same_step":  # the interruption's step is the last completed one
        return any(t.repeat and t.step - 1 <= page.step <= t.step for t in truths)
    if page.rule == "facilities":  # a hot aisle: the whole rack hot (FaultTruth.diagnosis)
        rack = racks.get(page.node, page.node)
        return any(t.diagnosis == Diagnosis.ENVIRONMENTAL and t.rack == rack for t in truths)
    return False


def _pages(
    harms: Harms,
    truths: Sequence[FaultTruth],
    outputs: list[Derived | Command],
    expect: Expect,
    racks: dict[str, str],
) -> None:
    paged: set[str] = set()
    same_step: list[Page] = []
    for output in outputs:
        if isinstance(output, Page):
            line = f"{output.rule} at step {output.step}: {output.reason.text}"
            paged.add(output.rule)
            if output.rule in expect.pages or _page_explained(output, truths, racks):
                harms.pages_right.append(line)
            elif output.rule in expect.allow_pages:
                harms.pages_tolerated.append(line)
            else:
                harms.false_pages.append(line)
            if output.rule == "same_step":
                same_step.append(output)
    harms.pages_missing = [rule for rule in expect.pages if rule not in paged]
    counted: set[str] = set()
    for page in same_step:
        for output in outputs:
            if (
                isinstance(output, Interruption)
                and output.step == page.step
                and output.ts >= page.ts
                and output.interruption_id not in page.evidence
                and output.interruption_id not in counted
            ):
                counted.add(output.interruption_id)
                harms.restarts_after_same_step.append(
                    f"attempt {output.attempt} failed at step {output.step} again after the same_step page"
                )


# --------------------------------------------------------------------------- quarantines


def _faulty_nodes(truths: Sequence[FaultTruth]) -> set[str]:
    nodes = set()
    for truth in truths:
        if truth.node is None or truth.repeat:
            continue
        if truth.kind in HARDWARE or truth.kind == "slow":
            nodes.add(truth.node)
    return nodes


def _quarantines(harms: Harms, truths: Sequence[FaultTruth], outputs: list[Derived | Command]) -> None:
    faulty = _faulty_nodes(truths)
    removed: dict[str, str] = {}  # node -> why, first decision only (nodes, not ranks)
    released: set[str] = set()
    for output in outputs:
        node, why = "", ""
        if isinstance(output, Quarantine | QuarantineNode):
            node = output.node
            why = f"quarantined at step {getattr(output, 'step', '?')}: {output.reason.text}"
        elif isinstance(output, EvictionDecision) and output.decision == EvictionVerdict.EVICT:
            node, why = (
                output.node,
                f"evicted (rank {output.rank}) at step {output.step}: {output.reason.text}",
            )
        elif isinstance(output, EvictRank):
            node, why = "", ""  # named by its EvictionDecision
        elif getattr(output, "KIND", "") in RELEASE_KINDS:
            released.add(str(getattr(output, "node", "")))
        if node and node not in removed:
            removed[node] = why
    for node, why in removed.items():
        if node in faulty:
            continue
        (harms.released if node in released else harms.false_quarantines).append(f"{node} {why}")


# --------------------------------------------------------------------------- rollbacks


def _answered(mismatch: SdcMismatch | None, truths: Sequence[FaultTruth]) -> FaultTruth | None:
    corrupt = [t for t in truths if t.kind in CORRUPTION]
    if mismatch is None:
        return min(corrupt, key=lambda t: t.step, default=None)
    same_node = [t for t in corrupt if t.node == mismatch.node and t.step <= mismatch.step + 1]
    if same_node:
        return min(same_node, key=lambda t: t.step)
    struck = [t for t in corrupt if t.step <= mismatch.step + 1]
    return max(struck, key=lambda t: t.step, default=None)


def _rollbacks(harms: Harms, truths: Sequence[FaultTruth], outputs: list[Derived | Command]) -> None:
    mismatches = {o.event_id: o for o in outputs if isinstance(o, SdcMismatch)}
    targets: dict[str, int] = {}  # the mismatch a rollback answers -> checkpoint step
    for output in outputs:
        if isinstance(output, Interruption) and output.cause == InterruptionCause.SDC:
            targets.setdefault(
                output.caused_by[0] if output.caused_by else output.event_id, output.last_checkpoint_step
            )
        elif isinstance(output, Rollback):
            targets.setdefault(
                output.caused_by[0] if output.caused_by else output.command_id, output.checkpoint_step
            )
    harms.rollbacks = len(targets)
    for cause, target in targets.items():
        found = mismatches.get(cause)
        truth = _answered(found, truths)
        if truth is None:
            continue
        # a bit flip is armed at truth.step and strikes in the check that sees it
        onset = found.step if truth.kind == "bitflip" and found is not None else truth.step
        if target <= onset:
            continue
        harms.wrong_rollbacks.append(
            f"rollback to checkpoint {target} for {truth_label(truth)}: taken after the onset "
            f"(step {onset}), it holds the fault's output"
        )


# --------------------------------------------------------------------------- phantoms


def _phantoms(
    harms: Harms, outputs: list[Derived | Command], world_size: int | None, phantoms: tuple[int, int] | None
) -> None:
    if phantoms is not None:
        harms.phantoms_sent, harms.phantoms_rejected = phantoms
        harms.phantoms_accepted = max(0, phantoms[0] - phantoms[1])
    if world_size:
        named = sum(1 for o in outputs if isinstance(o, Derived) and o.rank >= world_size)
        harms.phantoms_accepted += named


# --------------------------------------------------------------------------- goodput


def _culprit_truth(
    interruption: Interruption, truths: Sequence[FaultTruth], by_id: dict[str, Derived]
) -> FaultTruth | None:
    cause = interruption.cause
    if cause == InterruptionCause.ELASTIC:  # the grow-back after a loss: that loss's cost
        loss = by_id.get(interruption.caused_by[0]) if interruption.caused_by else None
        return _culprit_truth(loss, truths, by_id) if isinstance(loss, Interruption) else None
    if cause == InterruptionCause.SDC:
        found = by_id.get(interruption.caused_by[0]) if interruption.caused_by else None
        return _answered(found if isinstance(found, SdcMismatch) else None, truths)
    if cause == InterruptionCause.EVICTION:
        rank, node = interruption.rank, interruption.node
        return next((t for t in truths if t.kind == "slow" and (t.rank == rank or t.node == node)), None)
    kinds = {
        InterruptionCause.CRASH: ("crash",),
        InterruptionCause.HANG: ("hang",),
        InterruptionCause.NON_FINITE: ("nan", "grad_spike"),
    }.get(cause, ())
    candidates = sorted(
        (t for t in truths if t.kind in kinds and t.step <= interruption.step + 1), key=lambda t: -t.step
    )
    for truth in candidates:  # the fault on the named culprit; else the newest of that kind
        if truth.rank == interruption.rank or (truth.node is not None and truth.node == interruption.node):
            return truth
    return candidates[0] if candidates else None


def _narrow_s(
    grow: Interruption, recovered: dict[str, InterruptionRecovered], grown: InterruptionRecovered | None
) -> float:
    """What a smaller world cost until its grow-back: the time from the shrink's first step
    to the planned stop, (1 - W'/W) of it (the same global batch over W' of W ranks)."""
    shrunk = recovered.get(grow.caused_by[0]) if grow.caused_by else None
    if shrunk is None or grown is None or grown.world_size <= 0:
        return 0.0
    return max(0.0, grow.ts - shrunk.ts) * max(0.0, 1.0 - shrunk.world_size / grown.world_size)


def _lost(
    truths: Sequence[FaultTruth],
    outputs: list[Derived | Command],
    racks: dict[str, str],
    step_started_ts: dict[int, float],
) -> dict[str, float]:
    by_id: dict[str, Derived] = {o.event_id: o for o in outputs if isinstance(o, Derived)}
    recovered = {o.interruption_id: o for o in outputs if isinstance(o, InterruptionRecovered)}
    interruptions = {o.interruption_id: o for o in outputs if isinstance(o, Interruption)}
    per_step = [  # the steps lost_s counts: the restart's own, else the detection's
        done.lost_s / steps
        for iid, i in interruptions.items()
        if (done := recovered.get(iid)) is not None
        and (steps := i.lost_steps if done.lost_steps is None else done.lost_steps)
    ]
    step_s = statistics.median(per_step) if per_step else 0.0
    lost: dict[str, float] = {}
    for iid, interruption in interruptions.items():
        done = recovered.get(iid)
        if done is not None:
            cost = done.phases.get("detect", 0.0) + done.restart_s + done.lost_s
        else:  # never recovered (the launcher gave up): the work it threw away
            cost = interruption.lost_steps * step_s
        if interruption.cause == InterruptionCause.ELASTIC:
            cost += _narrow_s(interruption, recovered, done)
        truth = _culprit_truth(interruption, truths, by_id)
        key = truth_label(truth) if truth is not None else UNATTRIBUTED
        lost[key] = lost.get(key, 0.0) + cost
    last_ts = max(step_started_ts.values(), default=0.0)
    for truth in truths:  # a slowdown costs the job its pace until it is detected
        onset = step_started_ts.get(truth.step)
        if truth.kind != "slow" or onset is None:
            continue
        flags = [
            o
            for o in outputs
            if o.KIND in SLOW_FLAG_KINDS
            and isinstance(o, Derived)
            and (o.node == truth.node if truth.node else racks.get(o.node, o.node) == truth.rack)
            and (truth.rank is None or o.rank == truth.rank)
        ]
        first = min(flags, key=lambda o: o.ts, default=None)
        until = step_started_ts.get(truth.until_step, last_ts) if truth.until_step is not None else last_ts
        end = min(first.ts, until) if first is not None else until
        slowdown = float(getattr(first, "slowdown", truth.factor)) if first is not None else truth.factor
        if slowdown > 1 and end > onset:
            key = truth_label(truth)
            lost[key] = lost.get(key, 0.0) + (end - onset) * (1 - 1 / slowdown)
    return lost
