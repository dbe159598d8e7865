"""What a worker pays to recover a partition: from a snapshot plus the records after it,
against folding the partition's whole log (processors/recovery.py, processors/snapshot.py).

    .venv/bin/python bench/bench_recovery.py [--ranks 1024 4096] [--steps 400] [--tail-s 30]

No broker: the run's telemetry (a synchronous job, one batch per node and step, a slow
rank) is built in memory and folded through the processor's own driver, as the worker
folds it. For each world size it measures, in one run: the fold of the whole log, the
snapshot's encode (pickle, zlib, HMAC) and decode, its size, and the fold of the tail a
snapshot taken every `--tail-s` seconds of the run leaves at worst. The ratio is the
recovery from the log over the recovery from the snapshot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.feed import node_batches  # noqa: E402
from harness.straggler_streams import Slow, SyncJob  # noqa: E402
from trainguard.processors.core.policy import CorePolicy  # noqa: E402
from trainguard.processors.core.state import CoreState  # noqa: E402
from trainguard.processors.driver import CoreDriver  # noqa: E402
from trainguard.processors.snapshot import Snapshot, decode_snapshot, encode_snapshot, snapshot_key  # noqa: E402
from trainguard.schemas import encode, encode_batch  # noqa: E402

SECRET = b"bench-recovery-secret-0123456789"


def records(ranks: int, steps: int) -> tuple[list[bytes], int, float]:
    """The run's telemetry records, its event count and its step time."""
    job = SyncJob(run_id="bench-recovery", world_size=ranks, ranks_per_node=8, step_s=2.0,
                  slow=[Slow(ranks // 3, 1.3, from_step=steps // 4)])  # fmt: skip
    job.start().steps(steps)
    out = []
    for seq, batch in enumerate(node_batches(job.events)):
        header = dict(run_id=job.run_id, node=batch[0].node or "controller", world_size=ranks,
                      producer_id="bench", seq=seq)  # fmt: skip
        out.append(encode_batch(header, [encode(e) for e in batch]))
    return out, len(job.events), job.step_s


def fold(driver: CoreDriver, values: list[bytes]) -> float:
    t0 = time.perf_counter()
    for value in values:
        driver.handle(value)
    return time.perf_counter() - t0


def measure(ranks: int, steps: int, tail_s: float) -> dict[str, float]:
    values, events, step_s = records(ranks, steps)
    key = snapshot_key(SECRET)
    whole = CoreDriver(CorePolicy(), SECRET)
    log_s = fold(whole, values)
    t0 = time.perf_counter()
    blob = encode_snapshot(Snapshot("telemetry", 0, len(values), time.time(), whole.state.runs), key)
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    restored = decode_snapshot(blob, key)
    decode_s = time.perf_counter() - t0
    tail = values[-int(len(values) * min(1.0, tail_s / (steps * step_s))) :]
    tail_fold_s = fold(CoreDriver(CorePolicy(), SECRET, state=CoreState(runs=restored.runs)), tail)
    from_snapshot = decode_s + tail_fold_s
    return {
        "ranks": ranks,
        "steps": steps,
        "events": events,
        "records": len(values),
        "log_fold_s": log_s,
        "events_per_s": events / log_s,
        "snapshot_mib": len(blob) / 2**20,
        "encode_ms": encode_s * 1000,
        "decode_ms": decode_s * 1000,
        "tail_records": len(tail),
        "from_snapshot_s": from_snapshot,
        "ratio": log_s / from_snapshot,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tail-s", type=float, default=30.0, help="run seconds between snapshots")
    args = parser.parse_args()
    print("| ranks | steps (2 s) | events | log fold s | events/s | snapshot MiB | encode ms | decode ms "
          "| tail records | snapshot + tail s | log / snapshot |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ranks in args.ranks:
        m = measure(ranks, args.steps, args.tail_s)
        cells = [f"{ranks:,}", f"{m['steps']:,.0f}", f"{m['events']:,.0f}", f"{m['log_fold_s']:.1f}",
                 f"{m['events_per_s']:,.0f}", f"{m['snapshot_mib']:.2f}", f"{m['encode_ms']:.0f}",
                 f"{m['decode_ms']:.0f}", f"{m['tail_records']:,.0f}", f"{m['from_snapshot_s']:.2f}",
                 f"{m['ratio']:.0f}x"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
