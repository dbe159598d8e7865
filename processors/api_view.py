"""The run API's projection (:mod:`.api`): what the core emits but does not keep, folded
from the processor's own outputs (see the API module's docstring, "The timeline").
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..schemas import (
    Command,
    Derived,
    EvictionDecision,
    Interruption,
    InterruptionDecided,
    InterruptionRecovered,
    IntervalUpdate,
    Page,
    Quarantine,
    QuarantineNode,
    QuarantineReleased,
    Reason,
    ReleaseNode,
    ResumeRejected,
    SdcMismatch,
    StragglerDiagnosed,
)

#: Interruptions a run's timeline keeps (Llama 3 saw 419 in 54 days on 16,384 GPUs).
MAX_INTERRUPTIONS = 10_000
#: Recent decisions kept per run to attach to an interruption declared after them (a
#: hang's abort comes before the interruption its stack dumps conclude).
RECENT_DECISIONS = 512


# --------------------------------------------------------------------------- the projection


@dataclass(frozen=True)
class DecisionRecord:
    decision_id: str
    kind: str
    at: float
    reason_code: str
    reason: str
    caused_by: tuple[str, ...]


@dataclass
class InterruptionRecord:
    event: Interruption
    recovered: InterruptionRecovered | None = None
    decisions: dict[str, DecisionRecord] = field(default_factory=dict)

    @property
    def ids(self) -> set[str]:
        """What a decision caused by this interruption names in its caused_by."""
        return {*self.event.caused_by, self.event.interruption_id, self.event.event_id}


@dataclass
class QuarantineRecord:
    node: str
    since: float
    attempt: int
    reason: str
    caused_by: tuple[str, ...]


@dataclass
class RunView:
    interruptions: OrderedDict[str, InterruptionRecord] = field(default_factory=OrderedDict)
    #: id -> (interruption_id, depth): depth 0 an id the interruption names, 1 a decision
    #: it caused (whose own decisions belong to it too, as in the archive's timeline).
    links: dict[str, tuple[str, int]] = field(default_factory=dict)
    recent: deque[DecisionRecord] = field(default_factory=lambda: deque(maxlen=RECENT_DECISIONS))
    quarantined: dict[str, QuarantineRecord] = field(default_factory=dict)
    last_mismatch: SdcMismatch | None = None


#: Derived kinds that are decisions (the archive's `decision` view); every command is one.
_DECISION_KINDS = (
    Quarantine,
    Page,
    EvictionDecision,
    IntervalUpdate,
    StragglerDiagnosed,
    QuarantineReleased,
    ResumeRejected,
)


@dataclass
class RunsView:
    """The API's projection of the processor's outputs (see the module docstring)."""

    runs: dict[str, RunView] = field(default_factory=dict)

    def observe(self, derived: Iterable[Derived], commands: Iterable[Command]) -> None:
        for event in derived:
            run = self.runs.setdefault(event.run_id, RunView())
            if isinstance(event, Interruption):
                _on_interruption(run, event)
            elif isinstance(event, InterruptionRecovered):
                if (record := run.interruptions.get(event.interruption_id)) is not None:
                    record.recovered = event
            elif isinstance(event, SdcMismatch) and (
                run.last_mismatch is None or event.ts >= run.last_mismatch.ts
            ):
                run.last_mismatch = event
            if isinstance(event, Quarantine):
                _quarantined(run, event.node, event.ts, event.attempt, event.reason, event.caused_by)
            elif isinstance(event, QuarantineReleased):  # back in the pool: not the node's fault
                run.quarantined.pop(event.node, None)
            if isinstance(event, _DECISION_KINDS):
                _on_decision(
                    run, _decision(event.event_id, event.KIND, event.ts, event.reason, event.caused_by)
                )
        for command in commands:
            run = self.runs.setdefault(command.run_id, RunView())
            if isinstance(command, QuarantineNode):  # the SDC detector's come without a Quarantine
                args = (command.issued_ts, command.attempt, command.reason, command.caused_by)
                _quarantined(run, command.node, *args)
            elif isinstance(command, ReleaseNode):
                run.quarantined.pop(command.node, None)
            elif isinstance(command, InterruptionDecided) and command.capacity is None:
                continue  # the launcher's go-ahead; a decision when it says wait or shrink (issue 45)
            reason, caused_by = command.reason, command.caused_by
            _on_decision(
                run, _decision(command.command_id, command.KIND, command.issued_ts, reason, caused_by)
            )


def _decision(decision_id: str, kind: str, at: float, reason: Reason, caused_by: list[str]) -> DecisionRecord:
    return DecisionRecord(decision_id, kind, at, reason.code.value, reason.text, tuple(caused_by))


def _quarantined(
    run: RunView, node: str, at: float, attempt: int, reason: Reason, caused_by: list[str]
) -> None:
    if node and node not in run.quarantined:  # the first one says why
        run.quarantined[node] = QuarantineRecord(node, at, attempt, reason.text, tuple(caused_by))


def _on_interruption(run: RunView, event: Interruption) -> None:
    if event.interruption_id in run.interruptions:  # re-made after a restart: same id
        return
    record = run.interruptions[event.interruption_id] = InterruptionRecord(event)
    for cause in record.ids:
        run.links.setdefault(cause, (event.interruption_id, 0))
    for _ in range(2):  # decisions made before it was declared, then the decisions they caused
        for decision in run.recent:
            _link(run, decision)
    if len(run.interruptions) > MAX_INTERRUPTIONS:
        oldest, _ = run.interruptions.popitem(last=False)
        for key in [k for k, (iid, _) in run.links.items() if iid == oldest]:
            del run.links[key]


def _on_decision(run: RunView, decision: DecisionRecord) -> None:
    run.recent.append(decision)
    _link(run, decision)


def _link(run: RunView, decision: DecisionRecord) -> None:
    for cause in decision.caused_by:
        found = run.links.get(cause)
        record = run.interruptions.get(found[0]) if found is not None else None
        if found is None or record is None:
            continue
        record.decisions.setdefault(decision.decision_id, decision)
        if found[1] == 0:
            run.links.setdefault(decision.decision_id, (found[0], 1))
        return
