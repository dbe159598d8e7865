"""The glue between raw Kafka values and the pure core, shared by every driver.

`CoreDriver.handle(value)` decodes one telemetry record, folds its events into the
core, signs the commands the core decided, and returns what to publish and what to
dead-letter. It does no I/O itself, so the faust app, the replay engine and the tests
run exactly the same code path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..schemas import Command, Derived, Envelope, Rejection, encode
from ..schemas.auth import run_key, sign
from ..schemas.codec import DecodedParts, RejectReason, decode_parts, event_of
from ..schemas.columnar import StepColumns, row, rows
from ..schemas.event_check import Row
from ..schemas.record_columns import StoredColumns
from .core import CorePolicy, CoreState, Output, step
from .core.folds.block import QuietLimits, fold_block
from .core.folds.quiet import fold_quiet_row
from .core.folds.stored import fold_stored
from .core.outputs import Forward, Reject
from .core.state import state_key

log = logging.getLogger("trainguard.processor")


@dataclass
class DriverResult:
    derived: list[Derived] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    #: Events to re-publish to their run's shard 0 (schemas/sharding.py).
    forwards: list[Envelope] = field(default_factory=list)
    events: int = 0
    duplicates: int = 0
    #: The CoreState.runs key the record's events were folded into (None: no event).
    state_key: str | None = None


@dataclass
class CoreDriver:
    policy: CorePolicy
    master_secret: bytes
    state: CoreState = field(default_factory=CoreState)
    #: Fold a columnar block's quiet rows as columns (processors/core/folds/block.py) and quiet
    #: heartbeats, step stats and GPU health without ``step`` (processors/core/folds/quiet.py); False folds
    #: every event with ``step`` (the reference both must equal).
    columnar: bool = True
    _keys: dict[str, bytes] = field(default_factory=dict)
    _limits: QuietLimits = field(init=False)

    def __post_init__(self) -> None:
        self._limits = QuietLimits(self.policy)

    def _registered_world_size(self, run_id: str) -> int | None:
        run = self.state.runs.get(run_id)
        return run.world_size if run is not None else None

    def key(self, run_id: str) -> bytes:
        if run_id not in self._keys:
            self._keys[run_id] = run_key(self.master_secret, run_id)
        return self._keys[run_id]

    def handle(self, value: bytes) -> DriverResult:
        return self.fold(self.decode(value))

    def decode(self, value: bytes) -> DecodedParts:
        """One telemetry record decoded against this core's knowledge of its run (the
        run's registered world size bounds its ranks). The decoder rejects bad input with
        its reason; should it fail on some input (a bug), the record is parked whole as a
        core error rather than wedging the stream on it."""
        try:
            return decode_parts(value, registered=self._registered_world_size)
        except Exception as exc:  # noqa: BLE001 - a decoder bug must not wedge the stream
            log.exception("the decoder failed on a record of %d bytes", len(value))
            detail = f"the decoder failed: {type(exc).__name__}: {exc}"
            return DecodedParts(None, [], [Rejection(RejectReason.CORE_ERROR, detail, value)])

    def decoded_still_valid(self, decoded: DecodedParts) -> bool:
        """`decoded`, made by another core at the same point of the same log, is what
        this core would decode: both know the run with the same world size. A backtest's
        pass decodes each record once for all its policies (replay/replay.py replay_all)."""
        header = decoded.header
        if header is None:
            return False  # a lone event is checked against its own run: decode it again
        return self._registered_world_size(header.run_id) == decoded.registered

    def fold(self, decoded: DecodedParts) -> DriverResult:
        """Fold a decoded record into the core (parts are read, never changed)."""
        parts = decoded.parts
        result = DriverResult(rejections=list(decoded.rejections))
        header = decoded.header
        hint, shard, shard_ranks = (
            (None, 0, 0) if header is None else (header.world_size, header.shard, header.shard_ranks)
        )
        # A batch holds one shard of one run (decode_parts rejects other runs' events):
        # count its duplicates once per batch, not per event.
        run_id = header.run_id if header is not None else parts[0].run_id if parts else None  # type: ignore[union-attr]
        key = result.state_key = state_key(run_id, shard) if run_id is not None else None
        runs = self.state.runs
        before = runs[key].duplicates if key in runs else 0
        events = 0
        quiet_rows = self.columnar and key is not None
        for part in parts:
            if isinstance(part, tuple):  # a common heartbeat, step stats or GPU health (event_check.py)
                events += 1
                if not (quiet_rows and fold_quiet_row(runs.get(key), part, self._limits, hint)):  # type: ignore[arg-type]
                    self._fold(event_of(part), result, hint, shard, shard_ranks)
            elif isinstance(part, StepColumns):
                events += len(part)
                if self.columnar:
                    self._fold_block(part, result, hint, shard, shard_ranks)
                else:
                    for event in rows(part):
                        self._fold(event, result, hint, shard, shard_ranks)
            else:
                events += 1
                self._fold(part, result, hint, shard, shard_ranks)
        result.events = events
        if key in runs:
            result.duplicates = runs[key].duplicates - before
        return result

    def fold_stored(self, stored: StoredColumns, i: int) -> DriverResult | None:
        """Fold record i of a run the archive keeps as columns (replay/stored.py), with the
        state and outputs of folding its decoded bytes; None where it has to be folded from
        its bytes (fold_stored_many)."""
        result = DriverResult()
        if self.fold_stored_many(stored, i, i + 1, result) == i:
            return None
        return result

    def fold_stored_many(self, stored: StoredColumns, start: int, end: int, result: DriverResult) -> int:
        """Fold records start, start + 1, ... of a run the archive keeps as columns into
        `result` (their outputs in order, their events and duplicates added, state_key the
        last one's), with the state and outputs of folding their decoded bytes, up to `end`
        or the first that has to be folded from its bytes, whose index it returns: one not
        stored, or of a run this core knows with another world size than the batch's (which
        the writer decoded against); with `columnar` False, every record (the reference folds
        each event with ``step``). The loop runs compiled (processors/core/folds/stored.py)."""
        if not self.columnar:
            return start
        block, counts = stored.block, [0, 0]

        def one_row(part: Row, hint: int, shard: int, shard_ranks: int) -> None:
            self._fold(event_of(part), result, hint, shard, shard_ranks)

        def one_timing(i: int, run_id: str, node: str, hint: int, shard: int, shard_ranks: int) -> None:
            self._fold(row(block, i, run_id, node), result, hint, shard, shard_ranks)

        runs, slot = self.state.runs, stored.slot
        j = fold_stored(
            runs, slot, stored.records, block, start, end, self._limits, one_row, one_timing, counts
        )
        if j > start:
            last = stored.records[slot[j - 1]]
            result.state_key = state_key(last.run_id, last.shard)
            result.events += counts[0]
            result.duplicates += counts[1]
        return j

    def _fold(
        self, event: Envelope, result: DriverResult, hint: int | None, shard: int, shard_ranks: int
    ) -> None:
        try:
            _, outputs = step(self.state, event, self.policy, hint, shard, shard_ranks)
        except Exception as exc:  # noqa: BLE001 - a core bug must not wedge the stream
            # Parked with its reason, like bad input; the replay meets the same error at
            # the same event, so live and replay still agree.
            log.exception("the core failed on event %s of run %s", event.event_id, event.run_id)
            result.rejections.append(
                Rejection(RejectReason.CORE_ERROR, f"{type(exc).__name__}: {exc}", encode(event))
            )
            return
        if outputs:
            self._collect(outputs, result)

    def _fold_block(
        self, block: StepColumns, result: DriverResult, hint: int | None, shard: int, shard_ranks: int
    ) -> None:
        """A columnar block: its quiet rows folded as columns, the others one by one
        (processors/core/folds/block.py), with the same state and outputs as its rows."""
        key, runs = state_key(block.run_id, shard), self.state.runs
        fold_block(
            runs.get(key),
            block,
            self._limits,
            hint,
            lambda i: self._fold(row(block, i), result, hint, shard, shard_ranks),
            lambda: runs.get(key),
        )

    def _collect(self, outputs: list[Output], result: DriverResult) -> None:
        for output in outputs:
            if isinstance(output, Command):
                result.commands.append(sign(output, self.key(output.run_id)))
            elif isinstance(output, Forward):
                result.forwards.append(output.event)
            elif isinstance(output, Reject):
                result.rejections.append(Rejection(output.reason, output.detail, encode(output.event)))
            else:
                result.derived.append(output)
