"""Cost of the straggler detector at scale, on one core.

    .venv/bin/python bench/bench_straggler.py --ranks 16384 --steps 60

Feeds `--steps` synchronous steps of `--ranks` StepTiming events (lognormal jitter, one
20%-slow rank, rare 3x GC pauses) to ``observe_step`` and prints one markdown table row:
the median and p99 time of the call that completes a step (it evaluates the step: median,
MAD, z, streaks, over every rank), the mean cost of the other calls (recording one
report), and the detector's share of one core at 2 s/step. Events are built beforehand
(pydantic's model_construct) so that only the detector is timed.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from trainguard.processors.core.detectors.straggler import observe_step
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy, StragglerState
from trainguard.processors.core.state import RunState
from trainguard.schemas import StepTiming

HEADER = (
    "| ranks | steps | evaluate (completing call) p50 ms | p99 ms | record one report µs "
    "| ms per step, all ranks | core share at 2 s/step | python | machine |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def make_steps(ranks: int, steps: int, seed: int = 1) -> list[list[StepTiming]]:
    rng = random.Random(seed)
    straggler = ranks // 3
    out = []
    for step in range(steps):
        batch = []
        for rank in range(ranks):
            compute = 1.4 * rng.lognormvariate(0, 0.03) * (1.2 if rank == straggler else 1.0)
            if rng.random() < 0.001:
                compute *= 3.0
            batch.append(
                StepTiming.model_construct(
                    event_id=f"e{step}-{rank}",
                    run_id="bench",
                    attempt=0,
                    rank=rank,
                    node=f"node-{rank // 8:05d}",
                    step=step,
                    ts=1.8e9 + 2.0 * step,
                    compute_s=compute,
                    total_s=2.0,
                )
            )
        rng.shuffle(batch)  # ranks' reports arrive in no particular order
        out.append(batch)
    return out


def bench(ranks: int, steps: int) -> str:
    policy = StragglerPolicy(consecutive_steps=max(1, steps // 2), clear_steps=10)
    run = RunState("bench", world_size=ranks)
    state = StragglerState()
    batches = make_steps(ranks, steps)
    evaluate_ns: list[int] = []
    record_ns = record_calls = 0
    flagged = 0
    for batch in batches:
        for event in batch[:-1]:
            t0 = time.perf_counter_ns()
            observe_step(state, run, event, policy)
            record_ns += time.perf_counter_ns() - t0
            record_calls += 1
        t0 = time.perf_counter_ns()
        flagged += len(observe_step(state, run, batch[-1], policy))
        evaluate_ns.append(time.perf_counter_ns() - t0)
    assert state.evaluated == steps and flagged == 1, (state.evaluated, flagged)
    warm = sorted(evaluate_ns[2:])
    p50 = statistics.median(warm) / 1e6
    p99 = warm[min(len(warm) - 1, int(0.99 * len(warm)))] / 1e6
    per_record_us = record_ns / record_calls / 1e3
    per_step_ms = p50 + per_record_us * (ranks - 1) / 1e3
    share = per_step_ms / 2000.0
    return (
        f"| {ranks} | {steps} | {p50:.3f} | {p99:.3f} | {per_record_us:.2f} | {per_step_ms:.1f} "
        f"| {share:.1%} | {platform.python_version()} | {platform.machine()} |"
    )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16_384])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(HEADER)
    for ranks in args.ranks:
        print(bench(ranks, args.steps), flush=True)


if __name__ == "__main__":
    main()
