"""The Hugging Face Trainer callback on one CPU process (no broker: the supervisor's events
go to a MemorySink), with two micro-batches a step and an evaluation every 5 steps: a
resumed run ends bitwise where an uninterrupted one does, from the middle of an epoch, an
epoch's last step and a step the Trainer evaluated at (the save waits for the eval loader's
RNG draw); a commanded skip leaves model and optimizer untouched; a commanded self-check
replays the step's micro-batches through compute_loss; the launcher's skip list passes a
batch over. The multi-rank path (gloo, the launcher, a SIGKILL) is
tests/producers/test_frameworks_launch.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from trainguard.producers.rank.agent import MemorySink  # noqa: E402
from trainguard.schemas import SdcSelfCheck, StepStats, StepTiming  # noqa: E402
from trainguard.transformers import TrainguardTrainerCallback  # noqa: E402

SAMPLES, BATCH, ACCUMULATE = 48, 3, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * ACCUMULATE)  # 8
STEPS = 20  # two and a half epochs
EVAL_EVERY = 5


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int, seed: int) -> None:
        self.ids = torch.randint(0, 32, (size, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> LlamaForCausalLM:
    """Attention dropout and AdamW with a linear schedule: RNG, moments, the schedule and
    the data position all have to come back for a resumed run to end bitwise."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        attention_dropout=0.2,
    )
    return LlamaForCausalLM(config)


class Commands(TrainerCallback):
    """What the actuator would do on a SkipUpdate or a RunSelfCheck, before the run starts;
    snapshots around the step `skip`."""

    def __init__(
        self, tg: TrainguardTrainerCallback, skip: int | None = None, self_check: int | None = None
    ) -> None:
        self.tg, self.skip, self.self_check = tg, skip, self_check
        self.before_skip: dict[str, Any] = {}
        self.after_skip: dict[str, Any] = {}
        self.trainer: Trainer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.tg.sup is not None and self.tg.trainer is not None
        self.trainer = self.tg.trainer
        if self.skip is not None:
            self.tg.sup.control.skip_steps.add(self.skip)
        if self.self_check is not None:
            self.tg.sup.control.self_checks_due.append(self.self_check)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.skip:
            self.before_skip = snapshot(self.trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == (self.skip or -2) + 1:
            self.after_skip = snapshot(self.trainer)


def snapshot(trainer: Any) -> dict[str, Any]:
    model = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = trainer.optimizer.state_dict()["state"]
    moments = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)} for k, s in state.items()}
    return {"model": model, "moments": moments}


def train(
    tmp: Path,
    ckpt: Path,
    monkeypatch: pytest.MonkeyPatch,
    resume: int = -1,
    skip_batches: str = "",
    **commands: Any,
) -> tuple[Trainer, TrainguardTrainerCallback, MemorySink, Commands]:
    monkeypatch.setenv("TRAINGUARD_RUN_ID", "hf-trainer-test")
    monkeypatch.setenv("TRAINGUARD_RESUME_STEP", str(resume))
    monkeypatch.setenv("TRAINGUARD_SKIP_BATCHES", skip_batches)
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEEP", "1000")  # every step's kept: resumed from any
    sink = MemorySink()
    tg = TrainguardTrainerCallback(
        checkpoint_dir=str(ckpt), checkpoint_every_steps=1, sink=sink, run_dir=tmp / "run"
    )
    cmds = Commands(tg, **commands)
    args = TrainingArguments(
        output_dir=str(tmp / "out"),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Tokens(SAMPLES, 1),
        eval_dataset=Tokens(6, 2),
        callbacks=[tg, cmds],
    )
    trainer.train()
    return trainer, tg, sink, cmds


def same_weights(a: Trainer, b: Trainer) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path, MemorySink]:
    tmp = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as mp:
        trainer, tg, sink, _ = train(tmp, tmp / "ckpt", mp)
    assert tg.resumed_from == -1
    return trainer, tmp / "ckpt", sink


def test_every_step_is_reported_once_with_its_stats(uninterrupted: tuple[Trainer, Path, MemorySink]) -> None:
    _, _, sink = uninterrupted
    assert [e.step for e in sink.of(StepTiming)] == list(range(STEPS))
    assert all(e.compute_s <= e.total_s for e in sink.of(StepTiming))
    stats = sink.of(StepStats)
    assert len(stats) == STEPS and all(s.grad_norm is not None and s.grad_norm > 0 for s in stats)


@pytest.mark.parametrize(
    "resume",
    [EVAL_EVERY - 1, STEPS_PER_EPOCH - 1, STEPS_PER_EPOCH + 4],
    ids=["at-an-evaluation", "at-an-epochs-end", "in-a-later-epoch"],
)
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_does(
    uninterrupted: tuple[Trainer, Path, MemorySink],
    resume: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole, saved, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    trainer, tg, sink, _ = train(tmp_path, ckpt, monkeypatch, resume=resume)
    assert tg.resumed_from == resume
    assert trainer.state.global_step == STEPS
    assert [e.step for e in sink.of(StepTiming)] == list(range(resume + 1, STEPS))
    assert same_weights(trainer, whole)
    if resume == STEPS_PER_EPOCH + 4:  # once: a second train() in the process does not resume again
        second_train_trains_on(trainer, tg, sink)


def second_train_trains_on(trainer: Trainer, tg: TrainguardTrainerCallback, sink: MemorySink) -> None:
    """The launcher's resume step is for the attempt's first ``train()``: a later one trains
    on from the weights it has, as the Trainer does, never rewound to the checkpoint."""
    before = snapshot(trainer)["model"]
    sink.events.clear()
    trainer.train()
    assert tg.resumed_from == -1
    assert [e.step for e in sink.of(StepTiming)] == list(range(STEPS))  # the Trainer's own fresh loop
    after = snapshot(trainer)["model"]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained on


def test_a_commanded_skip_leaves_model_and_optimizer_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, sink, cmds = train(tmp_path, tmp_path / "ckpt", monkeypatch, skip=5)
    before, after = cmds.before_skip, cmds.after_skip
    assert before and after
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert before["moments"].keys() == after["moments"].keys()
    for key, moments in before["moments"].items():
        assert all(torch.equal(t, after["moments"][key][n]) for n, t in moments.items())
    assert len(sink.of(StepStats)) == STEPS  # the skipped step is still a step


def test_a_commanded_self_check_replays_the_step_through_compute_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: tuple[Trainer, Path, MemorySink]
) -> None:
    trainer, _, sink, _ = train(tmp_path, tmp_path / "ckpt", monkeypatch, self_check=9)
    (result,) = sink.of(SdcSelfCheck)
    assert result.step == 9 and result.passed
    assert same_weights(trainer, uninterrupted[0])  # the replay changed nothing of the run


def test_a_batch_on_the_launchers_skip_list_is_drawn_and_not_trained_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tg, sink, cmds = train(tmp_path, tmp_path / "ckpt", monkeypatch, skip_batches="5", skip=5)
    assert [e.step for e in sink.of(StepTiming)] == [s for s in range(STEPS) if s != 5]
    before, after = cmds.before_skip, cmds.after_skip
    assert before and after
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    for key, moments in before["moments"].items():
        assert all(torch.equal(t, after["moments"][key][n]) for n, t in moments.items())


def test_outside_a_launcher_the_run_is_unsupervised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`python train.py` with the callback in place and no run id: a warning, and the run."""
    for name in ("TRAINGUARD_RUN_ID", "TORCHELASTIC_RUN_ID", "TRAINGUARD_RESUME_STEP"):
        monkeypatch.delenv(name, raising=False)
    tg = TrainguardTrainerCallback(checkpoint_dir=str(tmp_path / "ckpt"))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=3,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(12, 1), callbacks=[tg])
        trainer.train()
    assert trainer.state.global_step == 3 and tg.sup is None
    assert "not supervised" in caplog.text


class Seen(TrainerCallback):
    """The micro-batches each step trained, as the Trainer fed them, and the callback's
    batch function (the supervisor is gone once the run ends)."""

    def __init__(self, tg: TrainguardTrainerCallback) -> None:
        self.tg = tg
        self.batches: dict[int, list[Any]] = {}
        self.batch_fn: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.tg.sup is not None
        self.batches[state.global_step - 1] = list(self.tg._batches)
        self.batch_fn = self.tg.sup.batch_fn


def test_the_ring_checks_batch_function_names_the_batches_each_step_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shard_batch_fn rebuilds a step's micro-batches from the loader's seeded sampler: the
    same tensors the Trainer fed, in every epoch (rank 0 here: one process)."""
    monkeypatch.setenv("TRAINGUARD_RUN_ID", "hf-trainer-test")
    tg = TrainguardTrainerCallback(sink=MemorySink(), run_dir=tmp_path / "run")
    seen = Seen(tg)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(SAMPLES, 1), callbacks=[tg, seen])
    trainer.train()
    batch_fn = seen.batch_fn
    assert batch_fn is not None and len(seen.batches) == STEPS
    for step, batches in seen.batches.items():
        theirs = batch_fn(0, step)
        assert len(theirs) == len(batches) == ACCUMULATE
        for got, fed in zip(theirs, batches, strict=True):
            assert got.keys() == fed.keys() and all(torch.equal(got[k], fed[k]) for k in got)


def test_fp16_with_a_grad_scaler_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skipped update would skip the scaler's step after clipping had unscaled the
    gradients: refused when the Trainer is built, naming it, rather than half-supervised."""
    monkeypatch.setenv("TRAINGUARD_RUN_ID", "hf-trainer-test")
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, report_to=[], save_strategy="no"
    )
    args.fp16 = True  # as on a GPU (the CPU's arguments refuse it themselves)
    with pytest.raises(ValueError, match="fp16 with a GradScaler"):
        Trainer(
            model=tiny_llama(),
            args=args,
            train_dataset=Tokens(12, 1),
            callbacks=[TrainguardTrainerCallback()],
        )
