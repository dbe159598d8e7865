"""The windowed slowdown detector (issue 47) against the per-step rule, on one core.

    .venv/bin/python bench/bench_slowdown.py            # everything (~2 minutes)
    .venv/bin/python bench/bench_slowdown.py --only latency

Four measurements, each printed as a markdown table:

- latency: steps from onset to the first flag naming the slow unit, for one rank or one
  node (all 8 ranks) `--sizes` slower from step 100, at jitter 0.03 and 0.05 with the
  issue's noise (a 0.4 s GC pause on 0.3% of each rank's steps, ~1 heavy-tail event per
  step), 1,024 ranks, `--seeds` seeds (median and worst); the per-step rule
  (straggler.py: robust z > 3 for 100 steps) on the very same steps beside it; "-" is not
  found within `--window` steps. Also at 16,384 ranks with a 1% persistent per-GPU speed
  spread (the silicon lottery), which the measured noise carries into the thresholds.
- noise: flags on noise only at 16,384 ranks over 10,000 steps (the budget: 0.01 expected),
  and at 1,024 ranks with budgets large enough to see, the measured count against the
  budget's expectation (an upper bound).
- cost: the detector's time per step at 16,384 ranks (the per-step copy, the per-block
  judgement amortised, its worst block) beside the per-step rule's evaluation of a step.
- scenarios: the library's slow-small-* runs through the pure core in a closed loop (the
  simulator obeys the commands): each slow unit's flag, diagnosis and eviction decision.

The streams are harness/slowdown_streams.py's; the per-step rule is driven through
its own evaluation (straggler._evaluate) with each step's reports in place, as observe_step
would have them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.slowdown_streams import NoisyJob, SlowUnit, WindowHarness, trigger  # noqa: E402
from trainguard.processors.core.decisions.eviction_state import EvictionPolicy  # noqa: E402
from trainguard.processors.core.detectors import straggler  # noqa: E402
from trainguard.processors.core.detectors.slowdown import payback_floor, z_threshold  # noqa: E402
from trainguard.processors.core.detectors.slowdown_state import NODE, RANK, SlowdownPolicy  # noqa: E402
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy, StragglerState  # noqa: E402
from trainguard.processors.core.state import RunState  # noqa: E402

ONSET = 100


class PerStep:
    """The per-step rule over a harness's steps: each step's reports put in place, then
    the rule's own evaluation of the step."""

    def __init__(self, world: int) -> None:
        self.run = RunState("bench", world_size=world)
        self.state = StragglerState(attempt=0)
        straggler._set_expected(self.state, 0, world)
        self.policy = StragglerPolicy()
        self.flags: list[tuple[int, int]] = []  # (step, rank)
        self.ns: list[int] = []

    def step(self, step: int, values: np.ndarray) -> None:
        p = straggler._new_pending(self.state)
        np.frombuffer(p.values)[:] = values
        p.seen[:] = b"\x01" * values.size
        p.count, p.need = values.size, 0
        self.state.evaluated_through = step
        t0 = time.perf_counter_ns()
        found = straggler._evaluate(self.state, self.run, step, p, trigger("bench", step), self.policy)
        self.ns.append(time.perf_counter_ns() - t0)
        self.flags += [(step, f.rank) for f in found if f.KIND == "straggler_flagged"]


def latency(
    world: int,
    jitter: float,
    factor: float,
    unit: str,
    seed: int,
    window: int,
    spread: float = 0.0,
    onset: int = ONSET,
) -> tuple[int | None, int | None]:
    """(windowed, per-step rule) steps from onset to the first flag on the slow unit."""
    rpn, target = 8, (world // 2) + 3
    fault = (
        SlowUnit(factor, rank=target, from_step=onset)
        if unit == RANK
        else SlowUnit(factor, node=target // rpn, from_step=onset)
    )
    job = NoisyJob(
        world_size=world, nodes_per_rack=16, jitter=jitter, rank_spread=spread, slow=[fault], seed=seed
    )
    h = WindowHarness(job)
    rule = PerStep(world)
    ours = theirs = None

    def hits(rank: int) -> bool:
        return rank == target if unit == RANK else rank // rpn == target // rpn

    for _ in range(onset + window):
        values = job.next_step()
        run = h.runs[0]
        for flag in on_step(run, job.step, values, h):
            if ours is None and hits(flag.rank):
                ours = job.step - onset
        if theirs is None:
            rule.step(job.step, values)
            if any(hits(r) for _, r in rule.flags):
                theirs = job.step - onset
        if ours is not None and theirs is not None:
            break
    return ours, theirs


def on_step(run: RunState, step: int, values: np.ndarray, h: WindowHarness) -> list:
    from trainguard.processors.core.detectors.slowdown import on_step as judge

    out = judge(run.slowdown, run, step, values, values.size, trigger("bench", step), h.policy, h.eviction)
    return [o for o in out if o.KIND == "straggler_flagged"]


def fmt(found: list[int | None]) -> str:
    hit = [f for f in found if f is not None]
    if not hit:
        return "-"
    miss = len(found) - len(hit)
    text = f"{statistics.median(hit):.0f} / {max(hit)}"
    return text + (f" ({miss} of {len(found)} missed)" if miss else "")


def latency_table(sizes: list[float], seeds: int, window: int) -> None:
    print("\n### Detection latency (steps from onset; median / worst over seeds)\n")
    print("| ranks | jitter | spread | onset | slow | " + " | ".join(f"+{s:.0%}" for s in sizes) + " |")
    print("|---|---|---|---|---|" + "---|" * len(sizes))
    # the last: a slowdown starting once 24 blocks of each unit's past are kept (768 steps)
    configs = [
        (1024, 0.03, 0.0, ONSET),
        (1024, 0.05, 0.0, ONSET),
        (16384, 0.04, 0.01, ONSET),
        (16384, 0.04, 0.01, 800),
    ]
    for world, jitter, spread, onset in configs:
        for unit in (RANK, NODE):
            ours_row, theirs_row = [], []
            for factor in sizes:
                pairs = [
                    latency(world, jitter, 1 + factor, unit, seed, window, spread, onset)
                    for seed in range(seeds if world <= 1024 else max(1, seeds // 2))
                ]
                ours_row.append(fmt([p[0] for p in pairs]))
                theirs_row.append(fmt([p[1] for p in pairs]))
            what = "rank" if unit == RANK else "node (8 ranks)"
            where = f"| {world:,} | {jitter} | {spread} | {onset} | {what}"
            print(f"{where}: windowed | " + " | ".join(ours_row) + " |")
            print(f"{where}: per-step rule | " + " | ".join(theirs_row) + " |")
            sys.stdout.flush()


def noise_table() -> None:
    print("\n### Noise only\n")
    print(
        "| ranks | steps | jitter | spread | budget (false flags per 10k steps at 16,384 ranks) "
        "| expected here (at most) | flags |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = [
        (16_384, 10_000, 0.04, 0.0, 0.01, None),
        (16_384, 10_000, 0.05, 0.01, 0.01, None),
        (1_024, 10_000, 0.04, 0.0, 1_000.0, 1e-3),
        (1_024, 10_000, 0.04, 0.0, 10_000.0, 1e-3),
    ]
    for world, steps, jitter, spread, budget, floor in rows:
        policy = SlowdownPolicy(false_flags_per_10k_steps=budget, min_slowdown=floor)
        job = NoisyJob(world_size=world, nodes_per_rack=16, jitter=jitter, rank_spread=spread, seed=3)
        h = WindowHarness(job, policy=policy)
        t0 = time.perf_counter()
        h.steps(steps)
        expected = budget * steps / 10_000 * world / policy.reference_ranks
        note = "" if floor is None else " (no payback floor)"
        print(
            f"| {world:,} | {steps:,} | {jitter} | {spread} | {budget:g}{note} | {expected:.3g} "
            f"| {len(h.flags)} ({time.perf_counter() - t0:.0f} s) |"
        )
        sys.stdout.flush()


def cost_table(world: int = 16_384, blocks: int = 40) -> None:
    policy = SlowdownPolicy()
    job = NoisyJob(world_size=world, nodes_per_rack=16, jitter=0.04, seed=9)
    h = WindowHarness(job)
    rule = PerStep(world)
    run = h.runs[0]
    from trainguard.processors.core.detectors.slowdown import on_step as judge

    steps = blocks * policy.block_steps
    per_call: list[int] = []
    judging: list[int] = []
    for _ in range(steps):
        values = job.next_step()
        t0 = time.perf_counter_ns()
        judge(run.slowdown, run, job.step, values, world, trigger("bench", job.step), policy, h.eviction)
        spent = time.perf_counter_ns() - t0
        (judging if job.step % policy.block_steps == policy.block_steps - 1 else per_call).append(spent)
        rule.step(job.step, values)
    warm = judging[len(policy.horizons) :]
    mean_ms = (sum(per_call) + sum(judging)) / steps / 1e6
    print("\n### Cost at 16,384 ranks (one core)\n")
    print(
        "| ranks | per-step copy p50 µs | block judgement p50 ms | worst ms | mean ms per step "
        "| per-step rule's evaluation p50 ms |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {world:,} | {statistics.median(per_call) / 1e3:.0f} | {statistics.median(warm) / 1e6:.2f} "
        f"| {max(warm) / 1e6:.2f} | {mean_ms:.3f} | {statistics.median(rule.ns[2:]) / 1e6:.3f} |"
    )


def scenarios_table(names: list[str]) -> None:
    """The library's acceptance scenarios through the pure core in a closed loop (the
    simulator obeys the core's commands): each slow unit's flag, diagnosis and eviction."""
    from harness.devtools.stack import builtin_policy
    from harness.scoring.evaluate import closed_loop, score_loop
    from trainguard.processors.core.policy import load_policy
    from trainguard.producers.simulator import Scenario
    from trainguard.schemas import EvictionDecision, StragglerDiagnosed, StragglerFlagged

    policy = load_policy(str(builtin_policy("evaluate")))
    print("\n### Library scenarios, pure core, closed loop\n")
    print(
        "| scenario | slow unit | flagged after (steps) | slowdown measured | diagnosis | eviction "
        "| false alarms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        scenario = Scenario.builtin(name)
        t0 = time.perf_counter()
        loop = closed_loop(scenario, policy)
        scored = score_loop(scenario, loop)
        flags = [o for o in loop.outputs if isinstance(o, StragglerFlagged)]
        verdicts = {o.caused_by[0]: o for o in loop.outputs if isinstance(o, StragglerDiagnosed)}
        decisions = {o.caused_by[0]: o for o in loop.outputs if isinstance(o, EvictionDecision)}
        for truth in scored.truths:
            mine = [
                f for f in flags if (f.rank == truth.rank if truth.node is None else f.node == truth.node)
            ]
            unit = f"node {truth.node}" if truth.rank is None else f"rank {truth.rank}"
            if truth.kind != "slow" or not mine:
                print(f"| {name} | {unit} | not flagged | | | | |")
                continue
            first = mine[0]
            diagnosed = verdicts.get(first.event_id)
            decided = decisions.get(diagnosed.event_id) if diagnosed is not None else None
            print(
                f"| {name} | {unit} x{truth.factor:g} | "
                f"{first.step - truth.step} | {first.slowdown:.3f} | "
                f"{diagnosed.diagnosis if diagnosed else '-'} | {decided.decision if decided else '-'} | "
                f"{len(scored.false_alarms)} ({time.perf_counter() - t0:.0f} s) |"
            )
        sys.stdout.flush()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--only", choices=["latency", "noise", "cost", "scenarios"], default=None)
    parser.add_argument(
        "--scenarios",
        nargs="*",
        default=["slow-small-1k"],
        help="Library scenarios to run through the pure core (slow-small-16k: ~7 minutes).",
    )
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[0.03, 0.04, 0.05, 0.06, 0.08, 0.10, 0.15, 0.20]
    )
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--window", type=int, default=600, help="Steps after onset a unit is watched for.")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    policy = SlowdownPolicy()
    print(
        f"commit {commit}; thresholds: rank {z_threshold(policy, RANK, 8):.2f} sigma, node "
        f"{z_threshold(policy, NODE, 8):.2f} sigma, payback floor "
        f"+{payback_floor(policy, EvictionPolicy()):.1%}"
    )
    if args.only in (None, "latency"):
        latency_table(args.sizes, args.seeds, args.window)
    if args.only in (None, "noise"):
        noise_table()
    if args.only in (None, "cost"):
        cost_table()
    if args.only in (None, "scenarios") and args.scenarios:
        scenarios_table(args.scenarios)


if __name__ == "__main__":
    main()
