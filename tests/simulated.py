"""A simulated run's telemetry as the records a shipper packs (producers/rank/shipper.py
`pack`: one record per shard and node per flush, step timings as columnar blocks or not),
for the tests that fold, decode or compare a run's records (tests/schemas/test_columnar.py,
tests/processors/test_block.py, tests/replay/test_decoded.py)."""

from __future__ import annotations

from collections.abc import Iterator

from trainguard.common.collector import old_objects_left_alone
from trainguard.producers.rank.shipper import pack
from trainguard.producers.simulator.cluster import SimulatedCluster
from trainguard.producers.simulator.scenario import Scenario

START = 1_000.0


def packed_records(
    scenario: Scenario,
    run_id: str,
    shard_ranks: int = 4096,
    packed: bool = True,
    seconds: float | None = None,
) -> Iterator[bytes]:
    """The run's record values in produce order, one flush per simulated second (a shipper
    with its defaults), until the run is done or `seconds` of it have passed."""
    cluster = SimulatedCluster(scenario, START, run_id=run_id, id_prefix="sim")
    seq, t = 0, START
    while not cluster.done and (seconds is None or t < START + seconds):
        t += 1.0
        for record in pack(cluster.advance(t), run_id, scenario.world_size, shard_ranks, "p", seq, packed):
            seq = record.seq + 1
            yield record.value


#: The cyclic collector off for a long simulated run and its folds (trainguard's own
#: helper, which replays use): such a run keeps its cores' states alive to the end, so each
#: full collection walks them all again for almost nothing (10-15% of the CPU of a
#: 16,384-rank run's closed loop and folds). What the tests assert does not change.
gc_paused = old_objects_left_alone
