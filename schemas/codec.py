"""The one serialisation used everywhere: JSON, one object per record, with a
``"schema": "<kind>/<version>"`` key.

Reading never raises on bad input: :func:`decode` raises :class:`Rejected` with a
specific :class:`RejectReason`, and :func:`decode_batch` splits a telemetry batch into
the good records and the rejected ones, so one bad event never costs its neighbours.

Versions evolve like the eventsourcing library's upcasters: an older record is
upgraded one version at a time by the functions in :data:`UPCASTERS` until it
reaches the class's current version; a record newer than this reader knows is
rejected as UNKNOWN_VERSION (and parked in the dead-letter topic by the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import orjson
from pydantic import Field, ValidationError

from .base import Envelope, Record
from .columnar import BlockError, StepColumns, StepTimings, columns_of, row, rows
from .commands import COMMAND_KINDS, Ack
from .event_check import (
    BatchHeader,
    Row,
    batch_header,
    common_row,
    is_heartbeat,
    is_stats,
)
from .events import (
    DERIVED_KINDS,
    TELEMETRY_KINDS,
    FailurePredicted,
    GpuHealth,
    Heartbeat,
    StepStats,
    StepTiming,
    StragglerCleared,
    StragglerDiagnosed,
    StragglerFlagged,
)

#: One record's JSON may not exceed this (a 16,384-rank RunStarted is ~70 KB); a batch may hold many.
MAX_RECORD_BYTES = 1024 * 1024
#: A whole Kafka record value (the telemetry topic's max.message.bytes is 8 MiB).
MAX_BATCH_BYTES = 8 * 1024 * 1024


class RejectReason(StrEnum):
    MALFORMED = "malformed"  # not UTF-8 JSON
    NOT_AN_OBJECT = "not_an_object"
    MISSING_SCHEMA = "missing_schema"
    UNKNOWN_KIND = "unknown_kind"
    UNKNOWN_VERSION = "unknown_version"
    INVALID_FIELDS = "invalid_fields"
    NON_FINITE = "non_finite"
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    OVERSIZED = "oversized"
    WRONG_RECORD_TYPE = "wrong_record_type"  # a valid record on the wrong topic
    RUN_MISMATCH = "run_mismatch"  # an event inside a batch of another run
    CORE_ERROR = "core_error"  # a valid event the core failed on (a bug): parked, not lost


class Rejected(Exception):
    """A record that cannot be accepted; `raw` is what to park in the dead-letter topic."""

    def __init__(self, reason: RejectReason, detail: str, raw: bytes = b"") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.raw = raw


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    detail: str
    raw: bytes


class Batch(Record):
    """The Kafka record value on the telemetry topic: one node's events over one flush
    interval. Batching per node is what lets one processor keep up with 16,384 ranks
    (see producers/rank/shipper.py for the arithmetic)."""

    KIND: ClassVar[str] = "batch"
    VERSION: ClassVar[int] = 2

    run_id: str = Field(min_length=1, max_length=128)
    node: str = Field(max_length=128)
    world_size: int = Field(ge=1, le=1_048_576)
    producer_id: str = Field(min_length=1, max_length=128)
    seq: int = Field(ge=0, description="Per-producer batch counter (gaps = drops upstream).")
    records: list[Any] = Field(max_length=1_000_000)
    # v2: a run larger than one worker is cut into shards (schemas/sharding.py).
    shard: int = Field(0, ge=0, description="The run's shard these events belong to.")
    shard_ranks: int = Field(0, ge=0, description="Ranks per shard; 0: the run is not sharded.")


def _registry(classes: Iterable[type[Record]]) -> dict[str, type[Record]]:
    return {cls.KIND: cls for cls in classes}


TELEMETRY: dict[str, type[Record]] = _registry(TELEMETRY_KINDS)
DERIVED: dict[str, type[Record]] = _registry(DERIVED_KINDS)
COMMANDS: dict[str, type[Record]] = _registry(COMMAND_KINDS)
ACKS: dict[str, type[Record]] = _registry([Ack])
ALL: dict[str, type[Record]] = {**TELEMETRY, **DERIVED, **COMMANDS, **ACKS, "batch": Batch}
#: What a telemetry batch's `records` may hold: any telemetry record, or a columnar block
#: of step timings (schemas/columnar.py), which stands for its rows.
BATCH_RECORDS: dict[str, type[Record]] = {**TELEMETRY, StepTimings.KIND: StepTimings}
#: What may come alone on the telemetry topic: any telemetry record, or what a shard forwards
#: to the run's shard 0, which decides: its failure predictions (the drain,
#: processors/core/decisions/drain.py) and its stragglers' flags, diagnoses and clears (the
#: eviction, processors/core/decisions/eviction.py).
LONE_RECORDS: dict[str, type[Record]] = {
    **TELEMETRY,
    **_registry([FailurePredicted, StragglerFlagged, StragglerDiagnosed, StragglerCleared]),
}

#: "kind/version" of every current telemetry class -> the class (decode_batch's fast path).
_CURRENT_TELEMETRY: dict[str, type[Envelope]] = {
    cls.schema_name(): cls for cls in TELEMETRY_KINDS if issubclass(cls, Envelope)
}

#: (kind, from_version) -> function that rewrites a from_version dict into from_version + 1.
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {
    # batch/1 predates sharding: its run is one shard.
    ("batch", 1): lambda body: {**body, "shard": 0, "shard_ranks": 0},
    # heartbeat/1 predates the phase: unknown.
    ("heartbeat", 1): lambda body: {**body, "phase": ""},
    # run_started/1 predates placement groups: the run declares none.
    ("run_started", 1): lambda body: {**body, "placement_groups": {}},
    # run_started/2 predates the spares count (issue 45): not said.
    ("run_started", 2): lambda body: {**body, "spares": None},
    # goodput_report/1 predates elastic training: no time at a smaller world.
    ("goodput_report", 1): lambda body: {**body, "narrow_s": 0.0},
    # interruption_decided/1 predates the capacity decision (issue 45): none was made.
    ("interruption_decided", 1): lambda body: {
        **body,
        "capacity": None,
        "world_size": None,
        "expected_replacement_s": None,
    },
    # gpu_health/1 predates the v2 readings (memory temperature, clocks, power, throttle
    # reasons, lifetime ECC, NVLink CRC): none of them was read.
    ("gpu_health", 1): lambda body: dict(body),
    # gpu_health/2 predates the failure precursors (issue 46): none of them was read.
    ("gpu_health", 2): lambda body: dict(body),
    # rank_exit/1 predates the job's progress at the exit: unknown.
    ("rank_exit", 1): lambda body: {**body, "job_step": -1},
    # rank_exit/2 predates peer_lost: no exit was known to be a lost peer's consequence.
    ("rank_exit", 2): lambda body: {**body, "peer_lost": False},
    # run_cross_rank_check/1 predates batch_rank: whose batch is unknown. A rank refuses
    # it either way: its signature covers the v1 body, and it could not run it without.
    ("run_cross_rank_check", 1): lambda body: {**body, "batch_rank": None},
}


def encode(record: Record) -> bytes:
    """JSON bytes of one record with its schema key first.

    pydantic's JSON encoder is used for the body (it writes non-finite floats as
    "NaN"/"Infinity" strings where a model allows them); the schema key is spliced
    in front, which is valid because the body is always a non-empty JSON object.
    """
    body = record.model_dump_json()
    return b'{"schema":"' + record.schema_name().encode() + b'",' + body[1:].encode()


def encode_batch(batch_header: dict[str, Any], encoded_records: Iterable[bytes]) -> bytes:
    """A Batch value from already-encoded records (no re-encoding of each event)."""
    header = orjson.dumps({"schema": Batch.schema_name(), **batch_header})
    return header[:-1] + b',"records":[' + b",".join(encoded_records) + b"]}"


def _split_schema(obj: Any, raw: bytes) -> tuple[str, int]:
    if not isinstance(obj, dict):
        raise Rejected(RejectReason.NOT_AN_OBJECT, f"expected a JSON object, got {type(obj).__name__}", raw)
    schema = obj.get("schema")
    if not isinstance(schema, str) or "/" not in schema:
        raise Rejected(RejectReason.MISSING_SCHEMA, "no 'schema' key of the form '<kind>/<version>'", raw)
    kind, _, version_text = schema.partition("/")
    if not version_text.isdigit():
        raise Rejected(RejectReason.MISSING_SCHEMA, f"schema {schema!r} has no integer version", raw)
    return kind, int(version_text)


def decode_obj(obj: Any, registry: dict[str, type[Record]] = ALL, raw: bytes = b"") -> Record:
    """Validate one parsed JSON object against the registry (upcasting older versions)."""
    kind, version = _split_schema(obj, raw)
    cls = registry.get(kind)
    if cls is None:
        detail = f"unknown record kind {kind!r}"
        if kind in ALL:
            raise Rejected(RejectReason.WRONG_RECORD_TYPE, f"a {kind!r} record does not belong here", raw)
        raise Rejected(RejectReason.UNKNOWN_KIND, detail, raw)
    if version > cls.VERSION:
        raise Rejected(
            RejectReason.UNKNOWN_VERSION,
            f"{kind}/{version} is newer than this reader (knows up to {kind}/{cls.VERSION})",
            raw,
        )
    body = {k: v for k, v in obj.items() if k != "schema"}
    while version < cls.VERSION:
        upcast = UPCASTERS.get((kind, version))
        if upcast is None:
            raise Rejected(RejectReason.UNKNOWN_VERSION, f"no upcaster from {kind}/{version}", raw)
        body = upcast(body)
        version += 1
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in errors[:5])
        reason = (
            RejectReason.NON_FINITE
            if any(e["type"] == "finite_number" for e in errors)
            else RejectReason.INVALID_FIELDS
        )
        raise Rejected(reason, f"{kind}/{version}: {fields}", raw) from None


def _loads(raw: bytes, limit: int) -> Any:
    if len(raw) > limit:
        raise Rejected(RejectReason.OVERSIZED, f"{len(raw)} bytes exceeds the {limit}-byte limit", raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Rejected(RejectReason.MALFORMED, f"not valid UTF-8 JSON: {exc}", raw) from None


def decode(raw: bytes, registry: dict[str, type[Record]] = ALL) -> Record:
    """One record from bytes; raises Rejected."""
    return decode_obj(_loads(raw, MAX_RECORD_BYTES), registry, raw)


def rank_out_of_range(event: Envelope, world_size: int) -> str:
    """The dead letter's detail for a rank outside its run (the decoder and the core say the same)."""
    return f"rank {event.rank} is outside world size {world_size} of run {event.run_id}"


def run_mismatch(event: Envelope, batch_run_id: str) -> str:
    """The dead letter's detail for an event inside another run's batch."""
    return f"event of run {event.run_id} inside a batch of run {batch_run_id}"


def check_rank(event: Envelope, world_size: int) -> None:
    if event.rank >= world_size:
        raise Rejected(RejectReason.RANK_OUT_OF_RANGE, rank_out_of_range(event, world_size))


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    header: BatchHeader | None
    #: Every valid event in the batch's order; a columnar block's rows stand in its place.
    events: list[Envelope]
    rejections: list[Rejection]


@dataclass(frozen=True, slots=True)
class DecodedParts:
    """A batch as it came: events, columnar blocks kept as columns (schemas/columnar.py),
    common heartbeats, step stats and GPU health as rows (schemas/event_check.py)."""

    header: BatchHeader | None
    parts: list[Envelope | StepColumns | Row]
    rejections: list[Rejection]
    #: The run's world size the decoder was told (`registered`), if it asked.
    registered: int | None = None

    @property
    def events(self) -> int:
        return sum(len(p) if isinstance(p, StepColumns) else 1 for p in self.parts)


def decode_batch(
    raw: bytes, world_size: int | None = None, registered: Callable[[str], int | None] | None = None
) -> DecodedBatch:
    """Split a telemetry batch into valid events and rejections, each with its own reason
    (:func:`decode_parts`, with every columnar block's rows in its place)."""
    decoded = decode_parts(raw, world_size, registered)
    return DecodedBatch(decoded.header, events_of(decoded), decoded.rejections)


def events_of(decoded: DecodedParts) -> list[Envelope]:
    """A decoded batch's events in order, its columnar blocks row by row."""
    events: list[Envelope] = []
    for part in decoded.parts:
        if isinstance(part, StepColumns):
            events += rows(part)
        else:
            events.append(event_of(part))
    return events


def event_of(part: Envelope | Row) -> Envelope:
    """A part's event: a row's model, validated from the object the row was read from
    (a common row is what its model accepts as it is: schemas/event_check.py), or from its
    JSON with its schema key where the row holds that instead (an archive's row,
    replay/stored.py)."""
    if type(part) is not tuple:
        return part  # type: ignore[return-value]
    cls = Heartbeat if is_heartbeat(part) else StepStats if is_stats(part) else GpuHealth
    obj = part[-1]
    if type(obj) is str:
        obj = orjson.loads(obj)
        del obj["schema"]
    event: Envelope = cls.__pydantic_validator__.validate_python(obj)
    return event


def decode_parts(
    raw: bytes, world_size: int | None = None, registered: Callable[[str], int | None] | None = None
) -> DecodedParts:
    """Split a telemetry batch into valid events (and blocks) and rejections, each with its
    own reason.

    Ranks are checked against `world_size`, else the run's registered size from
    `registered(run_id)`, else the batch header's. A malformed header rejects the whole
    value (with its bytes)."""
    try:
        obj = _loads(raw, MAX_BATCH_BYTES)
        header = _current_batch(obj)
        if header is None:
            kind, _ = _split_schema(obj, raw)
            if kind != Batch.KIND:
                # A lone event (not batched) is accepted too: single-record producers exist.
                event = decode_obj(obj, LONE_RECORDS, raw)
                assert isinstance(event, Envelope)
                size = world_size if world_size is not None else registered and registered(event.run_id)
                if size:
                    check_rank(event, size)
                return DecodedParts(None, [event], [])
            decoded = decode_obj(obj, {"batch": Batch}, raw)
            assert isinstance(decoded, Batch)
            header = _header_of(decoded)
    except Rejected as rej:
        return DecodedParts(None, [], [Rejection(rej.reason, rej.detail, raw)])
    return _decode_records(header, raw, world_size, registered)


_BATCH = Batch.schema_name()
_VALIDATE_BATCH = Batch.__pydantic_validator__.validate_python


def _current_batch(obj: Any) -> BatchHeader | None:
    """A batch of the current version that validates as it is (nearly every value), or
    None: decode_obj then words what is wrong (or upcasts an older version). A common
    header is read without its model (schemas/event_check.py)."""
    if type(obj) is not dict or obj.get("schema") != _BATCH:
        return None
    del obj["schema"]  # our own parsed dict: no copy needed
    common = batch_header(obj)
    if common is not None:
        return common
    try:
        header: Batch = _VALIDATE_BATCH(obj)
    except ValidationError:
        obj["schema"] = _BATCH
        return None
    return _header_of(header)


def _header_of(batch: Batch) -> BatchHeader:
    """The header the decoder keeps of a batch its model read (an uncommon or older one)."""
    return BatchHeader(**batch.model_dump(exclude={"records"}), records=batch.records)


def _decode_records(
    header: BatchHeader, raw: bytes, world_size: int | None, registered: Callable[[str], int | None] | None
) -> DecodedParts:
    """A valid batch header's records: each event (or block) decoded or rejected alone."""
    known = registered(header.run_id) if registered is not None else None
    size = world_size or known or header.world_size
    run_id = header.run_id
    parts: list[Envelope | StepColumns | Row] = []
    rejections: list[Rejection] = []
    for item in header.records:
        common = common_row(item, run_id, size)  # (nearly every event that is not a block)
        if common is not None:
            parts.append(common)
            continue
        # Only a string schema is looked up (a list or an object there is unhashable: it
        # takes decode_obj, which words the reason).
        schema = item.get("schema") if type(item) is dict else None
        schema = schema if type(schema) is str else None
        if schema == _STEP_TIMINGS:
            block = _block(item, run_id, size, rejections)
            if block is not None and len(block):
                parts.append(block)
            continue
        # Fast path (nearly every event): a current-version telemetry record that validates,
        # of this run, in range. Anything else takes decode_obj for its precise reason.
        if schema is not None:
            cls = _CURRENT_TELEMETRY.get(schema)
            if cls is not None:
                del item["schema"]  # our own parsed dict: no copy needed
                try:
                    event = cls.__pydantic_validator__.validate_python(item)
                except ValidationError:
                    pass
                else:
                    if event.run_id == run_id and event.rank < size:
                        parts.append(event)
                        continue
                item = {"schema": schema, **item}
        try:
            event = decode_obj(item, TELEMETRY)
            assert isinstance(event, Envelope)
            if event.run_id != header.run_id:
                raise Rejected(RejectReason.RUN_MISMATCH, run_mismatch(event, header.run_id))
            check_rank(event, size)
            parts.append(event)
        except Rejected as rej:
            rejections.append(Rejection(rej.reason, rej.detail, orjson.dumps(item)))
    return DecodedParts(header, parts, rejections, known)


_STEP_TIMINGS = StepTimings.schema_name()


def _block(item: dict[str, Any], run_id: str, size: int, rejections: list[Rejection]) -> StepColumns | None:
    """A columnar block's valid rows; each bad row rejected alone, with the reason the row
    format would give it (schemas/columnar.py), rows of another run or outside the world
    too."""
    try:
        block: StepColumns = columns_of(item)
    except BlockError as exc:
        rejections.append(Rejection(RejectReason.INVALID_FIELDS, str(exc), orjson.dumps(item)))
        return None
    for line in block.bad:  # worded by the one decoder, as a step_timing/1 record would be
        record = {"schema": StepTiming.schema_name(), **line}
        try:
            decode_obj(record, TELEMETRY)
        except Rejected as rej:
            rejections.append(Rejection(rej.reason, rej.detail, orjson.dumps(record)))
    if block.run_id == run_id and (not block.rank_list or max(block.rank_list) < size):
        return block  # every row of this run and in range (nearly every block)
    keep = [block.run_id == run_id and rank < size for rank in block.rank_list]
    for i in (i for i, good in enumerate(keep) if not good):
        event = row(block, i)
        if event.run_id != run_id:
            rejections.append(
                Rejection(RejectReason.RUN_MISMATCH, run_mismatch(event, run_id), encode(event))
            )
        else:
            detail = rank_out_of_range(event, size)
            rejections.append(Rejection(RejectReason.RANK_OUT_OF_RANGE, detail, encode(event)))
    return block.take(keep)
