"""What a backtest keeps of its decoded log (replay/decoded.py): a simulated run's
records, packed as a shipper packs them (step timings as columnar blocks), give the same
step timings, time span and cost-model facts as the same run shipped event by event."""

from __future__ import annotations

import json
import statistics

from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay import cost_model
from trainguard.replay.decoded import LogColumns
from trainguard.schemas import CheckpointWritten, RunStarted, StepTiming
from trainguard.schemas.codec import decode_parts, events_of
from trainguard.schemas.columnar import StepColumns

from ..simulated import packed_records


def columns_of_log(values: list[bytes]) -> LogColumns:
    log = LogColumns()
    for value in values:
        log.add(decode_parts(value))
    return log


def test_columns_read_as_the_events_one_by_one() -> None:
    scenario = Scenario.builtin("straggler-thermal")
    packed = list(packed_records(scenario, "decoded-run", seconds=400))
    as_rows = list(packed_records(scenario, "decoded-run", seconds=400, packed=False))
    assert any(isinstance(p, StepColumns) for v in packed for p in decode_parts(v).parts)  # columnar indeed
    assert not any(isinstance(p, StepColumns) for v in as_rows for p in decode_parts(v).parts)
    events = [e for v in as_rows for e in events_of(decode_parts(v))]
    assert {StepTiming, RunStarted, CheckpointWritten} <= {type(e) for e in events}  # the facts' sources

    log, reference = columns_of_log(packed), columns_of_log(as_rows)
    steps = [e for e in events if isinstance(e, StepTiming)]
    assert list(log.timings()) == list(reference.timings())
    assert list(log.timings()) == [(e.attempt, e.step, e.ts, e.compute_s, e.total_s) for e in steps]
    assert (log.first_ts, log.last_ts) == (min(e.ts for e in events), max(e.ts for e in events))
    assert log.median_step_s() == statistics.median(e.total_s for e in steps)
    checkpoints = [e.blocking_s for e in events if isinstance(e, CheckpointWritten)]
    assert log.blocking_s == checkpoints and log.world_size == scenario.world_size
    facts = cost_model.measure(log, [], 3600.0, 600.0)
    assert facts == cost_model.measure(reference, [], 3600.0, 600.0)
    assert facts.step_s > 0 and facts.checkpoint_s == statistics.median(checkpoints)


def test_a_step_past_63_bits_is_kept_not_refused() -> None:
    """The model bounds no int from above: a step past 63 bits (up to 64 the JSON reader
    keeps it an int) is valid, and the columns keep it (as a list), once."""
    block = {
        "schema": "step_timings/1", "run_id": "r", "node": "n0", "event_id": ["a", "b"],
        "attempt": [0, 0], "rank": [0, 1], "step": [7, 2**63 + 5], "ts": [1.0, 2.0],
        "compute_s": [0.5, 0.5], "total_s": [1.0, 1.5],
    }  # fmt: skip
    batch = {"schema": "batch/2", "run_id": "r", "node": "n0", "world_size": 2, "producer_id": "p",
             "seq": 0, "shard": 0, "shard_ranks": 0, "records": [block]}  # fmt: skip
    log = LogColumns()
    log.add(decode_parts(json.dumps(batch).encode()))
    assert [t.step for t in log.timings()] == [7, 2**63 + 5]
    assert log.median_step_s() == 1.25 and (log.first_ts, log.last_ts) == (1.0, 2.0)


def test_an_empty_log_measures_nothing() -> None:
    facts = cost_model.measure(LogColumns(), [], 3600.0, 600.0)
    measured = (facts.start_ts, facts.end_ts, facts.step_s, facts.checkpoint_s, facts.world_size)
    assert measured == (0, 0, 0, 0, 1)
    assert facts.restart_s == 600.0
