"""The decoded log read column-wise for the backtest (replay/decoded.py): a simulated run's
records, packed as a shipper packs them (step timings as columnar blocks), give the same
step timings, time span and cost-model facts as the same records decoded event by event."""

from __future__ import annotations

from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay import cost_model
from trainguard.replay.decoded import others, step_totals, timings, ts_span
from trainguard.schemas import CheckpointWritten, RunStarted, StepTiming
from trainguard.schemas.codec import DecodedParts, decode_parts, events_of
from trainguard.schemas.columnar import StepColumns

from ..simulated import packed_records


def test_columns_read_as_the_events_one_by_one() -> None:
    scenario = Scenario.builtin("straggler-thermal")
    decoded = [decode_parts(value) for value in packed_records(scenario, "decoded-run", seconds=400)]
    as_rows = [DecodedParts(d.header, list(events_of(d)), d.rejections) for d in decoded]
    assert any(isinstance(p, StepColumns) for d in decoded for p in d.parts)  # columnar indeed
    events = [e for d in as_rows for e in d.parts]
    kinds = {type(e) for e in events}
    assert {StepTiming, RunStarted, CheckpointWritten} <= kinds  # what the facts are made of

    read = list(timings(decoded))
    assert read == list(timings(as_rows))
    steps = [e for e in events if isinstance(e, StepTiming)]
    assert read == [(e.attempt, e.step, e.ts, e.compute_s, e.total_s) for e in steps]
    assert step_totals(decoded) == step_totals(as_rows) == [e.total_s for e in steps]
    assert list(others(decoded)) == [e for e in events if not isinstance(e, StepTiming)]
    assert ts_span(decoded) == ts_span(as_rows) == (min(e.ts for e in events), max(e.ts for e in events))
    facts = cost_model.measure(decoded, [], 3600.0, 600.0)
    assert facts == cost_model.measure(as_rows, [], 3600.0, 600.0)
    assert facts.world_size == scenario.world_size and facts.step_s > 0 and facts.checkpoint_s > 0
