"""A Hugging Face Trainer job supervised by trainguard: one line, the callback.

    .venv/bin/trainguard launch --nproc 2 --ranks-per-node 1 --run-id hf \\
        --checkpoint-dir .trainguard/hf/ckpt -- .venv/bin/python docs/examples/train_hf.py

The launcher sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and TORCHELASTIC_RUN_ID, so the
Trainer (accelerate) joins the launcher's process group: gloo on CPU here
(``use_cpu=True, ddp_backend="gloo"``), NCCL on GPUs (drop both). The callback measures each
step before the all-reduce, checks and (when commanded) skips updates, runs the self-check
replays, executes the processors' commands, saves trainguard's validated checkpoints when
one is due, and resumes from the launcher's validated step after a restart: the line
marked `# trainguard` is all this script has of trainguard.

The model is a tiny Llama built from a config (no download) with attention dropout, the data
random tokens, both from fixed seeds, so a run that was interrupted and resumed ends with the
weights of an uninterrupted one; rank 0 writes them to TRAINGUARD_RUN_DIR/final.pt for tests
to compare. TRAIN_STEPS (default 48) bounds the run; TRAIN_CHECKPOINT_EVERY=N saves after
every N-th step instead of the policy's interval.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from trainguard.transformers import TrainguardTrainerCallback

STEPS = int(os.environ.get("TRAIN_STEPS", "48"))
EVERY = os.environ.get("TRAIN_CHECKPOINT_EVERY")


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the model learning to predict them (a stand-in corpus)."""

    def __init__(self, size: int = 512, length: int = 16, vocab: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights on every rank (the Trainer seeds after this)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attention_dropout=0.1,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    run_dir = Path(os.environ.get("TRAINGUARD_RUN_DIR", "."))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = TrainingArguments(
        output_dir=str(run_dir / "hf"),
        use_cpu=True,
        ddp_backend="gloo" if distributed else None,
        ddp_find_unused_parameters=False,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="no",  # trainguard's checkpoints are the validated ones
        logging_steps=20,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    every = int(EVERY) if EVERY else None
    trainer = Trainer(
        model=model(),
        args=args,
        train_dataset=Tokens(),
        callbacks=[TrainguardTrainerCallback(checkpoint_every_steps=every)],  # trainguard
    )
    trainer.train()
    if trainer.is_world_process_zero():
        run_dir.mkdir(parents=True, exist_ok=True)
        final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(final, run_dir / "final.pt")


if __name__ == "__main__":
    main()
