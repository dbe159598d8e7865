"""What a worker's snapshot of a large run costs its event loop (issue 20).

    .venv/bin/python bench/bench_snapshot.py [--sim-seconds 60] [--flush-sim-s 5]

Folds the live bench's 16,384-rank stream (bench/bench_live.py's generator, no broker)
through the processor's driver, then times, best of `--repeat`: `freeze` (the pickle,
done on the worker's loop while nothing folds) and `seal` (zlib and the HMAC, done on a
thread, processors/app.py), and the two parts that used to dominate the pickle: the GPU
readings and the dedupe window.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_live import generate  # noqa: E402

from trainguard.processors.core import CorePolicy  # noqa: E402
from trainguard.processors.driver import CoreDriver  # noqa: E402
from trainguard.processors.snapshot import Snapshot, freeze, seal  # noqa: E402
from trainguard.producers.simulator import Scenario  # noqa: E402
from trainguard.schemas.sharding import DEFAULT_SHARD_RANKS  # noqa: E402

SCENARIO = Path(__file__).with_name("scenarios") / "live-16k.yaml"


def best_ms(work: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim-seconds", type=int, default=60)
    parser.add_argument("--flush-sim-s", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    scenario = Scenario.load(str(SCENARIO))
    load = generate(scenario, args.sim_seconds, "bench-snapshot", args.flush_sim_s, DEFAULT_SHARD_RANKS)
    driver = CoreDriver(CorePolicy(), b"bench-snapshot-secret-0123456789abcdef")
    for *_, value in load.records:
        driver.handle(value)
    snapshot = Snapshot("telemetry", 0, len(load.records), time.time(), dict(driver.state.runs))
    frozen = freeze(snapshot)
    run = next(iter(driver.state.runs.values()))
    cells = [
        f"{scenario.world_size:,}",
        f"{len(run.seen):,}",
        f"{len(frozen) / 2**20:.1f}",
        f"{best_ms(lambda: freeze(snapshot), args.repeat):.0f}",
        f"{best_ms(lambda: pickle.dumps(run.health, protocol=pickle.HIGHEST_PROTOCOL), args.repeat):.0f}",
        f"{best_ms(lambda: pickle.dumps(run.__getstate__()['seen']), args.repeat):.0f}",
        f"{best_ms(lambda: seal(frozen, b'k' * 32), args.repeat):.0f}",
    ]
    print("| ranks | dedupe ids | pickled MiB | freeze ms (on the loop) | of which GPU readings ms "
          "| of which dedupe window ms | seal ms (on a thread) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("| " + " | ".join(cells) + " |")
    print(f"\nload average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
