"""The "nothing lost" oracle (issue 7): one reusable checker run after every fault
scenario, over what the log, the acks and the archive hold once the dust settles.

1. nothing lost: every event a producer saw acknowledged is in the telemetry log;
2. one decision per id: no decision id was published with two different contents (the
   log is at least once: the same decision twice is a redelivery, counted, not a fault);
3. replay = live: the log replayed through a fresh core gives the live decisions, event
   for event (:mod:`.replay`);
4. archive = log: the archive holds exactly the log's decisions, by id;
5. rank order: each rank's step timings of an attempt appear in step order (a
   redelivered copy, same event id, is not a reordering);
6. executed once: no command was executed twice on a rank.

Each check says what held or, when not, the exact figure and a few examples, and how many
items it covered: a check that covers nothing where items were expected fails (an empty
set of acknowledged ids proves nothing lost about nothing), see `check(expect=...)`.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainguard.processors.core import CorePolicy
from trainguard.replay.log import Recording
from trainguard.replay.replay import (
    comparable,
    compare,
    decision_id,
    decisions_of,
    replay,
    replayed_decisions,
)
from trainguard.schemas import Ack, AckStatus, Derived, StepTiming, decode_batch
from trainguard.schemas.codec import DERIVED


@dataclass(frozen=True)
class OracleVerdict:
    name: str
    held: bool
    detail: str
    #: Items the check looked at (events, decisions, executions...).
    covered: int = -1


NOTHING_LOST = "nothing lost"
ONE_DECISION = "one decision per id"
REPLAY = "replay = live"
ARCHIVE = "archive = log"
RANK_ORDER = "rank order"
EXECUTED_ONCE = "executed once per rank"
#: What every run has: acknowledged events (the caller must know which) and step timings.
ALWAYS_EXPECTED = (NOTHING_LOST, RANK_ORDER)
#: Also expected of a run with faults: decisions, their archive, and executions.
EVERY_CHECK = (NOTHING_LOST, ONE_DECISION, REPLAY, ARCHIVE, RANK_ORDER, EXECUTED_ONCE)


@dataclass
class OracleReport:
    verdicts: list[OracleVerdict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v.held for v in self.verdicts)

    def __str__(self) -> str:
        return "\n".join(f"{'ok  ' if v.held else 'FAIL'} {v.name}: {v.detail}" for v in self.verdicts)


def _examples(items: Iterable[object], n: int = 3) -> str:
    shown = list(items)[:n]
    return ", ".join(map(str, shown))


def nothing_lost(recording: Recording, acknowledged: Iterable[str]) -> OracleVerdict:
    logged = {e.event_id for _, _, value in recording.records for e in decode_batch(value).events}
    acked = set(acknowledged)
    missing = sorted(acked - logged)
    detail = f"{len(acked) - len(missing)} of {len(acked)} acknowledged events in the log"
    if missing:
        detail += f"; missing {len(missing)}, e.g. {_examples(missing)}"
    return OracleVerdict(NOTHING_LOST, not missing, detail, len(acked))


def one_decision_per_id(recording: Recording) -> OracleVerdict:
    contents: dict[str, set[str]] = defaultdict(set)
    counts: Counter[str] = Counter()
    for record in decisions_of(recording):
        key = decision_id(record)
        counts[key] += 1
        contents[key].add(str(sorted(comparable(record).items())))
    conflicting = sorted(k for k, v in contents.items() if len(v) > 1)
    redelivered = sum(n - 1 for n in counts.values())
    detail = f"{len(counts)} decisions, {redelivered} redelivered copies"
    if conflicting:
        detail += f"; {len(conflicting)} ids with two contents, e.g. {_examples(conflicting)}"
    return OracleVerdict(ONE_DECISION, not conflicting, detail, len(counts))


def replay_matches_live(recording: Recording, policy: CorePolicy) -> OracleVerdict:
    comparison = compare(decisions_of(recording), replayed_decisions(replay(recording, policy)))
    detail = f"{comparison.matched} of {comparison.recorded} recorded decisions replayed identically"
    if not comparison.identical:
        detail += f"; {len(comparison.differences)} differences, e.g. " + _examples(
            f"{d.what} {d.kind} {d.decision_id[:12]}" for d in comparison.differences
        )
    return OracleVerdict(REPLAY, comparison.identical, detail, comparison.recorded)


def archive_matches_log(recording: Recording, archive: str | Path) -> OracleVerdict:
    from trainguard.sinks.archive_store import open_snapshot

    with contextlib.closing(open_snapshot(archive)) as db:
        kinds = sorted(k for k, cls in DERIVED.items() if issubclass(cls, Derived))
        query = "SELECT event_id FROM raw_event WHERE run_id = ? AND list_contains(?, kind)"
        derived = {row[0] for row in db.execute(query, [recording.run_id, kinds]).fetchall()}
        commands = {row[0] for row in db.execute(
            "SELECT command_id FROM command WHERE run_id = ?", [recording.run_id]
        ).fetchall()}  # fmt: skip
    want_derived = {d.event_id for d in recording.derived}
    want_commands = {c.command_id for c in recording.commands}
    missing = (want_derived - derived) | (want_commands - commands)
    extra = (derived - want_derived) | (commands - want_commands)
    detail = f"{len(derived)} derived events and {len(commands)} commands archived"
    if missing or extra:
        detail += f"; missing {len(missing)} (e.g. {_examples(sorted(missing))}), extra {len(extra)}"
    return OracleVerdict(ARCHIVE, not missing and not extra, detail, len(derived) + len(commands))


def rank_order(recording: Recording) -> OracleVerdict:
    seen: set[str] = set()
    last: dict[tuple[int, int], int] = {}
    out_of_order: list[str] = []
    for _, _, value in recording.records:
        for e in decode_batch(value).events:
            if not isinstance(e, StepTiming) or e.event_id in seen:
                continue
            seen.add(e.event_id)
            key = (e.attempt, e.rank)
            if key in last and e.step <= last[key]:
                out_of_order.append(f"rank {e.rank} attempt {e.attempt}: step {e.step} after {last[key]}")
            last[key] = max(e.step, last.get(key, e.step))
    detail = f"{len(seen)} step timings of {len(last)} rank-attempts in order"
    if out_of_order:
        detail = f"{len(out_of_order)} out of order, e.g. {_examples(out_of_order)}"
    return OracleVerdict(RANK_ORDER, not out_of_order, detail, len(seen))


def executed_once(acks: Sequence[Ack]) -> OracleVerdict:
    executed = Counter((a.command_id, a.rank) for a in acks if a.status is AckStatus.EXECUTED)
    twice = sorted(k for k, n in executed.items() if n > 1)
    detail = f"{len(executed)} executions on ranks, {len(twice)} repeated"
    if twice:
        detail += f", e.g. {_examples(twice)}"
    return OracleVerdict(EXECUTED_ONCE, not twice, detail, len(executed))


def check(
    recording: Recording,
    policy: CorePolicy,
    *,
    acknowledged: Iterable[str] = (),
    acks: Sequence[Ack] = (),
    archive: str | Path | None = None,
    expect: Collection[str] = ALWAYS_EXPECTED,
) -> OracleReport:
    """Every check of the module docstring (the archive's only when one is given). A check
    named in `expect` that covered nothing fails: pass EVERY_CHECK for a run with faults."""
    report = OracleReport([
        nothing_lost(recording, acknowledged),
        one_decision_per_id(recording),
        replay_matches_live(recording, policy),
        rank_order(recording),
        executed_once(acks),
    ])  # fmt: skip
    if archive is not None:
        report.verdicts.insert(3, archive_matches_log(recording, archive))
    report.verdicts = [_covering(v) if v.name in expect else v for v in report.verdicts]
    return report


def _covering(verdict: OracleVerdict) -> OracleVerdict:
    if verdict.covered != 0:
        return verdict
    return replace(verdict, held=False, detail=f"{verdict.detail}: covers nothing where items were expected")
