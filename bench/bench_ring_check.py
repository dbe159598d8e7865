"""What one ring cross-rank check costs a rank (producers/ring_check.py), against a step of
the same model: the tiny example's (docs/examples/train_tiny.py: 16 -> 32 -> 1 MLP, batch
16, SGD) and, with ``--hidden``, wider ones.

    .venv/bin/python bench/bench_ring_check.py [--checks 200] [--steps 2000] [--hidden 32 1024]

Single process, CPU, one thread (as the end-to-end test's ranks run): a step is forward,
backward and the optimizer's update (no all-reduce: the collective only makes a real step
longer, so the ratio here is an upper bound); a check is what a rank runs at a check step,
its own and its neighbour's microbatch each replayed once (forward + backward, gradients,
buffers and RNG states kept and restored) and summarised by the float64 gradient norm.
Reports the median over `--rounds` rounds of each, the cost per check in ms and in steps,
and its share of compute at one check every 10 steps (the end-to-end policy) and every
10,000 steps (the seed's 0.01% budget with one microbatch per step).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from trainguard.producers.ring_check import ring_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    print(f"{'hidden':>7} {'step ms':>8} {'check ms':>9} {'steps/check':>12} {'1/10 steps':>11} {'1/10k':>8}")
    inputs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    targets = inputs @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    for hidden in args.hidden:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        params = list(net.parameters())

        def batch_of(rank: int, step: int) -> torch.Tensor:
            return torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(step * 8 + rank))

        def replay(batch: torch.Tensor, net: nn.Module = net) -> None:
            nn.functional.mse_loss(net(inputs[batch]), targets[batch]).backward()

        step_s, check_s = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for step in range(args.steps):
                batch = batch_of(0, step)
                nn.functional.mse_loss(net(inputs[batch]), targets[batch]).backward()
                opt.step()
                opt.zero_grad()
            step_s.append((time.perf_counter() - t0) / args.steps)
            t0 = time.perf_counter()
            for k in range(args.checks):
                ring_check(replay, batch_of, params, rank=0, world_size=4, step=k, check_id="b", offset=1)
            check_s.append((time.perf_counter() - t0) / args.checks)
        step, check = statistics.median(step_s), statistics.median(check_s)
        ratio = check / step
        print(
            f"{hidden:>7} {step * 1e3:>8.3f} {check * 1e3:>9.3f} {ratio:>12.2f} "
            f"{ratio / (10 + ratio):>10.1%} {ratio / (10_000 + ratio):>8.4%}"
        )


if __name__ == "__main__":
    main()
