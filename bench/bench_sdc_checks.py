"""What each SDC mechanism costs on real ranks, against a step of the same model: the tiny
example's (docs/examples/train_tiny.py: 16 -> 32 -> 1 MLP, batch 16, SGD) and, with
``--hidden``, wider ones. The bitwise self-check (producers/training/grad_checks.py: the step's
microbatch replayed twice, transient faults), the ring cross-rank check
(producers/training/ring_check.py: a deterministically wrong device), the three-rank bisection of a
ring edge that fails alone (producers/training/cross_check.py: each named rank recomputes one
microbatch; its all-reduce of three floats is not in this single-process figure), and the node self-test
(producers/launcher/node_selftest.py: known-answer products and an all-reduce on a quarantined node or
a spare, one worker process per device: its wall time is mostly the workers' start-up).

    .venv/bin/python bench/bench_sdc_checks.py [--checks 200] [--steps 2000] [--hidden 32 1024]

Single process, CPU, one thread (as the end-to-end test's ranks run): a step is forward,
backward and the optimizer's update (no all-reduce: the collective only makes a real step
longer, so the ratio here is an upper bound); a check is what a rank runs at a check step,
its own and its neighbour's microbatch each replayed once (forward + backward, gradients,
buffers and RNG states kept and restored) and summarised by the float64 gradient norm.
Reports the median over `--rounds` rounds of each, the cost per check in ms and in steps,
and the ring's share of compute at one check every 10 steps (the end-to-end policy) and
every 10,000 steps (the seed's 0.01% budget with one microbatch per step); then one node
self-test on 2 CPU workers (gloo), healthy and with the wrong-device knob.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from trainguard.producers.chaos.device_fault import ENV_WRONG_DEVICE
from trainguard.producers.launcher.node_selftest import run_node_self_test
from trainguard.producers.training.grad_checks import self_check
from trainguard.producers.training.ring_check import recompute, ring_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, nargs="+", default=[32])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    print(
        f"{'hidden':>7} {'step ms':>8} {'self-check ms':>14} {'ring ms':>8} {'ring steps':>11} "
        f"{'ring 1/10':>10} {'ring 1/10k':>11} {'bisect ms':>10}"
    )
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

        step_s, self_s, check_s, bisect_s = [], [], [], []
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
                self_check(replay, batch_of(0, k), params, step=k, microbatch_id="b", module=net)
            self_s.append((time.perf_counter() - t0) / args.checks)
            t0 = time.perf_counter()
            for k in range(args.checks):
                ring_check(replay, batch_of, params, rank=0, world_size=4, step=k, check_id="b", offset=1)
            check_s.append((time.perf_counter() - t0) / args.checks)
            t0 = time.perf_counter()
            for k in range(args.checks):
                recompute(replay, batch_of(1, k), params, net)
            bisect_s.append((time.perf_counter() - t0) / args.checks)
        step, check = statistics.median(step_s), statistics.median(check_s)
        ratio = check / step
        print(
            f"{hidden:>7} {step * 1e3:>8.3f} {statistics.median(self_s) * 1e3:>14.3f} {check * 1e3:>8.3f} "
            f"{ratio:>11.2f} {ratio / (10 + ratio):>10.1%} {ratio / (10_000 + ratio):>11.4%} "
            f"{statistics.median(bisect_s) * 1e3:>10.3f}"
        )
    for label, env in (("healthy", {}), ("wrong device", {ENV_WRONG_DEVICE: "node=bench,local_rank=1"})):
        report = run_node_self_test("bench", 2, env=env)
        inside = sum(r.seconds for r in report.results)
        print(f"node self-test, {label}: {report.wall_s:.1f} s wall, {inside * 1e3:.0f} ms in the tests")
        print(f"  {report.summary()}")


if __name__ == "__main__":
    main()
