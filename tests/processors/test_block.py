"""A record's columnar blocks (processors/core/folds/block.py) and its heartbeats' and step
stats' rows (processors/core/folds/quiet.py) fold to exactly the state and outputs of its
events folded one by one by ``step``, record by record along a simulated run
with a thermal straggler that is flagged, diagnosed and evicted: not only at the run's end
(tests/schemas/test_columnar.py), where a later event can hide a clock that an earlier one
set wrong; unsharded, and cut in 8 shards (whose shards other than the coordinator fold
their quiet rows as columns too)."""

from __future__ import annotations

import copy

import orjson
import pytest

from trainguard.processors.core import CorePolicy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import encode
from trainguard.schemas.columnar import StepColumns

from ..schemas.test_columnar import same
from ..simulated import packed_records

SECRET = b"block-test-secret-0123456789abcdef"
#: Records checked both ways (each check copies the core's state twice).
CHECKS = 120


@pytest.mark.parametrize("shard_ranks", [4096, 16], ids=["unsharded", "8-shards"])
def test_every_checked_record_folds_as_its_events_do_one_by_one(shard_ranks: int) -> None:
    scenario = Scenario.builtin("straggler-thermal")
    policy = CorePolicy(dedupe_window=4096)  # a small window: the copies stay cheap
    driver = CoreDriver(policy, SECRET)
    records = list(packed_records(scenario, "block-run", shard_ranks))
    # Every record that decides something is checked, and a sample of the quiet ones.
    first = CoreDriver(policy, SECRET)
    deciding = {i for i, value in enumerate(records) if (r := first.handle(value)).derived or r.commands}
    every = max(1, len(records) // CHECKS)
    checked = decided = 0
    for i, value in enumerate(records):
        decoded = driver.decode(value)
        folded_apart = any(isinstance(p, StepColumns | tuple) for p in decoded.parts)  # blocks, rows
        if (i % every == 0 or i in deciding) and folded_apart:
            columns = CoreDriver(policy, SECRET, state=copy.deepcopy(driver.state))
            one_by_one = CoreDriver(policy, SECRET, state=copy.deepcopy(driver.state), columnar=False)
            a, b = columns.fold(decoded), one_by_one.fold(decoded)
            outputs = [encode(o) for o in (*a.derived, *a.commands)]
            assert outputs == [encode(o) for o in (*b.derived, *b.commands)], f"record {i}"
            assert (a.events, a.duplicates, a.forwards) == (b.events, b.duplicates, b.forwards)
            same(columns.state, one_by_one.state, f"after record {i}")
            checked += 1
            decided += bool(outputs)
        driver.fold(decoded)
    assert checked >= CHECKS // 2 and decided >= 3, (checked, decided)  # flag, diagnosis, eviction...


def test_redelivered_rows_are_counted_as_duplicates_and_change_nothing() -> None:
    """At-least-once delivery: records delivered again (whole, a while after), and a block
    whose rows repeat an id of a row before them, fold as the rows one by one do: each
    repeated row counted a duplicate, nothing else changed."""
    scenario = Scenario.builtin("straggler-thermal")
    records = list(packed_records(scenario, "block-run", seconds=60))
    again: list[bytes] = []
    for i, value in enumerate(records):
        if i % 11 == 5 and b'"step_timings/1"' in value:
            batch = orjson.loads(value)
            block = next(r for r in batch["records"] if r["schema"] == "step_timings/1")
            block["event_id"][-1] = block["event_id"][0]  # a row repeats the block's first id
            value = orjson.dumps(batch)
        again.append(value)
        if i % 7 == 3:
            again.append(again[-3])  # redelivered behind a newer record
    columns, one_by_one = CoreDriver(CorePolicy(), SECRET), CoreDriver(CorePolicy(), SECRET, columnar=False)
    duplicates = 0
    for i, value in enumerate(again):
        a, b = columns.handle(value), one_by_one.handle(value)
        assert [encode(o) for o in (*a.derived, *a.commands)] == [
            encode(o) for o in (*b.derived, *b.commands)
        ]
        assert (a.events, a.duplicates) == (b.events, b.duplicates), f"record {i}"
        duplicates += a.duplicates
    assert duplicates > len(again) // 10
    same(columns.state, one_by_one.state)
