"""Bad input, property-based (issue 7 scenario 7, the codec's part): whatever bytes a
telemetry record holds, and however the events inside a batch are mangled (fields
dropped or retyped, NaN and infinities, unknown and old schema versions, ranks out of
range, another run's events, oversized values), decoding never raises, every good event
of the batch survives, and every bad one comes back as a rejection with a reason and
its original bytes."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.schemas import RejectReason, decode_batch, encode, encode_batch
from trainguard.schemas.codec import TELEMETRY, Rejected, decode_obj
from trainguard.schemas.columnar import COLUMNS

from .test_codec import build

FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
WORLD = 64
INT64 = st.integers(-(2**63), 2**63 - 1)  # what JSON numbers on the wire can hold
TELEMETRY_KINDS = sorted(k for k, cls in TELEMETRY.items() if k not in ("batch",))
HEADER: dict[str, Any] = dict(run_id="run-a", node="node-001", world_size=WORLD, producer_id="fuzz", seq=0)


def event(kind: str, rank: int) -> dict[str, Any]:
    obj: dict[str, Any] = orjson.loads(encode(build(kind)))
    obj["rank"] = rank
    return obj


def _weird_value() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(), st.booleans(), INT64, st.text(max_size=20), st.lists(INT64, max_size=3),
        st.dictionaries(st.text(max_size=5), INT64, max_size=2),
        st.sampled_from(["NaN", "Infinity", "-Infinity"]),  # how the wire spells non-finite floats
    )  # fmt: skip


@st.composite
def mangled(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """(an event as JSON, whether it is still good), mangled one way or not at all."""
    kind = draw(st.sampled_from(TELEMETRY_KINDS))
    obj = event(kind, draw(st.integers(0, WORLD - 1)))
    hows = ["none", "drop", "retype", "reschema", "version", "rank", "run", "unknown", "oversized"]
    how = draw(st.sampled_from(hows))
    if how == "drop":
        obj.pop(draw(st.sampled_from(sorted(k for k in obj if k != "schema"))))
    elif how == "retype":
        obj[draw(st.sampled_from(sorted(k for k in obj if k != "schema")))] = draw(_weird_value())
    elif how == "reschema":  # a schema that is not a string (a list or an object is unhashable)
        obj["schema"] = draw(_weird_value())
    elif how == "version":
        obj["schema"] = f"{kind}/{draw(st.sampled_from([0, 2, 7, 99]))}"
    elif how == "rank":
        obj["rank"] = draw(st.integers(WORLD, 10**9))
    elif how == "run":
        obj["run_id"] = "run-b"
    elif how == "unknown":
        obj["schema"] = f"{draw(st.text(alphabet='abcxyz_', min_size=1, max_size=8))}/1"
    elif how == "oversized":
        obj["node"] = "n" * 5000
    # A mangling can happen to leave a valid event (e.g. retyping a field to a value it accepts).
    return obj, how == "none"


def judge(obj: dict[str, Any]) -> bool:
    """Whether the codec accepts `obj` alone as an event of run-a in a 64-rank world."""
    try:
        decoded = decode_obj(dict(obj), TELEMETRY)
    except Rejected:
        return False
    return decoded.run_id == "run-a" and decoded.rank < WORLD  # type: ignore[attr-defined]


@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_raise_and_come_back_whole(raw: bytes) -> None:
    decoded = decode_batch(raw)
    if decoded.events:  # a lone event that happens to be valid: nothing to reject
        return
    (rejection,) = decoded.rejections
    assert rejection.raw == raw and isinstance(rejection.reason, RejectReason) and rejection.detail


@FUZZ
@given(st.lists(mangled(), min_size=1, max_size=40))
def test_every_good_event_survives_and_every_bad_one_is_rejected_with_its_bytes(
    items: list[tuple[dict[str, Any], bool]],
) -> None:
    raw = encode_batch(HEADER, [orjson.dumps(obj) for obj, _ in items])
    decoded = decode_batch(raw)
    expected_good = [obj for obj, _ in items if judge(obj)]
    assert all(judge(obj) for obj, good in items if good)  # unmangled events are always good
    assert len(decoded.events) == len(expected_good)
    assert [e.event_id for e in decoded.events] == [obj.get("event_id") for obj in expected_good]
    assert len(decoded.rejections) == len(items) - len(expected_good)
    for rejection in decoded.rejections:
        assert isinstance(rejection.reason, RejectReason) and rejection.detail
        original = orjson.loads(rejection.raw)  # the event's own bytes, not the batch's
        assert any(original == obj for obj, _ in items)


@FUZZ
@given(st.sampled_from(TELEMETRY_KINDS), st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_non_finite_numbers_in_any_float_field_are_rejected_not_stored(kind: str, value: str) -> None:
    """On the wire a non-finite float is the string "NaN" or "Infinity" (JSON has none)."""
    obj = event(kind, 1)
    # loss and grad_norm may be non-finite on purpose: the SDC detector reads them.
    for field in [k for k, v in obj.items() if isinstance(v, float) and k not in ("loss", "grad_norm")]:
        decoded = decode_batch(encode_batch(HEADER, [orjson.dumps({**obj, field: value})]))
        assert not decoded.events, (kind, field)
        assert decoded.rejections[0].reason is RejectReason.NON_FINITE, decoded.rejections[0]


@st.composite
def mangled_block(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """(a columnar block of step timings as JSON, whether its shape is still intact): one
    cell, one whole column or one header field set to anything JSON holds, or a key
    dropped or added."""
    n = draw(st.integers(1, 6))
    rows = [{**event("step_timing", rank), "event_id": f"b-{rank}"} for rank in range(n)]
    block: dict[str, Any] = {
        "schema": "step_timings/1", "run_id": "run-a", "node": "node-001",
        **{name: [row[name] for row in rows] for name in COLUMNS},
    }  # fmt: skip
    how = draw(st.sampled_from(["cell", "cell", "cell", "column", "header", "drop", "extra"]))
    if how == "cell":  # half the time a value at a limit of the column checks
        edges = st.sampled_from(["", "x" * 201, -0.5, -1, 2**63, "3", True])
        anything = st.one_of(_weird_value(), st.floats(allow_nan=False, allow_infinity=False))
        value = draw(edges) if draw(st.booleans()) else draw(anything)
        block[draw(st.sampled_from(COLUMNS))][draw(st.integers(0, n - 1))] = value
    elif how == "column":
        block[draw(st.sampled_from(COLUMNS))] = draw(_weird_value())
    elif how == "header":
        block[draw(st.sampled_from(["run_id", "node"]))] = draw(_weird_value())
    elif how == "drop":
        block.pop(draw(st.sampled_from(sorted(k for k in block if k != "schema"))))
    else:
        block[draw(st.text(alphabet="abcxyz_", min_size=1, max_size=6))] = draw(_weird_value())
    return block, how == "cell"


@settings(FUZZ, max_examples=1000)  # a cell is one of many: more draws to meet each kind
@given(mangled_block())
def test_a_mangled_block_keeps_exactly_the_rows_the_row_format_accepts(
    item: tuple[dict[str, Any], bool],
) -> None:
    """A block is checked a column at a time (schemas/columnar.py) and, when a row is
    uncommon, row by row: either way a row is an event exactly when the row format
    accepts it alone, a bad row is rejected with a reason, and the block's neighbour in
    the batch is kept."""
    block, shape_intact = item
    neighbour = event("heartbeat", 3)
    decoded = decode_batch(encode_batch(HEADER, [orjson.dumps(block), orjson.dumps(neighbour)]))
    assert decoded.events and decoded.events[-1].event_id == neighbour["event_id"]
    assert all(isinstance(r.reason, RejectReason) and r.detail for r in decoded.rejections)
    if shape_intact:
        lines = [
            {"schema": "step_timing/1", "run_id": block["run_id"], "node": block["node"],
             **{name: block[name][i] for name in COLUMNS}}
            for i in range(len(block["event_id"]))
        ]  # fmt: skip
        accepted = [line["event_id"] for line in lines if judge(line)]
        assert [e.event_id for e in decoded.events[:-1]] == accepted
        assert len(decoded.rejections) == len(lines) - len(accepted)
