"""trainguard in a PyTorch Lightning job: one callback, no loop edits (issue 21).

    trainer = pl.Trainer(..., callbacks=[TrainguardLightningCallback()])    # the one line

Under ``trainguard launch`` (which sets RANK, WORLD_SIZE, the TRAINGUARD_* variables and
TORCHELASTIC_RUN_ID, so that Lightning takes the process group from the environment and
spawns nothing) the callback drives a :class:`~.supervisor.Supervisor` through
Lightning's hooks:

- a step is one optimizer step, numbered by ``trainer.global_step`` (the same on every
  rank, restored on resume); its scope opens at ``on_train_batch_start`` and closes at
  ``on_train_batch_end``, where the supervisor reports the StepTiming, runs the self-check
  or ring checks due, and saves a checkpoint when one is due;
- compute time ends where this rank's last gradient bucket goes to the all-reduce: the
  supervisor's DDP comm hook on Lightning's DDP model (registered at ``on_fit_start``,
  after Lightning wrapped the model and before the first backward);
- the invariants and commanded skips: Lightning runs the forward and backward inside the
  closure it hands to the optimizer's ``step``. The callback wraps ``step`` on the torch
  optimizer itself, runs the closure, and applies the update only when ``check(loss)``
  says so. A skipped step changes nothing of the optimizer (no momentum, no Adam moments,
  no weight decay: zeroing the gradients would not be a skip); Lightning's counters move
  as for any step, the same on every rank (the ranks agree in check()'s all-reduce);
- the self-check replays a step's batch through the module's own ``training_step`` on the
  unwrapped module (no collective), its ``self.log`` calls muted;
- checkpoints are trainguard's (:class:`~..checkpoint.manager.CheckpointManager`: atomic,
  validated, under TRAINGUARD_CHECKPOINT_DIR), holding the model, the optimizer, the LR
  schedulers, the RNG states of each rank and Lightning's fit loop (epoch, batch and
  optimizer-step counters), so that the loops resume where they stopped;
- resume: with TRAINGUARD_RESUME_STEP set (the launcher's newest validated step), the
  callback loads that checkpoint at ``on_fit_start`` (the user names nothing). The loader
  restarts its epoch from the first batch, so the callback draws and drops the batches the
  epoch had already trained (it logs how many: the cost of reaching the position by
  reading; a StatefulDataLoader's own state is not used yet, it is drawn the same way),
  then puts back the RNG states, after the loader's iterator drew its seed, so the run goes
  on bitwise as if never stopped.

SIGTERM (the launcher's teardown) ends a rank the supervisor's way (ship what is queued,
exit): Lightning's own handler, set after ``on_fit_start``, is replaced at
``on_train_start``; it runs a broadcast inside the handler, which raises when the peers are
already gone, and the launcher's requested stop then read as ranks dying of a lost peer.

Limits (said rather than guessed): one optimizer, automatic optimization,
``accumulate_grad_batches=1`` (refused otherwise, with the reason); data loaders with
``num_workers=0``, or whose workers draw no randomness of their own (the dropped batches
replay the sampler, not worker RNG); the ring and cross-rank checks need a batch function
(``TrainguardLightningCallback(batch_fn=...)``) and are refused without one, as for a hand loop.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.data import _set_sampler_epoch  # what Lightning's fit loop calls
from torch.utils.data import DataLoader, DistributedSampler

from ...common.moved import forwarder
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.train_state import TrainState, capture_rng, restore_rng
from . import ring_check
from .config import ENV_RUN_ID
from .step_scope import StepScope
from .supervisor import Supervisor

log = logging.getLogger(__name__)

__all__ = ["TrainguardLightningCallback"]

ENV_CHECKPOINT_DIR = "TRAINGUARD_CHECKPOINT_DIR"
ENV_RESUME_STEP = "TRAINGUARD_RESUME_STEP"


class TrainguardLightningCallback(pl.Callback):
    """Supervision, checks and validated checkpoints for a Lightning fit (module docstring).

    `checkpoint_dir` defaults to TRAINGUARD_CHECKPOINT_DIR (the launcher's); without
    either there are no trainguard checkpoints (a warning says so). `supervisor_kwargs`
    pass through to :meth:`Supervisor.from_env` (a `sink` for tests, a `config`)."""

    def __init__(
        self,
        *,
        checkpoint_dir: str | None = None,
        checkpoint_every_steps: int | None = None,
        batch_fn: ring_check.BatchFn | None = None,
        **supervisor_kwargs: Any,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR) or None
        self.checkpoint_every_steps = checkpoint_every_steps
        self.batch_fn = batch_fn
        self.supervisor_kwargs = supervisor_kwargs
        self.sup: Supervisor | None = None
        self.checkpoints: CheckpointManager | None = None
        #: The step the fit resumed from (-1: it started afresh).
        self.resumed_from = -1
        #: Batches of the resumed epoch drawn and dropped to reach the resumed position.
        self.dropped_batches = 0
        self._scope: StepScope | None = None
        self._rng_after_resume: dict[str, Any] | None = None
        self._fitted = False

    # ------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After Lightning wrapped the model (DDP) and built the optimizer, before any batch."""
        optimizer = self._only_optimizer(trainer)
        self.resumed_from, self.dropped_batches = -1, 0
        first_fit, self._fitted = not self._fitted, True
        if not (os.environ.get(ENV_RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID")):
            log.warning(
                "trainguard: no run id (%s; not under trainguard launch or torchrun): not supervised",
                ENV_RUN_ID,
            )
            return
        model = trainer.strategy.model
        assert model is not None
        self.sup = Supervisor.from_env(
            model=model,
            optimizer=optimizer,
            checkpoint_every_steps=self.checkpoint_every_steps,
            **self.supervisor_kwargs,
        )
        self.sup.replay_fn = lambda batch: self._replay(pl_module, batch)
        self.sup.batch_fn = self.batch_fn
        self._wrap_step(optimizer)
        if self.sup.skip_batches:
            self._pass_over(trainer, pl_module, self.sup)
        if self.checkpoint_dir is None:
            log.warning("trainguard: no checkpoint directory (%s unset): no checkpoints", ENV_CHECKPOINT_DIR)
            return
        state = TrainState(model, optimizer, extra=self._extra(trainer), rank=self.sup.rank)
        self.checkpoints = CheckpointManager(
            self.checkpoint_dir,
            state,
            rank=self.sup.rank,
            world_size=self.sup.world_size,
            run_id=self.sup.run_id,
            reporter=self.sup.agent,
        )
        self.sup.checkpoint = self.checkpoints  # it saves at the end of a step when one is due
        # The launcher's step is for the attempt's first fit: a later one trains on, never rewound.
        resume = int(os.environ.get(ENV_RESUME_STEP, "-1")) if first_fit else -1
        if resume >= 0:
            self.resumed_from = self.checkpoints.load(resume)  # validated checkpoints only
            # The RNG states go back after the loader's iterator drew its seed (on_train_start).
            self._rng_after_resume = capture_rng()

    @staticmethod
    def _only_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer:
        why = []
        if len(trainer.optimizers) != 1:
            why.append(f"{len(trainer.optimizers)} optimizers (one is supported)")
        if not trainer.lightning_module.automatic_optimization:
            why.append("manual optimization (automatic is supported)")
        if trainer.accumulate_grad_batches != 1:
            why.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (1 is supported)")
        if why:
            raise ValueError("TrainguardLightningCallback: " + "; ".join(why))
        return trainer.optimizers[0]

    @staticmethod
    def _extra(trainer: pl.Trainer) -> dict[str, Any]:
        """What a checkpoint holds besides model, optimizer and RNG: the fit loop's counters
        (epoch, batches, optimizer steps) and the LR schedulers, restored in place."""
        extra: dict[str, Any] = {"fit_loop": trainer.fit_loop}
        for i, config in enumerate(trainer.lr_scheduler_configs):
            extra[f"lr_scheduler{i}"] = config.scheduler
        return extra

    @staticmethod
    def _pass_over(trainer: pl.Trainer, pl_module: pl.LightningModule, sup: Supervisor) -> None:
        """The launcher's skip list (TRAINGUARD_SKIP_BATCHES: a step that failed on every
        node): the batch of such a step is drawn and not trained on, on every rank alike
        (``training_step`` returns None, which Lightning takes as nothing to step)."""
        inner = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if trainer.global_step in sup.skip_batches:
                sup.counters.skipped_batches += 1
                log.warning(
                    "rank %d: batch of step %d skipped (the launcher's skip list)",
                    sup.rank,
                    trainer.global_step,
                )
                return None
            return inner(*args, **kwargs)

        pl_module.training_step = training_step  # type: ignore[method-assign]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The loader's iterator exists (Lightning made it in setup_data): a resumed fit
        drops the batches its epoch had already trained, then takes back its RNG states."""
        if self.sup is not None:
            # Lightning set its SIGTERM handler after on_fit_start: the launcher's stop is ours.
            self.sup.take_sigterm()
            if self.sup.batch_fn is None:
                self.sup.batch_fn = sampler_batch_fn(trainer)
        if self._rng_after_resume is None:
            return
        rng, self._rng_after_resume = self._rng_after_resume, None
        loop = trainer.fit_loop
        # Lightning types `current` as its base tracker; it is a _ProcessedTracker here.
        done: int = loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        fetcher = loop._data_fetcher  # Lightning's own: no public way to advance it
        if done >= trainer.num_training_batches and fetcher is not None:
            # Saved at an epoch's last batch: the next epoch's iterator draws its seed from
            # the restored RNG, as it did when the run went on (Lightning, restarting, makes none).
            restore_rng(rng)
            iter(fetcher)
            return
        if done > 0 and fetcher is not None:
            epoch: int = loop.epoch_progress.current.processed  # type: ignore[attr-defined]
            assert loop._combined_loader is not None
            for loader in loop._combined_loader.flattened:  # as Lightning will, before the first batch
                _set_sampler_epoch(loader, epoch)
            for _ in range(done):
                next(fetcher)
            fetcher.fetched -= done  # the epoch loop adds the resumed count itself
            self.dropped_batches = done
            log.info("trainguard: resumed in epoch %d: dropped the %d batches it had trained", epoch, done)
        restore_rng(rng)

    # ------------------------------------------------------------------ one step
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sup is None or trainer.global_step in self.sup.skip_batches:
            return  # unsupervised, or a batch passed over (_pass_over): not a step
        self._scope = self.sup.step(trainer.global_step, batch)
        self._scope.__enter__()

    def _wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Lightning calls ``optimizer.step(closure)``, the closure running the forward and
        backward: run it, end the compute, and step only if the ranks agree to apply."""
        step = optimizer.step

        def supervised_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            scope = self._scope
            if scope is None:  # outside a supervised step (a user's own call)
                return step(closure, **kwargs)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            scope.compute_done()  # DDP: its comm hook marked it already
            if loss is None:  # training_step returned None: nothing to step (a skipped batch)
                return None
            if scope.check(loss):
                step(**kwargs)
            return loss

        optimizer.step = supervised_step  # type: ignore[method-assign]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end_scope(None, None, None)

    def _end_scope(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(kind, error, tb)

    def _replay(self, pl_module: pl.LightningModule, batch: Any) -> None:
        """The self-check's replay: the step's batch through ``training_step`` of the
        unwrapped module (no DDP, so no collective), then backward."""
        with _muted_logging(pl_module):
            out = pl_module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, Mapping) else out
        assert isinstance(loss, torch.Tensor), "training_step returned no loss to replay"
        loss.backward()

    # ------------------------------------------------------------------ the end
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end_scope(type(exception), exception, exception.__traceback__)
        self._close(exit_code=1, error=exception)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(exit_code=0)

    def _close(self, exit_code: int, error: BaseException | None = None) -> None:
        checkpoints, self.checkpoints = self.checkpoints, None
        if checkpoints is not None and error is None:
            checkpoints.close()  # the pending saves finish and validate
        sup, self.sup = self.sup, None
        if sup is not None:
            if sup.optimizer is not None:  # the instance's wrapper (_wrap_step): back to the class's step
                vars(sup.optimizer).pop("step", None)
            sup.close(exit_code=exit_code, error=error)


def sampler_batch_fn(trainer: pl.Trainer) -> ring_check.BatchFn | None:
    """The batch any rank trains at a step, for the ring and cross-rank checks: Lightning
    shards a map-style dataset with a DistributedSampler (seeded, shuffled by epoch), so
    rank r's batch at step s is the (s mod batches per epoch)-th slice of r's indices in
    epoch s // batches per epoch, collated and moved as Lightning does. None (the checks
    are refused with the reason) for a loader without one."""
    loader = trainer.train_dataloader
    sampler = getattr(loader, "sampler", None)
    size = getattr(loader, "batch_size", None)
    per_epoch = trainer.num_training_batches
    if not isinstance(sampler, DistributedSampler) or not size or not math.isfinite(per_epoch):
        return None
    assert isinstance(loader, DataLoader)
    dataset, collate = loader.dataset, loader.collate_fn

    def batch_of(rank: int, step: int) -> Any:
        epoch, index = divmod(step, int(per_epoch))
        theirs: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=sampler.num_replicas,
            rank=rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        theirs.set_epoch(epoch)
        indices = list(theirs)[index * size : (index + 1) * size]
        return trainer.strategy.batch_to_device(collate([dataset[i] for i in indices]))

    return batch_of


@contextmanager
def _muted_logging(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` inside a replayed ``training_step`` records nothing (the step logged once)."""
    module.log = _ignore  # type: ignore[method-assign]
    module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


# A script's old name keeps working for a while, with a warning naming the public one.
__getattr__ = forwarder(
    __name__, {"TrainguardCallback": (f"{__name__}:TrainguardLightningCallback", "trainguard.lightning")}
)
