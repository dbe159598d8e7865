"""What the Hugging Face Trainer callback costs per step: the same Trainer run with and
without ``TrainguardTrainerCallback`` (docs/examples/train_hf.py's one line), in one run.

    .venv/bin/python bench/bench_hf.py [--steps 500] [--hidden 32 256] [--rounds 5]

A tiny Llama built from a config (2 layers; `--hidden` widths, a row each), sequences of
16 tokens, batch 8, AdamW with a linear schedule and the Trainer's default gradient
clipping, in two settings, each a real Trainer run on CPU:

* single process;
* DDP, 1 gloo rank (accelerate's DDP wrap): the callback's supervisor also installs its
  comm hook and agrees on skips with one scalar all-reduce per step. accelerate's state is
  one per process, so this setting runs in a child process.

The callback's telemetry goes to an in-memory sink (which stands for the shipper's bounded
queue), without checkpoints (their cost is bench_checkpoint.py's). Runs with and without
the callback alternate in `--rounds` rounds; a step's time is measured inside the run
(from the first step's start to the last step's end, over the steps between), so the
Trainer's set-up is not in it; each column is the median round.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from trainguard.producers.rank.agent import MemorySink
from trainguard.transformers import TrainguardTrainerCallback

SETTINGS = {"single": "single process", "ddp": "DDP, 1 gloo rank"}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (4096, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama(hidden: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=16))  # fmt: skip


class StepClock(TrainerCallback):
    """Seconds per step, from the first step's start to the last step's end."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.steps = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last = time.perf_counter()
        self.steps += 1

    def per_step(self) -> float:
        assert self.first is not None and self.steps > 1
        return (self.last - self.first) / (self.steps - 1)


def run(hidden: int, ddp: bool, steps: int, supervised: bool) -> float:
    clock = StepClock()
    callbacks: list[TrainerCallback] = [clock]
    if supervised:
        callbacks.append(TrainguardTrainerCallback(sink=MemorySink(), gpu_reader=None))
    args = TrainingArguments(
        output_dir="/tmp/bench-hf",
        use_cpu=True,
        ddp_backend="gloo" if ddp else None,
        ddp_find_unused_parameters=False,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=llama(hidden), args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its end-of-run line, not a measurement
    trainer.train()
    return clock.per_step()


def rows(setting: str, hiddens: list[int], steps: int, rounds: int) -> None:
    ddp = setting == "ddp"
    for hidden in hiddens:
        params = sum(p.numel() for p in llama(hidden).parameters())
        run(hidden, ddp, 50, False)
        run(hidden, ddp, 50, True)  # warm-up
        bare, sup = [], []
        for _ in range(rounds):
            bare.append(run(hidden, ddp, steps, False))
            sup.append(run(hidden, ddp, steps, True))
        b, w = statistics.median(bare), statistics.median(sup)
        print(f"| {SETTINGS[setting]} | {params:,} | {b * 1e6:,.1f} µs | {w * 1e6:,.1f} µs "
              f"| {(w - b) * 1e6:,.1f} µs | {(w - b) / b:.1%} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--hidden", type=int, nargs="+", default=[32, 256], help="Llama widths, a row each")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--setting", choices=sorted(SETTINGS), help="(internal) one setting's rows only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("trainguard").setLevel(logging.ERROR)
    os.environ.setdefault("TRAINGUARD_RUN_ID", "bench-hf")
    if args.setting is not None:
        rows(args.setting, args.hidden, args.steps, args.rounds)
        return
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{platform.processor() or platform.machine()}, 1 thread, Llama 2 layers, 16 tokens, batch 8, "
          f"AdamW; {args.rounds} rounds x {args.steps} steps")  # fmt: skip
    print()
    print("| run | parameters | without the callback | with it | cost per step | cost / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    rows("single", args.hidden, args.steps, args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}  # fmt: skip
    child = [sys.executable, __file__, "--setting", "ddp", "--steps", str(args.steps),
             "--rounds", str(args.rounds), "--hidden", *map(str, args.hidden)]  # fmt: skip
    subprocess.run(child, env=env, check=True)


if __name__ == "__main__":
    main()
