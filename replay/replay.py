"""`trainguard replay`: drive the policy core with a recorded run and compare its
decisions with the ones the live processor published.

The replay runs the very code path of the live processor: each telemetry record's bytes
go through :class:`~trainguard.processors.driver.CoreDriver` (decode, fold into the
core, sign the commands), in the order the processor consumed them (:mod:`.log`). With
the policy the run used, every derived event and every command comes out again with the
same id (ids are uuid5 of their cause), the same content and in the same order; a
difference is a bug (non-determinism in the core) or a sign that the run was processed
under another policy or code version.

Decisions are compared by id. The live log is at least once, so a decision published
twice (a worker that restarted before committing) counts once. Commands are compared
without their signature: a replay need not hold the master secret.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..common.collector import old_objects_left_alone
from ..processors.core import CorePolicy, goodput
from ..processors.core.accounting.goodput import Breakdown
from ..processors.core.accounting.goodput import total as goodput_total
from ..processors.driver import CoreDriver, DriverResult
from ..schemas import Command, Derived, Record
from ..schemas.codec import DecodedParts
from ..schemas.record_columns import StoredColumns
from .log import Recording

#: The key a replay signs with when it is not given the run's secret (signatures are
#: not compared).
REPLAY_SECRET = b"trainguard-replay-does-not-sign-for-real"

Decision = Derived | Command


@dataclass
class Replayed:
    """What the core decided for the run when driven with its recorded telemetry."""

    derived: list[Derived] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    records: int = 0
    events: int = 0
    duplicates: int = 0
    rejections: int = 0
    seconds: float = 0.0
    #: The core's goodput accounting for the run at the end (processors/core/accounting/goodput.py).
    goodput: float | None = None
    breakdown: Breakdown | None = None

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


def replay(
    recording: Recording,
    policy: CorePolicy,
    secret: bytes = REPLAY_SECRET,
    progress: Callable[[int, int], None] | None = None,
    columnar: bool = True,
    columns: bool = True,
) -> Replayed:
    """Fold every telemetry record of `recording` into a fresh core under `policy`
    (`columnar` False: columnar blocks row by row, the reference the block fold equals;
    `columns` False: every record from its bytes, the archive's columns unused)."""
    tick = None if progress is None else lambda _name, done, total: progress(done, total)
    (out,) = replay_all(recording, [policy], secret, tick, columnar, columns=columns)
    return out


def replay_all(
    recording: Recording,
    policies: Sequence[CorePolicy],
    secret: bytes = REPLAY_SECRET,
    progress: Callable[[str, int, int], None] | None = None,
    columnar: bool = True,
    observe: Callable[[DecodedParts], None] | None = None,
    columns: bool = True,
    observe_stored: Callable[[StoredColumns, int], None] | None = None,
) -> list[Replayed]:
    """Replay `recording` under every policy in one pass: each record decoded once and
    folded into every policy's core in turn, then let go (a backtest of a long run holds
    one record at a time, not its whole decoded log). A policy whose core would decode
    the record otherwise (it knows the run with another world size,
    CoreDriver.decoded_still_valid) decodes it anew. `observe` sees every record as
    decoded (what a backtest measures of the log); `progress(label, done, total)`. Each
    Replayed's `seconds` is the pass's (shared by its policies). A record the archive keeps
    as columns (recording.stored) is folded from them, and `observe_stored(stored, i)` sees
    it (an `observe` without it sees every record decoded); `columns` False folds every
    record from its bytes (the reference)."""
    if not policies:
        return []
    drivers = [CoreDriver(policy, secret, columnar=columnar) for policy in policies]
    outs = [Replayed() for _ in policies]
    first, others = drivers[0], list(zip(drivers[1:], outs[1:], strict=True))
    label = "replay" if len(policies) == 1 else f"replay under {len(policies)} policies"
    total = len(recording.records)
    stored = recording.stored if columns and (observe is None or observe_stored is not None) else None
    t0 = time.perf_counter()
    with old_objects_left_alone():
        i = 0
        while i < total:
            if i and i % _COLLECT_EVERY == 0:
                gc.collect(1)
            # Up to the next collection or progress report: many stored records at once.
            until = min(total, (i // _PROGRESS_EVERY + 1) * _PROGRESS_EVERY)
            j = (
                _fold_stored(stored, i, until, first, others, outs[0], recording, observe_stored)
                if stored
                else i
            )
            if j == i:  # record i from its bytes
                value = recording.records[i][2]
                parts = first.decode(value)
                if observe is not None:
                    observe(parts)
                _add(outs[0], first.fold(parts), recording.run_id)
                for driver, out in others:
                    mine = parts if driver.decoded_still_valid(parts) else driver.decode(value)
                    _add(out, driver.fold(mine), recording.run_id)
                j = i + 1
            if progress is not None and (j % _PROGRESS_EVERY == 0 or j == total):
                progress(label, j, total)
            i = j
    seconds = time.perf_counter() - t0
    for driver, out in zip(drivers, outs, strict=True):
        out.seconds = seconds
        if (run := driver.state.runs.get(recording.run_id)) is not None:
            out.goodput, out.breakdown = goodput(run), goodput_total(run.goodput)
    return outs


#: Records folded between two collections of the young generations (old_objects_left_alone).
_COLLECT_EVERY = 2_000
#: Records folded between two progress reports (a divisor of _COLLECT_EVERY).
_PROGRESS_EVERY = 500


def _fold_stored(
    stored: StoredColumns,
    start: int,
    end: int,
    first: CoreDriver,
    others: list[tuple[CoreDriver, Replayed]],
    out: Replayed,
    recording: Recording,
    observe: Callable[[StoredColumns, int], None] | None,
) -> int:
    """Fold the stored records from `start` on (up to `end`) into every policy's core, and
    return the first the first core has to fold from its bytes (`start` when it is that
    one). Another core stopped earlier (it knows the run with another world size) folds
    the records it stopped at from their bytes."""
    result = DriverResult()
    j = first.fold_stored_many(stored, start, end, result)
    if j == start:
        return start
    _add(out, result, recording.run_id, j - start)
    for driver, mine in others:
        k = start
        while k < j:
            result = DriverResult()
            at = driver.fold_stored_many(stored, k, j, result)
            if at > k:
                _add(mine, result, recording.run_id, at - k)
            if at < j:
                _add(mine, driver.fold(driver.decode(recording.records[at][2])), recording.run_id)
                at += 1
            k = at
    if observe is not None:
        for k in range(start, j):
            observe(stored, k)
    return j


def _add(out: Replayed, result: DriverResult, run_id: str, records: int = 1) -> None:
    """The fold of one record (or `records`), counted; the run's decisions kept."""
    out.records += records
    out.events += result.events
    out.duplicates += result.duplicates
    out.rejections += len(result.rejections)
    if result.derived:  # (nearly every record decides nothing)
        out.derived += [d for d in result.derived if d.run_id == run_id]
    if result.commands:
        out.commands += [c for c in result.commands if c.run_id == run_id]


def decision_id(record: Decision) -> str:
    return record.command_id if isinstance(record, Command) else record.event_id


def comparable(record: Record) -> dict[str, Any]:
    """A decision's content as compared: everything but a command's signature."""
    data = record.model_dump(mode="json")
    data.pop("signature", None)
    return {"kind": record.KIND, **data}


def unique(records: Sequence[Decision]) -> list[Decision]:
    """First occurrence of each id (the live log is at least once)."""
    seen: set[str] = set()
    out = []
    for record in records:
        if (key := decision_id(record)) not in seen:
            seen.add(key)
            out.append(record)
    return out


@dataclass(frozen=True)
class Difference:
    what: Literal["missing", "extra", "changed", "moved"]
    decision_id: str
    kind: str
    step: int
    detail: str


@dataclass
class Comparison:
    """Recorded against replayed decisions (derived events and commands alike)."""

    recorded: int
    replayed: int
    matched: int
    differences: list[Difference]

    @property
    def identical(self) -> bool:
        return not self.differences


def compare(recorded: Sequence[Decision], replayed: Sequence[Decision]) -> Comparison:
    """Decision for decision: missing (recorded, not replayed), extra (replayed only),
    changed (same id, other content), moved (same decisions, another order)."""
    rec, rep = unique(recorded), unique(replayed)
    rec_by_id = {decision_id(r): r for r in rec}
    rep_by_id = {decision_id(r): r for r in rep}
    diffs: list[Difference] = []
    for r in rec:
        other = rep_by_id.get(decision_id(r))
        if other is None:
            diffs.append(Difference("missing", decision_id(r), r.KIND, _step(r), _text(r)))
        elif comparable(other) != comparable(r):
            changed = sorted(k for k, v in comparable(r).items() if comparable(other).get(k) != v)
            diffs.append(
                Difference("changed", decision_id(r), r.KIND, _step(r), "fields: " + ", ".join(changed))
            )
    diffs += [
        Difference("extra", decision_id(r), r.KIND, _step(r), _text(r))
        for r in rep
        if decision_id(r) not in rec_by_id
    ]
    common_rec = [decision_id(r) for r in rec if decision_id(r) in rep_by_id]
    common_rep = [decision_id(r) for r in rep if decision_id(r) in rec_by_id]
    for i, (a, b) in enumerate(zip(common_rec, common_rep, strict=True)):
        if a != b:  # report the first place the order diverges
            diffs.append(Difference("moved", a, rec_by_id[a].KIND, _step(rec_by_id[a]), f"position {i}: {b}"))
            break
    matched = sum(
        1 for r in rec if (o := rep_by_id.get(decision_id(r))) is not None and comparable(o) == comparable(r)
    )
    return Comparison(len(rec), len(rep), matched, diffs)


def _step(record: Decision) -> int:
    return int(getattr(record, "step", -1))


def _text(record: Decision) -> str:
    return record.reason.text[:160]


def decisions_of(recording: Recording) -> list[Decision]:
    """The recorded decisions, derived events then commands (each in publication order)."""
    return [*recording.derived, *recording.commands]


def replayed_decisions(replayed: Replayed) -> list[Decision]:
    return [*replayed.derived, *replayed.commands]
