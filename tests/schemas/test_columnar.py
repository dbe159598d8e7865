"""Columnar step timings (schemas/columnar.py): a node's flush ships its step timings as one
block; every row keeps its identity and decodes to the very StepTiming the row format
gives, a bad row is rejected alone with the row format's reason, and the core decides
the same from blocks as from rows on a simulated run with a straggler and a crash."""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import deque
from typing import Any

import numpy as np
import orjson
import pytest

from harness.streams import Job
from trainguard.processors.core import CorePolicy, CoreState
from trainguard.processors.driver import CoreDriver
from trainguard.producers.rank.shipper import pack
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import Envelope, RejectReason, StepTiming, decode_batch, encode, encode_batch
from trainguard.schemas.columnar import encode_step_timings

from ..simulated import gc_paused, packed_records
from ..variants import with_slow

SECRET = b"columnar-test-secret-0123456789ab"


def flush(job: Job, node: str) -> list[Envelope]:
    """One node's events as its shipper holds them at a flush: timings and heartbeats."""
    return [e for e in job.events if e.node == node]


def header(job: Job, node: str) -> dict[str, Any]:
    return dict(run_id=job.run_id, node=node, world_size=job.world_size, producer_id="p", seq=0)


def block_with(job: Job, node: str, **rows: tuple[int, object]) -> bytes:
    """A batch of the node's step timings as one block, with row i of a column replaced."""
    timings = [e for e in flush(job, node) if type(e) is StepTiming]
    block = orjson.loads(encode_step_timings(timings))
    for column, (i, value) in rows.items():
        block[column][i] = value
    return encode_batch(header(job, node), [orjson.dumps(block)])


def test_a_packed_flush_decodes_to_the_same_events_as_the_row_format() -> None:
    job = Job(world_size=16, ranks_per_node=8).start().steps(6)
    events = flush(job, "node-001")
    (columnar,) = pack(events, job.run_id, job.world_size, 16, "p", 0, columnar=True)
    (rows,) = pack(events, job.run_id, job.world_size, 16, "p", 0, columnar=False)
    assert len(columnar.value) < len(rows.value) * 0.75  # the field names once, not per event
    kinds = [r["schema"] for r in orjson.loads(columnar.value)["records"]]
    assert kinds.count("step_timings/1") == 1 and "step_timing/1" not in kinds
    from_block, from_rows = decode_batch(columnar.value), decode_batch(rows.value)
    assert not from_block.rejections and not from_rows.rejections
    by_id = {e.event_id: e for e in from_rows.events}
    assert len(from_block.events) == len(events) == len(by_id)
    for event in from_block.events:  # equal field by field, and of the same types
        assert event == by_id[event.event_id] and event.model_dump() == by_id[event.event_id].model_dump()
    timings = [e for e in events if type(e) is StepTiming]
    assert [e.event_id for e in from_block.events if type(e) is StepTiming] == [e.event_id for e in timings]


@pytest.mark.parametrize(
    ("rows", "reason", "words"),
    [
        (
            {"compute_s": (3, -0.5)},
            RejectReason.INVALID_FIELDS,
            "compute_s: Input should be greater than or equal",
        ),
        ({"ts": (2, "NaN")}, RejectReason.NON_FINITE, "ts: Input should be a finite number"),
        ({"rank": (1, "three")}, RejectReason.INVALID_FIELDS, "rank: Input should be a valid integer"),
        ({"event_id": (0, "")}, RejectReason.INVALID_FIELDS, "event_id: String should have at least 1"),
        ({"rank": (4, 999)}, RejectReason.RANK_OUT_OF_RANGE, "rank 999 is outside world size 16"),
    ],
)
def test_a_bad_row_is_rejected_alone_with_the_row_formats_reason(
    rows: dict[str, tuple[int, object]], reason: RejectReason, words: str
) -> None:
    job = Job(world_size=16, ranks_per_node=8).start().steps(2)
    good = [e for e in flush(job, "node-000") if type(e) is StepTiming]
    decoded = decode_batch(block_with(job, "node-000", **rows))
    (rejection,) = decoded.rejections
    assert rejection.reason is reason and words in rejection.detail, rejection.detail
    row = orjson.loads(rejection.raw)  # the row itself, in the row format: what to park
    assert row["schema"] == "step_timing/1" and row["event_id"] in {e.event_id for e in good} | {""}
    assert len(decoded.events) == len(good) - 1  # its neighbours all kept


def test_a_row_the_row_format_accepts_is_accepted_as_it_reads_it() -> None:
    """The row format is lax where pydantic is (a rank of "3" is 3, a whole-number ts is a
    float): the block takes the same rows with the same values, in place."""
    job = Job(world_size=16, ranks_per_node=8).start().steps(2)
    timings = [e for e in flush(job, "node-000") if type(e) is StepTiming]
    changed = {"rank": (1, str(timings[1].rank)), "ts": (2, int(timings[2].ts)), "step": (3, True)}
    decoded = decode_batch(block_with(job, "node-000", **changed))
    rows = [orjson.loads(encode(e)) for e in timings]
    for column, (i, value) in changed.items():
        rows[i][column] = value
    as_rows = decode_batch(encode_batch(header(job, "node-000"), [orjson.dumps(r) for r in rows]))
    assert not decoded.rejections and not as_rows.rejections
    assert decoded.events == as_rows.events and decoded.events[2].ts == float(int(timings[2].ts))


def test_a_block_of_the_wrong_shape_is_rejected_whole_and_its_neighbours_kept() -> None:
    job = Job(world_size=16, ranks_per_node=8).start().steps(2)
    timings = [e for e in flush(job, "node-000") if type(e) is StepTiming]
    block = orjson.loads(encode_step_timings(timings))
    block["step"] = block["step"][:-1]
    other = encode(job.events[0])
    decoded = decode_batch(encode_batch(header(job, "node-000"), [orjson.dumps(block), other]))
    (rejection,) = decoded.rejections
    assert rejection.reason is RejectReason.INVALID_FIELDS and "different lengths" in rejection.detail
    assert [e.event_id for e in decoded.events] == [job.events[0].event_id]


def test_a_block_of_another_run_is_rejected_row_by_row() -> None:
    job = Job(world_size=16, ranks_per_node=8).start().steps(1)
    other = Job(run_id="run-other", world_size=16, ranks_per_node=8).start().steps(1)
    timings = [e for e in flush(other, "node-000") if type(e) is StepTiming]
    decoded = decode_batch(encode_batch(header(job, "node-000"), [encode_step_timings(timings)]))
    assert not decoded.events
    assert {r.reason for r in decoded.rejections} == {RejectReason.RUN_MISMATCH}
    assert len(decoded.rejections) == len(timings)


def fold(
    scenario: Scenario, packed: bool = True, columnar: bool = True, shard_ranks: int = 4096
) -> tuple[list[bytes], CoreState]:
    """Every derived event, command and dead letter the core makes of the run's records,
    and the state it ends in: step timings `packed` as blocks or not, blocks folded as
    columns (`columnar`) or row by row; the run cut in shards of `shard_ranks` ranks."""
    ((out, state),) = folds(scenario, (columnar,), packed, shard_ranks)
    return out, state


def folds(
    scenario: Scenario, modes: tuple[bool, ...] = (True, False), packed: bool = True, shard_ranks: int = 4096
) -> list[tuple[list[bytes], CoreState]]:
    """`fold` in each of the `modes` (``columnar`` True or False) from one simulation of the
    run: every record value goes to one CoreDriver a mode, in lockstep (the simulation costs
    as much as a fold; its values are the same bytes for every driver). A record is decoded
    once for all the drivers where it would decode the same for each (CoreDriver.handle is
    fold(decode(value)); decoded_still_valid: as a backtest's pass shares one decode among
    its policies), and folded by each; the collector paused (gc_paused)."""
    drivers = [CoreDriver(CorePolicy(), SECRET, columnar=columnar) for columnar in modes]
    outs: list[list[bytes]] = [[] for _ in modes]
    with gc_paused():
        for value in packed_records(scenario, "columnar-run", shard_ranks, packed):
            decoded = None
            for driver, out in zip(drivers, outs, strict=True):
                if decoded is None or not driver.decoded_still_valid(decoded):
                    decoded = driver.decode(value)
                result = driver.fold(decoded)
                out += [encode(o) for o in (*result.derived, *result.commands)]
                out += [f"{r.reason}: {r.detail}".encode() + r.raw for r in result.rejections]
    return [(out, driver.state) for driver, out in zip(drivers, outs, strict=True)]


#: Work memory, not state: the straggler detector's evaluation buffers (np.empty, so what
#: lies past the part an evaluation used is whatever the allocator gave).
WORK = {"scratch"}


def same(a: Any, b: Any, where: str = "state") -> None:
    """Equal value by value (numpy arrays and buffers by content, NaN equal to NaN)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            if f.name not in WORK:
                same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys differ"
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple | deque):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, array):
        assert np.array_equal(np.frombuffer(a), np.frombuffer(b), equal_nan=True), where
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # a plain object: its fields
        assert type(a) is type(b), where
        same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


#: Issue 20: the whole labelled library folds the same both ways. The suite runs four of
#: its scenarios (a straggler, a hang, an SDC, a repeated crash); the others, up to 16,384
#: ranks and 2.2 M events, are slow variants (tests/variants.py).
SUITE = ["straggler-thermal", "hang-allreduce", "sdc-bitflip", "data-fault-repeat"]


SLOW = [  # the largest first: the longest cases start first on parallel workers
    pytest.param(n, marks=pytest.mark.timeout(1800))
    for n in sorted(Scenario.library(), key=lambda n: -Scenario.builtin(n).world_size)
    if n not in SUITE
]


@pytest.mark.parametrize("name", with_slow([pytest.param(n) for n in SUITE], SLOW))
def test_the_core_folds_a_block_as_it_folds_its_rows(name: str) -> None:
    """Blocks fold their quiet rows as columns (processors/core/folds/block.py): the decisions,
    the dead letters and the whole state after the run are those of the same rows folded
    one by one."""
    scenario = Scenario.builtin(name)
    (as_columns, columns_state), (as_rows, rows_state) = folds(scenario)
    assert as_columns == as_rows
    assert as_columns or not scenario.faults  # a fault scenario decided something
    same(columns_state, rows_state)


def test_the_core_decides_the_same_whether_timings_are_packed_or_not() -> None:
    """A block moves a node's step timings together (where the first was); what the core
    decides does not depend on it. (Its bookkeeping may: a check done one event earlier.)"""
    scenario = Scenario.builtin("straggler-thermal")
    assert fold(scenario)[0] == fold(scenario, packed=False)[0]


def test_the_shards_of_a_sharded_run_fold_blocks_as_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run cut in 8 shards of 16 ranks (the straggler, rank 21, on shard 1): the shards
    that are not the coordinator fold their quiet rows as columns too (they keep no
    run-level clock), with the decisions, dead letters and whole state of the rows. (Rows
    are counted at the driver, which is Python: the core may run compiled.)"""
    on_shards = {"block rows": 0, "one by one": 0}
    fold_block, fold_one = CoreDriver._fold_block, CoreDriver._fold
    in_block = False

    def counted_block(self, columns, result, hint, shard, shard_ranks):  # type: ignore[no-untyped-def]
        nonlocal in_block
        on_shards["block rows"] += len(columns) * (shard > 0)
        in_block = True
        try:
            fold_block(self, columns, result, hint, shard, shard_ranks)
        finally:
            in_block = False

    def counted_one(self, event, result, hint, shard, shard_ranks):  # type: ignore[no-untyped-def]
        on_shards["one by one"] += in_block and shard > 0
        fold_one(self, event, result, hint, shard, shard_ranks)

    monkeypatch.setattr(CoreDriver, "_fold_block", counted_block)
    monkeypatch.setattr(CoreDriver, "_fold", counted_one)
    scenario = Scenario.builtin("straggler-thermal")
    (as_columns, columns_state), (as_rows, rows_state) = folds(scenario, shard_ranks=16)
    quiet_on_shards = on_shards["block rows"] - on_shards["one by one"]  # the rows' driver calls neither
    assert quiet_on_shards > 40_000  # most of the ~56,000 step timings of ranks 16-127 were quiet
    assert len(columns_state.runs) == 8 and as_columns == as_rows and as_columns
    same(columns_state, rows_state)
