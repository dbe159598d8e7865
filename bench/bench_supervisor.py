"""What the training-side integration costs per step: the same small real training step
with and without the Supervisor's lines (docs/examples/train_tiny.py), in one run.

    .venv/bin/python bench/bench_supervisor.py [--steps 2000] [--hidden 256 1024] [--rounds 5]

Two settings, each a real torch step on CPU (forward, backward, optimizer):

* plain: a single-process loop (`with sup.step(step) as s: ... s.compute_done();
  s.check(loss)`), telemetry to an in-memory sink, GPU health absent (CPU);
* ddp: a 1-rank gloo DistributedDataParallel loop, where the Supervisor also installs its
  comm hook (the compute-done stamp, and the per-parameter all-reduce that keeps resumes
  bitwise at any world size) and agrees on skips with one scalar all-reduce per step.

Bare and supervised loops alternate in `--rounds` rounds of `--steps` steps each (so that
drift in the machine's speed hits both alike); each reports its median round. The cost
per step is supervised - bare (µs) and its share of the bare step.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.training.supervisor import Supervisor, SupervisorConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(hidden: int, ddp: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, 1))  # fmt: skip
    if ddp:
        net = nn.parallel.DistributedDataParallel(net)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))
    return net, torch.optim.SGD(net.parameters(), lr=1e-3), x, y


def bare_loop(hidden: int, ddp: bool) -> Callable[[int], float]:
    model, opt, x, y = make(hidden, ddp)

    def run(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    return run


def supervised_loop(hidden: int, ddp: bool) -> tuple[Callable[[int], float], Supervisor]:
    model, opt, x, y = make(hidden, ddp)
    sink = MemorySink()
    sup = Supervisor("bench", model=model, optimizer=opt, sink=sink, gpu_reader=None,
                     world_size=1, config=SupervisorConfig())  # fmt: skip
    step = 0

    def run(steps: int) -> float:
        nonlocal step
        t0 = time.perf_counter()
        for _ in range(steps):
            with sup.step(step) as s:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                s.compute_done()
                if s.check(loss):
                    opt.step()
                opt.zero_grad()
            step += 1
        sink.events.clear()  # the sink stands for the shipper's bounded queue
        return time.perf_counter() - t0

    return run, sup


def measure(hidden: int, ddp: bool, steps: int, rounds: int) -> tuple[float, float]:
    bare = bare_loop(hidden, ddp)
    supervised, sup = supervised_loop(hidden, ddp)
    bare(200)
    supervised(200)  # warm-up: allocator, autograd graph, the first events
    bare_s, sup_s = [], []
    for _ in range(rounds):
        bare_s.append(bare(steps) / steps)
        sup_s.append(supervised(steps) / steps)
    sup.close()
    return statistics.median(bare_s), statistics.median(sup_s)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024], help="MLP widths, a row each")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread, "
          f"MLP 64-H-H-1 (tanh), batch 64, SGD; {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print()
    print("| loop | parameters | bare step | supervised step | cost per step | cost / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for hidden in args.hidden:
        params = sum(p.numel() for p in make(hidden, ddp=False)[0].parameters())
        for name, ddp in (("single process", False), ("DDP, 1 gloo rank", True)):
            bare, sup = measure(hidden, ddp, args.steps, args.rounds)
            print(f"| {name} | {params:,} | {bare * 1e6:,.1f} µs | {sup * 1e6:,.1f} µs "
                  f"| {(sup - bare) * 1e6:,.1f} µs | {(sup - bare) / bare:.1%} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
