"""The telemetry wire format, columnar against rows, in one run (issue 20): a 16,384-rank
run's records packed as a shipper packs them, with each node's step timings as one
columnar block (schemas/columnar.py) and with one JSON object per event, then

  bytes/event    record bytes per event
  decode ev/s    decode_batch: parse, validate, the events out (no Kafka)
  fold ev/s      CoreDriver.handle: decode plus the core, as one processor worker does
                 it (no Kafka, no faust): blocks with their quiet rows folded as columns
                 (processors/core/folds/block.py), blocks expanded and folded row by row, rows

    .venv/bin/python bench/bench_decode.py                    # live-16k, 40 simulated s
    .venv/bin/python bench/bench_decode.py --sim-seconds 20 --flush-sim-s 1

Both packings come from the same simulated events; the core's outputs from the two are
compared (they must be identical) and the row is appended to stdout as markdown. This
machine's speed drifts by up to a third within minutes, so the variants run interleaved,
`--rounds` times in a rotating order, and each reports its median round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_live import generate  # noqa: E402

from trainguard.processors.core import CorePolicy  # noqa: E402
from trainguard.processors.driver import CoreDriver  # noqa: E402
from trainguard.producers.simulator import Scenario  # noqa: E402
from trainguard.schemas import decode_batch, encode  # noqa: E402
from trainguard.schemas.sharding import DEFAULT_SHARD_RANKS  # noqa: E402

SCENARIO = Path(__file__).with_name("scenarios") / "live-16k.yaml"
HEADER = (
    "| telemetry | ranks | flush s | records | events | bytes/event | decode ev/s | fold ev/s | decisions |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def measure(values: list[bytes], events: int, columnar: bool) -> tuple[float, float, list[bytes]]:
    t0 = time.perf_counter()
    for value in values:
        decode_batch(value)
    decode_s = time.perf_counter() - t0
    driver, outputs = CoreDriver(CorePolicy(), b"bench-decode-secret-0123456789abcdef", columnar=columnar), []
    t0 = time.perf_counter()
    for value in values:
        result = driver.handle(value)
        outputs += [encode(o) for o in (*result.derived, *result.commands)]
    fold_s = time.perf_counter() - t0
    return events / decode_s, events / fold_s, outputs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", default=str(SCENARIO))
    parser.add_argument("--sim-seconds", type=int, default=40)
    parser.add_argument("--flush-sim-s", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args(argv)
    scenario = Scenario.load(args.scenario)
    variants = (("blocks, folded as columns", True, True), ("blocks, folded row by row", True, False),
                ("rows", False, False))  # fmt: skip
    loads = {
        packed: generate(
            scenario, args.sim_seconds, "bench-decode", args.flush_sim_s, DEFAULT_SHARD_RANKS, packed, "bench"
        )
        for packed in (True, False)
    }
    values_of = {packed: [value for _, _, _, value in load.records] for packed, load in loads.items()}
    events_of = {packed: sum(load.events) for packed, load in loads.items()}
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in variants}
    results: dict[str, list[bytes]] = {}
    for round_ in range(args.rounds):
        for name, packed, columnar in variants[round_ % 3 :] + variants[: round_ % 3]:
            decode_rate, fold_rate, outputs = measure(values_of[packed], events_of[packed], columnar)
            rates[name].append((decode_rate, fold_rate))
            results[name] = outputs
    rows = []
    for name, packed, _ in variants:
        values, events = values_of[packed], events_of[packed]
        decode_rate = statistics.median(r[0] for r in rates[name])
        fold_rate = statistics.median(r[1] for r in rates[name])
        rows.append(
            f"| {name} | {scenario.world_size} | {args.flush_sim_s} | {len(values):,} | {events:,} "
            f"| {sum(map(len, values)) / events:.1f} | {decode_rate:,.0f} | {fold_rate:,.0f} "
            f"| {len(results[name])} |"
        )
    print(HEADER)
    print("\n".join(rows))
    names = [name for name, _, _ in variants]
    same = results[names[0]] == results[names[1]]  # the block fold against its rows: must hold
    packing = results[names[0]] == results[names[2]]  # blocks against rows: the order moves
    print(
        f"\nidentical decisions, columns vs rows of the same blocks: {same}; blocks vs rows packing: "
        f"{packing}; load average {os.getloadavg()[0]:.2f}",
        file=sys.stderr,
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
