"""The Lightning callback on one CPU process (no broker: the supervisor's events go to a
MemorySink): a resumed fit ends bitwise where an uninterrupted one does, from a step in
the middle of an epoch and from an epoch's last step; a commanded skip leaves the model
and the optimizer untouched; a commanded self-check replays through training_step.
The multi-rank path (gloo, the launcher, a SIGKILL) is tests/producers/test_frameworks_launch.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

from trainguard.lightning import TrainguardLightningCallback  # noqa: E402
from trainguard.producers.rank.agent import MemorySink  # noqa: E402
from trainguard.schemas import SdcSelfCheck, StepStats, StepTiming  # noqa: E402

BATCHES_PER_EPOCH = 8
EPOCHS = 3


class Tiny(pl.LightningModule):
    """Dropout and AdamW with a per-step LR schedule: RNG, optimizer moments and the
    scheduler all have to come back for a resumed fit to end bitwise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


class Commands(pl.Callback):
    """What the actuator would do on a SkipUpdate or a RunSelfCheck, before the fit starts."""

    def __init__(
        self, tg: TrainguardLightningCallback, skip: int | None = None, self_check: int | None = None
    ) -> None:
        self.tg, self.skip, self.self_check = tg, skip, self_check
        self.before_skip: dict[str, Any] = {}
        self.after_skip: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.tg.sup is not None
        if self.skip is not None:
            self.tg.sup.control.skip_steps.add(self.skip)
        if self.self_check is not None:
            self.tg.sup.control.self_checks_due.append(self.self_check)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.skip:
            self.before_skip = snapshot(trainer)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == (self.skip or -2) + 1:
            self.after_skip = snapshot(trainer)


def snapshot(trainer: Any) -> dict[str, Any]:
    model = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
    state = trainer.optimizers[0].state_dict()["state"]
    moments = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)} for k, s in state.items()}
    return {"model": model, "moments": moments}


def fit(
    tmp: Path,
    ckpt: Path,
    monkeypatch: pytest.MonkeyPatch,
    resume: int = -1,
    skip_batches: str = "",
    **commands: Any,
) -> tuple[Tiny, TrainguardLightningCallback, MemorySink, Commands]:
    monkeypatch.setenv("TRAINGUARD_RUN_ID", "lightning-test")
    monkeypatch.setenv("TRAINGUARD_RESUME_STEP", str(resume))
    monkeypatch.setenv("TRAINGUARD_SKIP_BATCHES", skip_batches)
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEEP", "1000")  # every step's kept: resumed from any
    sink = MemorySink()
    tg = TrainguardLightningCallback(
        checkpoint_dir=str(ckpt), checkpoint_every_steps=1, sink=sink, run_dir=tmp / "run"
    )
    cmds = Commands(tg, **commands)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        callbacks=[tg, cmds],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    module = Tiny()
    trainer.fit(module, train_dataloaders=loader())
    return module, tg, sink, cmds


def same_weights_as(module: nn.Module, weights: dict[str, Any]) -> bool:
    state = module.state_dict()
    return state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in state)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tiny, Path, MemorySink]:
    tmp = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as mp:
        module, tg, sink, _ = fit(tmp, tmp / "ckpt", mp)
    assert tg.resumed_from == -1
    return module, tmp / "ckpt", sink


def test_every_step_is_reported_once_with_its_stats(uninterrupted: tuple[Tiny, Path, MemorySink]) -> None:
    _, _, sink = uninterrupted
    steps = [e.step for e in sink.of(StepTiming)]
    assert steps == list(range(BATCHES_PER_EPOCH * EPOCHS))
    assert all(e.compute_s <= e.total_s for e in sink.of(StepTiming))
    assert len(sink.of(StepStats)) == len(steps)


@pytest.mark.parametrize("resume", [3, BATCHES_PER_EPOCH - 1, BATCHES_PER_EPOCH + 5])
def test_a_resumed_fit_ends_bitwise_where_the_uninterrupted_one_does(
    uninterrupted: tuple[Tiny, Path, MemorySink], resume: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, saved, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    module, tg, sink, _ = fit(tmp_path, ckpt, monkeypatch, resume=resume)
    assert tg.resumed_from == resume
    assert tg.dropped_batches == (resume + 1) % BATCHES_PER_EPOCH
    assert [e.step for e in sink.of(StepTiming)] == list(range(resume + 1, BATCHES_PER_EPOCH * EPOCHS))
    assert same_weights(module, whole)
    if resume == BATCHES_PER_EPOCH + 5:  # once: a second fit in the process does not resume again
        second_fit_trains_on(module, tg, sink, tmp_path)


def second_fit_trains_on(
    module: Tiny, tg: TrainguardLightningCallback, sink: MemorySink, tmp_path: Path
) -> None:
    """The launcher's resume step is for the attempt's first fit: a second Trainer fitting
    the module with the same callback trains on from its weights, never rewound."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    sink.events.clear()
    again = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, callbacks=[tg], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    again.fit(module, train_dataloaders=loader())
    assert tg.resumed_from == -1 and tg.dropped_batches == 0
    assert [e.step for e in sink.of(StepTiming)] == list(range(BATCHES_PER_EPOCH))
    assert not same_weights_as(module, before)  # it trained on from where the first fit ended


def test_a_commanded_skip_leaves_model_and_optimizer_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tg, sink, cmds = fit(tmp_path, tmp_path / "ckpt", monkeypatch, skip=5)
    before, after = cmds.before_skip, cmds.after_skip
    assert before and after
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert before["moments"].keys() == after["moments"].keys()
    for key, moments in before["moments"].items():
        assert all(torch.equal(t, after["moments"][key][n]) for n, t in moments.items())
    stats = {e.step: e for e in sink.of(StepStats)}
    assert len(stats) == BATCHES_PER_EPOCH * EPOCHS  # the skipped step is still a step


def test_a_commanded_self_check_replays_the_step_through_training_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: tuple[Tiny, Path, MemorySink]
) -> None:
    module, _, sink, _ = fit(tmp_path, tmp_path / "ckpt", monkeypatch, self_check=9)
    (result,) = sink.of(SdcSelfCheck)
    assert result.step == 9 and result.passed
    assert same_weights(module, uninterrupted[0])  # the replay changed nothing of the run


def test_a_batch_on_the_launchers_skip_list_is_drawn_and_not_trained_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRAINGUARD_SKIP_BATCHES (a step that failed on every node): its batch is passed over,
    as Supervisor.steps does in a hand-written loop, and the fit goes on."""
    # Commands(skip=5) snapshots around step 5 (its commanded skip is never reached: no scope)
    _, tg, sink, cmds = fit(tmp_path, tmp_path / "ckpt", monkeypatch, skip_batches="5", skip=5)
    assert [e.step for e in sink.of(StepTiming)] == [s for s in range(BATCHES_PER_EPOCH * EPOCHS) if s != 5]
    before, after = cmds.before_skip, cmds.after_skip
    assert before and after
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    for key, moments in before["moments"].items():
        assert all(torch.equal(t, after["moments"][key][n]) for n, t in moments.items())


def test_outside_a_launcher_the_fit_runs_unsupervised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python train.py` with the callback in place and no run id: a warning, and the fit."""
    for name in ("TRAINGUARD_RUN_ID", "TORCHELASTIC_RUN_ID", "TRAINGUARD_RESUME_STEP"):
        monkeypatch.delenv(name, raising=False)
    tg = TrainguardLightningCallback(checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[tg],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), train_dataloaders=loader())
    assert trainer.global_step == 3 and tg.sup is None and not (tmp_path / "ckpt").exists()
