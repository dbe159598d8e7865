"""The command gate: pure (no broker, no threads). It turns a raw command record into a
verdict per rank: the HMAC, the run, the attempt and the target checked, each command id
executed at most once per rank (journaled, so a restarted process remembers), every
refusal counted with its reason. The Kafka driver around it is actuator.py."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import orjson

from ...schemas import Command, Rejected, auth, decode
from ...schemas.codec import COMMANDS
from ..command_roles import OUTLIVE_THEIR_ATTEMPT

C = TypeVar("C", bound=Command)


_MAX_DETAIL = 2000


class GateOutcome(StrEnum):
    ACCEPTED = "accepted"  # authentic and for this attempt: see the per-rank verdicts
    REFUSED = "refused"
    OTHER_RUN = "other_run"  # for another run: ignored silently (cannot even be verified)


class RefuseReason(StrEnum):
    UNDECODABLE = "undecodable"  # the codec rejected it; the codec's reason is in the detail
    BAD_SIGNATURE = "bad_signature"  # forged, or tampered with after signing
    STALE_ATTEMPT = "stale_attempt"  # meant for another attempt of this run


class GateVerdict(StrEnum):
    EXECUTE = "execute"
    DUPLICATE = "duplicate"  # this rank already executed this command_id


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one record of the commands topic."""

    outcome: GateOutcome
    command: Command | None = None
    reason: RefuseReason | None = None
    detail: str = ""
    #: Local ranks the command targets (empty when refused before decoding, or not for us).
    ranks: tuple[int, ...] = ()
    #: Best-effort id and kind of an undecodable command (for its REFUSED ack); "" if unknown.
    command_id: str = ""
    command_kind: str = ""


@dataclass
class GateCounters:
    executed: int = 0
    duplicate: int = 0
    other_run: int = 0
    #: Authentic commands that target none of the local ranks.
    untargeted: int = 0
    #: Authentic commands of a kind this actuator's role does not execute (not for it: no ack).
    other_role: int = 0
    refused: dict[RefuseReason, int] = field(default_factory=dict)

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


class CommandGate:
    """Decides, without I/O beyond its journal, whether a command record may run on each
    local rank. Not thread-safe: one actuator thread owns it (set_attempt aside)."""

    def __init__(
        self,
        run_id: str,
        attempt: int,
        local_ranks: Iterable[int],
        key: bytes,
        journal_path: Path | str | None = None,
        max_ids_per_rank: int = 100_000,
        executes: Collection[type[Command]] | None = None,
    ) -> None:
        self.run_id = run_id
        #: The command kinds this gate's role executes (producers/command_roles.py:
        #: kinds_of); None: every kind. Another role's command is passed over, unacked.
        self.executes = frozenset(executes) if executes is not None else None
        self.attempt = attempt
        self.local_ranks = frozenset(local_ranks)
        self.max_ids_per_rank = max_ids_per_rank
        self.counters = GateCounters()
        self._key = key
        self._executed: dict[int, OrderedDict[str, None]] = {r: OrderedDict() for r in self.local_ranks}
        self._journal_path = Path(journal_path) if journal_path is not None else None
        self._journal: Any = None
        if self._journal_path is not None:
            self._load_journal(self._journal_path)
            self._journal = self._journal_path.open("ab")

    def set_attempt(self, attempt: int) -> None:
        """The job restarted: from now on only commands for `attempt` are accepted (and a
        node's quarantine or release from an earlier one: command_roles.OUTLIVE_THEIR_ATTEMPT)."""
        self.attempt = attempt

    # ------------------------------------------------------------------ decisions
    def check(self, raw: bytes) -> Decision:
        """Decode and authenticate one record; per-rank dedupe is :meth:`claim`'s."""
        try:
            command = decode(raw, COMMANDS)
        except Rejected as rej:
            run_id, command_id, kind = _peek(raw)
            if run_id is not None and run_id != self.run_id:
                self.counters.other_run += 1
                return Decision(GateOutcome.OTHER_RUN, detail=f"run {run_id}")
            return self._refuse(
                RefuseReason.UNDECODABLE, f"{rej.reason}: {rej.detail}", None, command_id, kind
            )
        assert isinstance(command, Command)
        if command.run_id != self.run_id:
            self.counters.other_run += 1
            return Decision(GateOutcome.OTHER_RUN, command, detail=f"run {command.run_id}")
        if not auth.verify(command, self._key):
            return self._refuse(
                RefuseReason.BAD_SIGNATURE,
                "signature does not match the run key (forged or tampered)",
                command,
            )
        earlier_but_lasting = command.attempt < self.attempt and type(command) in OUTLIVE_THEIR_ATTEMPT
        if command.attempt != self.attempt and not earlier_but_lasting:
            return self._refuse(
                RefuseReason.STALE_ATTEMPT,
                f"command is for attempt {command.attempt}, this is attempt {self.attempt}",
                command,
            )
        if self.executes is not None and type(command) not in self.executes:
            self.counters.other_role += 1
            return Decision(GateOutcome.ACCEPTED, command, detail=f"{command.KIND} is another role's")
        ranks = tuple(sorted(r for r in self.local_ranks if command.targets(r)))
        if not ranks:
            self.counters.untargeted += 1
        return Decision(GateOutcome.ACCEPTED, command, ranks=ranks)

    def claim(self, command: Command, rank: int) -> GateVerdict:
        """EXECUTE (and remember it, journal first) or DUPLICATE for `rank`."""
        seen = self._executed.setdefault(rank, OrderedDict())
        if command.command_id in seen:
            seen.move_to_end(command.command_id)
            self.counters.duplicate += 1
            return GateVerdict.DUPLICATE
        if self._journal is not None:
            self._journal.write(orjson.dumps([self.run_id, rank, command.command_id]) + b"\n")
            self._journal.flush()
            os.fsync(self._journal.fileno())
        self._remember(rank, command.command_id)
        self.counters.executed += 1
        return GateVerdict.EXECUTE

    def admit(self, raw: bytes) -> tuple[Decision, dict[int, GateVerdict]]:
        """:meth:`check` then :meth:`claim` for every targeted local rank."""
        decision = self.check(raw)
        if decision.outcome is not GateOutcome.ACCEPTED or decision.command is None:
            return decision, {}
        return decision, {rank: self.claim(decision.command, rank) for rank in decision.ranks}

    def forget(self, rank: int, command_id: str) -> bool:
        """Let `rank` execute `command_id` once more: for an owner whose own journal shows
        that the claimed execution never happened (it died between claim and handler,
        e.g. the launcher). True if the id was remembered."""
        seen = self._executed.get(rank)
        if seen is None or command_id not in seen:
            return False
        del seen[command_id]
        return True

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    # ------------------------------------------------------------------ internals
    def _refuse(
        self,
        reason: RefuseReason,
        detail: str,
        command: Command | None,
        command_id: str = "",
        kind: str = "",
    ) -> Decision:
        self.counters.refused[reason] = self.counters.refused.get(reason, 0) + 1
        ranks: tuple[int, ...] = ()
        if command is not None:
            ranks = tuple(sorted(r for r in self.local_ranks if command.targets(r)))
            command_id, kind = command.command_id, command.KIND
        return Decision(GateOutcome.REFUSED, command, reason, detail, ranks, command_id, kind)

    def _remember(self, rank: int, command_id: str) -> None:
        seen = self._executed.setdefault(rank, OrderedDict())
        seen[command_id] = None
        seen.move_to_end(command_id)
        if len(seen) > self.max_ids_per_rank:
            seen.popitem(last=False)

    def _load_journal(self, path: Path) -> None:
        """Reload executed ids; a torn last line (crash mid-write) is skipped. When the
        journal holds far more lines than are kept in memory, it is rewritten compacted."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            return
        lines = 0
        with path.open("rb") as fh:
            for line in fh:
                lines += 1
                try:
                    run_id, rank, command_id = orjson.loads(line)
                except (orjson.JSONDecodeError, ValueError, TypeError):
                    continue
                if run_id == self.run_id and isinstance(rank, int) and isinstance(command_id, str):
                    self._remember(rank, command_id)
        kept = sum(len(ids) for ids in self._executed.values())
        if lines > 2 * kept + 1000:
            tmp = path.with_suffix(path.suffix + ".tmp")
            with tmp.open("wb") as fh:
                for rank, ids in self._executed.items():
                    for command_id in ids:
                        fh.write(orjson.dumps([self.run_id, rank, command_id]) + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)


def _peek(raw: bytes) -> tuple[str | None, str, str]:
    """run_id, command_id and kind of a record the codec rejected, where readable."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, "", ""
    if not isinstance(obj, dict):
        return None, "", ""
    run_id = obj.get("run_id")
    command_id = obj.get("command_id")
    schema = obj.get("schema")
    return (
        run_id if isinstance(run_id, str) else None,
        command_id[:200] if isinstance(command_id, str) else "",
        schema.partition("/")[0][:64] if isinstance(schema, str) else "",
    )
