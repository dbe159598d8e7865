"""The rack / placement-group slowdown detector at scale, on one core.

    .venv/bin/python bench/bench_group_slowdown.py --ranks 2048 16384 --seeds 5

For each world size (racks of 16 nodes x 8 GPUs = 128 ranks, the control-16k noise:
3% lognormal jitter, 1% silicon lottery, Pareto tails, GC pauses; harness/
group_streams.py builds the steps with numpy):

- noise only: `--noise-steps` steps per seed, the flags raised (must be 0);
- one rack 5% and one 8% slow from step 20: the steps from onset to its flag per seed;
- the threshold a 128-rank rack gets and the noise it is derived from;
- the detector's cost per step (its median and count per group, the reference, the
  streaks), unsharded and cut into shards of 4,096 ranks (each shard's summary plus
  shard 0's merge), against the 2 s step.

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `harness`

from harness.group_streams import GroupHarness, RackJob, SlowGroup, _trigger  # noqa: E402
from trainguard.processors.core.detectors.group_slowdown import on_local_step, on_summary  # noqa: E402
from trainguard.schemas import GroupComputeTimes, GroupSlowdownFlagged  # noqa: E402

ONSET = 20


def latency(ranks: int, factor: float, seed: int, steps: int = 160) -> int | None:
    h = GroupHarness(RackJob(world_size=ranks, seed=seed, slow=[SlowGroup(factor, rack=3, from_step=ONSET)]))
    found = [o for o in h.steps(steps) if isinstance(o, GroupSlowdownFlagged)]
    if [f.group for f in found] != ["rack-03"]:
        return None  # missed, or something else flagged too
    return found[0].step - ONSET


def noise_only(ranks: int, steps: int, seed: int) -> tuple[int, float, float]:
    """(flags, per-rank noise, threshold of a 128-rank rack) over `steps` healthy steps."""
    h = GroupHarness(RackJob(world_size=ranks, seed=seed))
    flags = len(h.steps(steps))
    noise = statistics.median(h.state.noise)
    policy = h.policy
    return flags, noise, max(policy.min_slowdown, policy.noise_sigma * noise / math.sqrt(128))


def cost_ms(ranks: int, steps: int, shard_ranks: int) -> float:
    """Detector milliseconds per step (all shards together), the stream's generation excluded."""
    h = GroupHarness(RackJob(world_size=ranks, seed=3), shard_ranks=shard_ranks)
    h.steps(5)  # warm
    values = [h.job.next_step() for _ in range(steps)]
    coordinator = h.runs[0]
    t0 = time.perf_counter()
    for k, v in enumerate(values):
        step = h.job.step + 1 + k
        for run in h.runs:
            for made in on_local_step(
                run.groups, run, step, v, _trigger(run.run_id, run.shard, step), h.policy, h.diagnosis_policy
            ):
                if isinstance(made, GroupComputeTimes):
                    on_summary(coordinator.groups, coordinator, made, h.policy, h.diagnosis_policy)
    return (time.perf_counter() - t0) / steps * 1000


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2048, 16_384])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--noise-steps", type=int, default=1000)
    parser.add_argument("--cost-steps", type=int, default=100)
    args = parser.parse_args()
    seeds = range(1, args.seeds + 1)
    print(
        "| ranks | racks | noise-only steps x seeds | flags | noise per rank | 128-rank threshold "
        "| 5% rack: steps to flag | 8% rack: steps to flag | ms/step unsharded "
        "| ms/step in 4,096-rank shards | python | machine |\n" + "|---" * 12 + "|"
    )
    for ranks in args.ranks:
        noise = [noise_only(ranks, args.noise_steps, 100 + s) for s in seeds]
        flags = sum(n[0] for n in noise)
        per_rank = statistics.median(n[1] for n in noise)
        threshold = statistics.median(n[2] for n in noise)
        five = [latency(ranks, 1.05, s) for s in seeds]
        eight = [latency(ranks, 1.08, s) for s in seeds]
        whole = cost_ms(ranks, args.cost_steps, 0)
        sharded = cost_ms(ranks, args.cost_steps, 4096) if ranks > 4096 else float("nan")
        print(
            f"| {ranks:,} | {ranks // 128} | {args.noise_steps} x {len(seeds)} | {flags} | {per_rank:.2%} "
            f"| +{threshold:.1%} | {five} | {eight} | {whole:.2f} | {sharded:.2f} "
            f"| {platform.python_version()} | {platform.machine()} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
