"""Lemon nodes (issue 46; Kokolis et al., HPCA 2025): the machines behind repeated job
failures, found in the history of every run the archive holds, and kept out of the next
launch with the reason. The one rule, pure: it reads no clock (``now_ts`` is given) and
imports nothing of the project; the archive's side is sinks/node_history.py, the
launcher's producers/launcher/lemons.py.

What the archive holds about a node, one :class:`NodeRecord` each (``kind``):

  crash, hang, sdc  an interruption of a run whose culprit is the node
  quarantine        the core took the node out of the pool (its Quarantine event or its
                    QuarantineNode command: a crash's or hang's culprit, a device an SDC
                    check proved wrong, a spare that failed its self-test, a lost host)
  self_test         the node failed a known-answer self-test (a spare's, an operator's)
  retest            a quarantined node failed the self-test it was given before it could
                    return (it confirms the failure it was tested for)
  released          the core gave a quarantine back (QuarantineReleased: the same step
                    failed on other nodes, data or code; or a passing self-test)
  planned           a planned stop took the node out (an eviction, a drain before a
                    predicted failure, an elastic grow-back): no failure

A failure is counted once per (run, attempt, node), however many records it left (an
interruption, its quarantine and the command are one failure), and only where the core
took the node out or a self-test failed it:

- an interruption that names a culprit the core did not take out does not count: the
  core declines only when the same step failed before on another node, data or code;
- a quarantine released later does not count: the run's fault, not the node's;
- a planned stop does not count, unless a crash, hang or SDC of the node came in the
  same attempt;
- a failed retest counts with the failure it was given for (the node's latest counted
  failure in that run, at or before its attempt), by itself only when there is none.

A node is a lemon with at least ``min_failures`` failures whose first record lies within
the last ``window_days`` before ``now_ts``; its reason names them, e.g.
``node-0007: 3 failures in 30 days across runs run-a, run-b: crash in run-a on
2024-05-02 (rank 5 exited with signal 9); ...``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

DAY_S = 86_400.0
#: Interruption causes that blame their culprit node (the archive's NODE_KILL_CAUSES).
INTERRUPTIONS = ("crash", "hang", "sdc")
#: Record kinds that take a node out on their own.
TAKEN_OUT = ("quarantine", "self_test")
KINDS = (*INTERRUPTIONS, *TAKEN_OUT, "retest", "released", "planned")
#: The longest a failure's detail gets in the reason (the reason stays a sentence).
DETAIL_CHARS = 160
#: Reason.text's limit (schemas/base.py).
REASON_CHARS = 2000


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One archived record about a node (the rule's input; sinks/node_history.py reads them)."""

    node: str
    run_id: str
    attempt: int
    ts: float
    kind: str  # one of KINDS; another is ignored
    detail: str = ""


@dataclass(frozen=True, slots=True)
class LemonPolicy:
    #: Failures within the window that make a lemon (< 1: no node is ever one).
    min_failures: int = 3
    #: How far back the history counts, in days.
    window_days: float = 30.0

    def __post_init__(self) -> None:
        if not self.window_days > 0:
            raise ValueError(f"window_days must be > 0, got {self.window_days}")


@dataclass(frozen=True, slots=True)
class Failure:
    """One counted failure of a node: where, when (its first record) and what."""

    node: str
    run_id: str
    attempt: int
    ts: float
    kind: str  # crash, hang, sdc, quarantine or self_test
    detail: str

    def describe(self) -> str:
        day = time.strftime("%Y-%m-%d", time.gmtime(self.ts))
        what = self.kind.replace("_", "-")
        detail = _clip(self.detail)
        return f"{what} in {self.run_id} on {day}" + (f" ({detail})" if detail else "")


@dataclass(frozen=True, slots=True)
class Lemon:
    node: str
    failures: tuple[Failure, ...]  # in time order
    window_days: float
    reason: str

    @property
    def runs(self) -> tuple[str, ...]:
        """The runs its failures happened in, first failure first."""
        return tuple(dict.fromkeys(f.run_id for f in self.failures))


def failures(records: Iterable[NodeRecord], policy: LemonPolicy, now_ts: float) -> dict[str, list[Failure]]:
    """Each node's counted failures within the window, in time order (nodes without any
    are left out)."""
    groups: dict[tuple[str, str, int], list[NodeRecord]] = {}
    for rec in records:
        if rec.node and rec.kind in KINDS:
            groups.setdefault((rec.node, rec.run_id, rec.attempt), []).append(rec)
    counted: dict[tuple[str, str], list[Failure]] = {}  # (node, run) -> its failures
    retests: list[list[NodeRecord]] = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2])):
        found = _failure(groups[key])
        if found is not None:
            counted.setdefault(key[:2], []).append(found)
        elif _only_retests(groups[key]):
            retests.append(groups[key])
    for group in retests:  # with the failure they confirm, else a failure of their own
        first = min(group, key=lambda r: r.ts)
        earlier = [f for f in counted.get((first.node, first.run_id), []) if f.attempt <= first.attempt]
        if not earlier:
            failure = Failure(first.node, first.run_id, first.attempt, first.ts, "self_test", first.detail)
            counted.setdefault((first.node, first.run_id), []).append(failure)
    cutoff = now_ts - policy.window_days * DAY_S
    out: dict[str, list[Failure]] = {}
    for (node, _), of_run in counted.items():
        out.setdefault(node, []).extend(f for f in of_run if f.ts >= cutoff)
    return {node: sorted(fs, key=lambda f: (f.ts, f.run_id)) for node, fs in out.items() if fs}


def lemons(records: Iterable[NodeRecord], policy: LemonPolicy, now_ts: float) -> list[Lemon]:
    """The lemons, by node name, each with its reason."""
    if policy.min_failures < 1:
        return []
    found = failures(records, policy, now_ts)
    return [
        Lemon(node, tuple(fs), policy.window_days, reason(node, fs, policy.window_days))
        for node, fs in sorted(found.items())
        if len(fs) >= policy.min_failures
    ]


def reason(node: str, found: list[Failure], window_days: float) -> str:
    """``node-0007: 3 failures in 30 days across runs a, b: crash in a on 2024-05-02 (...); ...``"""
    runs = list(dict.fromkeys(f.run_id for f in found))
    where = f"in run {runs[0]}" if len(runs) == 1 else f"across runs {', '.join(runs)}"
    plural = "failure" if len(found) == 1 else "failures"
    head = f"{node}: {len(found)} {plural} in {window_days:g} days {where}: "
    text = head + "; ".join(f.describe() for f in found)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _failure(group: list[NodeRecord]) -> Failure | None:
    """The failure one (run, attempt, node) counts for, or None (see the module's rules)."""
    kinds = {r.kind for r in group}
    if "released" in kinds or not kinds & set(TAKEN_OUT):
        return None
    blamed = [r for r in group if r.kind in INTERRUPTIONS]
    if "planned" in kinds and not blamed:
        return None
    first = min(group, key=lambda r: r.ts)
    # What the reason says: the interruption, else the failed self-test, else the quarantine.
    telling = min(
        blamed or [r for r in group if r.kind in TAKEN_OUT], key=lambda r: (r.kind == "quarantine", r.ts)
    )
    return Failure(first.node, first.run_id, first.attempt, first.ts, telling.kind, telling.detail)


def _only_retests(group: list[NodeRecord]) -> bool:
    """A failed retest is all that took the node out in this attempt (besides, maybe, an
    interruption that names it)."""
    kinds = {r.kind for r in group}
    return "retest" in kinds and not kinds & {"released", "planned", *TAKEN_OUT}


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."
