"""Supervising a torch training loop: the few lines a user adds to their own loop.

The model, optimizer and data loader stay the user's; the :class:`Supervisor` of a rank
measures each step, checks the cheap invariants, reports through its
:class:`~..rank.agent.RankAgent` (never blocking: the agent only queues events), and executes
the commands the processors send (:mod:`..rank.handlers`)::

    sup = Supervisor.from_env(model=model, optimizer=opt)     # env set by the launcher
    sup.replay_fn = lambda batch: loss_fn(model.module(batch)).backward()   # self-check
    for step, batch in sup.steps(loader, start=resumed_step + 1):
        with sup.step(step, batch) as s:
            loss = loss_fn(model(batch))
            loss.backward()
            s.compute_done()                                   # single process: ends compute
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if s.check(loss, norm):                            # False: do not apply
                opt.step()
            opt.zero_grad()
    sup.close()

Compute time before the collective (seed §7 failure 2): after the all-reduce every rank
has waited for the slowest, so only the time before it tells ranks apart. compute_s is
step start to the moment this rank's last gradient bucket goes to the all-reduce (a DDP
comm hook, :meth:`Supervisor.instrument_ddp`; how and why in :mod:`.timing`) or to
:meth:`StepScope.compute_done`, whichever comes first; total_s is the whole scope.

Invariants (seed §7 failure 3 (a)), in :meth:`StepScope.check`: a non-finite loss or grad
norm is never applied (StepStats finite=False goes out; the processors decide the abort,
or set ``on_non_finite="raise"``); a grad norm above 10 x the running p99 of accepted
steps (after 50 of them; the core's definition, processors/core/detectors/sdc_state.py) is skipped
and counted; a step named by a SkipUpdate command is skipped. Under torch.distributed
the ranks agree on skipping with one all-reduce of a scalar (MAX), so that a skip seen by
one rank (its own NaN loss, a command that reached it first) skips everywhere and the
replicas never diverge.

Checkpoints (seed §6): a checkpoint is due at a step boundary when a CheckpointNow came
or the interval in force has passed, counted in steps from the measured step time
(:mod:`..checkpoint.cadence`); the interval in force is the last SetCheckpointInterval, else
the launcher's (TRAINGUARD_CHECKPOINT_INTERVAL_S: the last interval the run was sent),
else none. ``checkpoint_every_steps`` replaces it with a fixed cadence. The ranks agree on
the step in check()'s all-reduce; with a `checkpoint` manager the supervisor saves, else
the loop asks ``should_checkpoint(step)`` after the step and saves itself::

        if sup.should_checkpoint(step):   # the same answer on every rank
            ckpt.save(step)
            sup.checkpoint_saved(step)

SDC checks (R3): a RunSelfCheck, RunRingCheck or RunCrossRankCheck is run at the end of
the step the ranks agree on (:mod:`.agreement`), by :mod:`.replay_checks`, which says
what each needs (``replay_fn``, ``batch_fn``).

Chaos knob: with TRAINGUARD_INJECT_WRONG_DEVICE naming this rank's node and local rank
(:mod:`..chaos`), the supervisor makes this process's matrix products wrong from
the named step on, installed at that step's start.

Skipped batches: a step that failed on every node (data or code) and that the policy
allows to skip comes back from the launcher as TRAINGUARD_SKIP_BATCHES; :meth:`steps`
reads and drops its batch, so the restarted run goes past it.

Phases (Heartbeat.phase): the supervisor tells its agent what the loop is doing, one
attribute store at each boundary: forward from the step's start, allreduce once this
rank's compute is done (the comm hook or compute_done()) and while the ranks agree in
check(), optimizer after check(), checkpoint while saving, data between steps (the
loader). When no stack dump arrives after a hang, the rank whose last phase differs from
everyone waiting in the all-reduce is the culprit (processors/core/detectors/stacks.py).

Nothing here blocks on the broker, the network or storage: events are queued; commands
are read and acked on the actuator's thread; GPU health is sampled on its own thread;
heartbeats come from the shipper's thread, so they continue while a step is stuck.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from ...common.moved import deprecate_names
from ...common.quantiles import RunningQuantile
from ...kafka.topics import topic_names
from ...schemas import auth
from ..chaos import WrongDevice, install_wrong_device, reader_for_rank
from ..checkpoint.cadence import CheckpointCadence
from ..command_roles import Role, kinds_of
from ..rank.actuator import Actuator
from ..rank.agent import EventSink, MemorySink, NodeAgents, RankAgent
from ..rank.handlers import CheckpointManager, RankControl, RankHandlers
from ..rank.shipper import ShipperConfig, TelemetryShipper
from . import cross_check, fsdp, grad_checks, inprocess, ring_check
from .agreement import agree
from .config import (
    ENV_BOOTSTRAP,
    NonFiniteLoss,
    SupervisorConfig,
    SupervisorCounters,
    UpdateVerdict,
    init_process_group,
    process_start_ts,
    supervisor_arguments,
)
from .exit_hooks import ExitHooks
from .gpu_health import GpuHealthSampler, HealthReader
from .peer_loss import peer_lost
from .rank_files import ProgressFile, note_closed, note_exit, write_phases
from .replay_checks import ReplayChecks, is_ddp
from .step_scope import StepScope
from .timing import _CudaMarks, _HostMarks, _Pending, compute_marking_hook

log = logging.getLogger(__name__)

# What a training script imports from here (docs/examples/train_tiny.py); the settings
# and the verdicts live in config.py.
__all__ = [
    "NonFiniteLoss",
    "StepScope",
    "Supervisor",
    "SupervisorConfig",
    "UpdateVerdict",
    "init_process_group",
    "process_start_ts",
]

# --------------------------------------------------------------------------- supervisor


class Supervisor(ExitHooks):
    """One rank's supervision: agent, shipper, actuator and handlers, GPU health.

    Telemetry goes to `sink` when given (no broker: tests, dry runs), else to Kafka at
    `bootstrap` (with the actuator reading the run's commands, which needs the master
    `secret`), else to an in-memory :class:`MemorySink` (a warning says so)."""

    def __init__(
        self,
        run_id: str,
        rank: int = 0,
        world_size: int = 1,
        attempt: int = 0,
        node: str = "",
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        params: Iterable[torch.Tensor] | None = None,
        checkpoint: CheckpointManager | None = None,
        replay_fn: Callable[[Any], object] | None = None,
        batch_fn: ring_check.BatchFn | None = None,
        sink: EventSink | None = None,
        bootstrap: str | None = None,
        topic_prefix: str = "",
        secret: bytes | None = None,
        run_dir: Path | str | None = None,
        phases_file: Path | str | None = None,
        progress_file: Path | str | None = None,
        config: SupervisorConfig | None = None,
        gpu_reader: HealthReader | None | Literal["auto"] = "auto",
        terminate: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.perf_counter,
        skip_batches: Iterable[int] = (),
        checkpoint_every_steps: int | None = None,
        local_rank: int = 0,
        wrong_device: WrongDevice | None = None,
    ) -> None:
        #: When it was made: the model and DDP were built before it (a restart phase).
        self.created_ts = time.time()
        self.config = config or SupervisorConfig()
        if checkpoint_every_steps is not None:
            self.config = dataclasses.replace(self.config, checkpoint_every_steps=checkpoint_every_steps)
        #: Steps whose batch steps() passes over (the launcher's TRAINGUARD_SKIP_BATCHES).
        self.skip_batches = frozenset(skip_batches)
        self.run_id, self.rank, self.world_size, self.attempt = run_id, rank, world_size, attempt
        self.node = node or socket.gethostname()
        self.model = model
        self.optimizer = optimizer
        self.params = grad_checks.param_list(model, optimizer, params)
        self.checkpoint = checkpoint
        self.replay_fn = replay_fn
        #: ``batch_fn(rank, step)``: the batch any rank trains on at a step (ring checks).
        self.batch_fn = batch_fn
        self.local_rank = local_rank
        #: The chaos knob's wrong device, when it names this rank's node and local rank.
        self.wrong_device = (
            wrong_device
            if wrong_device is not None and wrong_device.strikes(node or socket.gethostname(), local_rank)
            else None
        )
        self.ring_results: list[ring_check.RingResult] = []
        self.cross_results: list[cross_check.CrossResult] = []
        self.run_dir = Path(run_dir) if run_dir is not None else Path("trainguard-runs") / run_id
        self.phases_file = Path(phases_file) if phases_file is not None else None
        self.progress_file = Path(progress_file) if progress_file is not None else None
        self.progress = ProgressFile(self.progress_file)
        self.counters = SupervisorCounters()
        self.control = RankControl(checkpoint_interval_s=self.config.checkpoint_interval_s)
        self.self_check_results: list[grad_checks.SelfCheckResult] = []
        self._clock = clock
        cfg = self.config
        self.cadence = CheckpointCadence.for_run(
            cfg.checkpoint_interval_s, cfg.checkpoint_every_steps, cfg.mtbf_prior_s, world_size
        )
        if rank == 0 and (note := self.cadence.opening_note(world_size)):
            log.warning("trainguard: %s", note)  # rank 0 says the cadence once at the start
        #: (step, checkpoint due) as the ranks agreed in check(); cleared by checkpoint_saved.
        self._agreed: tuple[int, bool] | None = None
        #: Elastic training, a loop that saves itself: the step whose save ends the attempt.
        self._resize_at: int | None = None
        self._grad_norms = RunningQuantile()
        self._pending: deque[_Pending] = deque()
        self._scope: StepScope | None = None
        self._batches: dict[int, Any] = {}
        self._closed = False
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        cuda = any(p.is_cuda for p in self.params)
        self._marks: _HostMarks | _CudaMarks = _CudaMarks() if cuda else _HostMarks(clock)
        # Before any thread starts: a malformed TRAINGUARD_INJECT_HEALTH fails the rank here.
        reader = reader_for_rank(rank) if gpu_reader == "auto" else gpu_reader

        # Telemetry: a sink, or a shipper with heartbeats from its flush thread.
        self.beats = NodeAgents(self.config.heartbeat_interval_s)
        self.shipper: TelemetryShipper | None = None
        self.actuator: Actuator | None = None
        if sink is None and bootstrap:
            names = topic_names(topic_prefix)
            self.shipper = TelemetryShipper(
                ShipperConfig(bootstrap, names.telemetry, flush_interval_s=self.config.flush_interval_s),
                run_id,
                world_size,
                on_flush=self.beats.on_flush,
                name=f"rank{rank}",
            )
            sink = self.shipper
        elif sink is None:
            log.warning("trainguard: no broker (%s unset): telemetry is kept in memory only", ENV_BOOTSTRAP)
            sink = MemorySink()
        self.sink: EventSink = sink
        self.agent = self.beats.add(RankAgent(sink, run_id, attempt, rank, self.node))
        if self.shipper is None:  # no shipper thread to carry the heartbeats
            self._ticker = threading.Thread(target=self._tick, name="trainguard-heartbeat", daemon=True)
            self._ticker.start()

        self.checks = ReplayChecks(self)
        self.handlers = RankHandlers(
            self.agent,
            self.control,
            self.run_dir,
            close_telemetry=self._close_telemetry,
            terminate=terminate,
            grace_s=self.config.exit_grace_s,
            flush_s=self.config.exit_flush_s,
            can_self_check=self.checks.self_check_missing,
            can_ring_check=self.checks.ring_check_missing,
            can_cross_check=self.checks.cross_check_refusal,
        )
        if bootstrap and self.shipper is not None:
            if secret is None:
                secret = auth.load_master_secret()
            names = topic_names(topic_prefix)
            self.actuator = Actuator(
                bootstrap,
                names.commands,
                names.acks,
                run_id,
                attempt,
                [rank],
                auth.run_key(secret, run_id),
                node=self.node,
                instance=f"{self.node}-rank{rank}",
                journal_path=self.run_dir / "actuator" / f"rank-{rank:05d}.journal",
                # A rank on a new node reads its group from here, not from the topic's end: a
                # command for this attempt may come while it is being assigned (2 s: clocks).
                start_ts=process_start_ts() - 2.0,
                executes=kinds_of(Role.RANK),  # the launcher's kinds are not a rank's to ack
            )
            self.handlers.register(self.actuator)
            self.actuator.start()

        self.gpu = GpuHealthSampler(self.agent.gpu_health, reader, self.config.gpu_health_interval_s).start()

        if self.config.instrument_ddp and model is not None and is_ddp(model):
            self.instrument_ddp(model)
        elif self.config.instrument_ddp and model is not None:
            fsdp.instrument(self, model)  # FSDP (fully_shard): none without an FSDP module

        self._install_exit_hooks()  # an error or SIGTERM ends the rank the supervisor's way
        restartable = inprocess.current()
        if restartable is not None:  # the attempt may end in this process (inprocess.py)
            restartable.on_restart(self._end_attempt)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kwargs: Any) -> Supervisor:
        """Build from the launcher's environment (config.supervisor_arguments says which
        variables); keyword arguments (model, optimizer, checkpoint, sink...) pass through."""
        return cls(**supervisor_arguments(dict(os.environ) if env is None else env, kwargs))

    def instrument_ddp(
        self, ddp: torch.nn.Module, inner: Callable[..., Any] | None = None, state: Any = None
    ) -> None:
        """Register a comm hook on a DistributedDataParallel model that marks the end of
        this rank's compute when the last bucket goes to the all-reduce, then runs `inner`
        (default: a per-parameter all-reduce when `config.deterministic_reduction`, else DDP's
        plain all-reduce) with `state`. DDP takes one hook per model."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        default = (
            grad_checks.per_parameter_allreduce if self.config.deterministic_reduction else allreduce_hook
        )

        def compute_done() -> None:
            if self._scope is not None:
                self._scope.compute_done()

        ddp.register_comm_hook(state, compute_marking_hook(inner or default, compute_done))  # type: ignore[operator]

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """With a broker: True once the actuator reads the commands topic (tests, drills)."""
        return self.actuator is None or self.actuator.wait_ready(timeout_s)

    # ------------------------------------------------------------------ loop API
    def steps(self, loader: Iterable[Any], start: int = 0) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` pairs numbered from `start`; ``sup.step(step)`` then knows the
        batch (for the self-check replay) without being given it. A step of
        `skip_batches` is passed over: its batch is read and dropped, on every rank alike
        (they all have the launcher's list), so the job never trains on it."""
        self.agent.phase = "data"
        for step, batch in enumerate(loader, start):
            if step in self.skip_batches:
                self.counters.skipped_batches += 1
                log.warning("rank %d: batch of step %d skipped (the launcher's skip list)", self.rank, step)
                continue
            self._batches = {step: batch}
            yield step, batch
            self.agent.phase = "data"  # the loader fetches the next batch

    def step(self, step: int, batch: Any = None, microbatch_id: str | None = None) -> StepScope:
        """The scope of one step (a context manager); see the module docstring."""
        if batch is None:
            batch = self._batches.get(step)
        mb = microbatch_id or f"step-{step}/rank-{self.rank}"
        return StepScope(self, step, batch, mb)

    def should_checkpoint(self, step: int | None = None, now: float | None = None) -> bool:
        """True when a checkpoint after `step` is due: a CheckpointNow came, or the interval in
        force has passed (module docstring). After check() of that step, the answer the ranks
        agreed on, the same on every rank; for loops that save themselves (no `checkpoint`
        manager given): save, then call :meth:`checkpoint_saved`."""
        agreed = self._agreed
        if step is not None and agreed is not None and agreed[0] == step:
            return agreed[1]
        return self._wants_checkpoint(step, now)

    def checkpoint_saved(self, step: int, now: float | None = None) -> None:
        """A loop that saves itself says so after its save of `step`. Under elastic
        training, when the ranks agreed to resize at that step, the attempt ends here
        (:class:`.inprocess.WorldResize`): the next one resumes from that checkpoint."""
        self.cadence.saved(step, time.monotonic() if now is None else now)
        self._agreed = (step, False)
        self.counters.checkpoints += 1
        if self._resize_at == step and self.checkpoint is None:
            self._leave_for_resize(step)

    def _wants_checkpoint(self, step: int | None, now: float | None = None) -> bool:
        """This rank's own answer (consumes a CheckpointNow)."""
        if self.control.take_checkpoint_request():
            return True
        with self.control.lock:
            interval = self.control.checkpoint_interval_s
        if (note := self.cadence.follow(interval)) and self.rank == 0:
            log.warning("trainguard: checkpoint %s", note)
        if step is None:
            step = self.control.current_step
        return self.cadence.due(step, time.monotonic() if now is None else now)

    # ------------------------------------------------------------------ internals
    def _begin(self, scope: StepScope) -> None:
        self._scope = scope
        self.cadence.begin(scope.step, time.monotonic())
        if self.wrong_device is not None and scope.step >= self.wrong_device.from_step:
            log.warning("rank %d: injected faulty device from step %d", self.rank, scope.step)
            install_wrong_device(self.wrong_device.bias, self.wrong_device.delay_s)  # chaos (producers/chaos)
            self.wrong_device = None
        with self.control.lock:
            self.control.current_step = scope.step
            self.control.training_thread = threading.get_ident()

    def _check(
        self, scope: StepScope, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None
    ) -> bool:
        loss_f = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        if grad_norm is None and self.config.measure_grad_norm and self.params:
            norm: float | None = grad_checks.grad_norm(self.params)
        elif isinstance(grad_norm, torch.Tensor):
            norm = float(grad_norm.detach().float().item())
        else:
            norm = None if grad_norm is None else float(grad_norm)
        scope.loss, scope.grad_norm = loss_f, norm
        verdict = self._local_verdict(scope.step, loss_f, norm)
        wants_checkpoint = int(self._wants_checkpoint(scope.step))
        restartable = inprocess.current()
        if restartable is not None and restartable.resize_now(bool(wants_checkpoint)):
            wants_checkpoint = 2  # a planned resize at this boundary: checkpoint, then leave
        verdict, code, scope.ring_check_due, scope.cross_check_due, scope.self_check_due = agree(
            self.control,
            verdict,
            wants_checkpoint,
            self.rank,
            self.collective_device,
            self.config.agree_on_skip,
            self_check=self.checks.offer_self_check(scope),
        )
        due, scope.resize_due = code > 0, code == 2
        scope.checkpoint_due, self._agreed = due, (scope.step, due)
        scope.verdict = verdict
        if verdict is UpdateVerdict.APPLY:
            if norm is not None:
                self._grad_norms.add(norm, self.config.grad_norm_window)
            self.counters.applied += 1
        else:
            attr = {
                UpdateVerdict.NON_FINITE: "non_finite",
                UpdateVerdict.GRAD_SPIKE: "grad_spikes",
                UpdateVerdict.COMMANDED: "commanded_skips",
                UpdateVerdict.PEER: "peer_skips",
            }[verdict]
            setattr(self.counters, attr, getattr(self.counters, attr) + 1)
            log.warning("rank %d step %d: update not applied (%s)", self.rank, scope.step, verdict)
        self.control.record_decision(scope.step, verdict is UpdateVerdict.APPLY)
        if verdict is UpdateVerdict.NON_FINITE and self.config.on_non_finite == "raise":
            raise NonFiniteLoss(f"step {scope.step}: loss {loss_f}, grad norm {norm}")
        return verdict is UpdateVerdict.APPLY

    def _local_verdict(self, step: int, loss: float, norm: float | None) -> UpdateVerdict:
        if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
            return UpdateVerdict.NON_FINITE
        if self.control.take_skip(step):
            return UpdateVerdict.COMMANDED
        judged = norm is not None and len(self._grad_norms) >= self.config.grad_norm_min_samples
        if judged and norm > self.config.grad_spike_multiplier * self._grad_norms.quantile(0.99):  # type: ignore[operator]
            return UpdateVerdict.GRAD_SPIKE
        return UpdateVerdict.APPLY

    def collective_device(self) -> torch.device:
        """Where the supervisor's own collectives' tensors live: NCCL needs CUDA ones."""
        dist = torch.distributed
        nccl = bool(self.params) and dist.get_backend() == "nccl"
        return self.params[0].device if nccl else torch.device("cpu")

    def _end(self, scope: StepScope, failed: bool) -> None:
        end = self._marks.mark()
        compute = scope._compute if scope._compute is not None else end
        self._scope = None
        self.counters.steps += 1
        if self.counters.steps == 1:
            write_phases(self.phases_file, scope.step, self.checkpoint, self.created_ts)
        if failed:  # it raised (a peer died mid-collective...): not a completed step, no StepTiming
            self._drain(block=False)
            return
        self._pending.append(_Pending(scope.step, scope._start, compute, end, scope.loss, scope.grad_norm))
        self._drain(block=False)
        self.progress.write(scope.step)
        if scope.verdict is None:  # the loop did not call check(): assume it applied
            self.control.record_decision(scope.step, True)
        self.checks.end_of_step(scope)
        self.checks.ring_check(scope)
        self.checks.cross_check(scope)
        due = scope.checkpoint_due  # None: check() was not called, so nothing was agreed
        if due is None:
            due = self.checkpoint is not None and self._wants_checkpoint(scope.step)
        if due and self.checkpoint is not None:
            self.agent.phase = "checkpoint"
            self.checkpoint.save(scope.step)
            self.checkpoint_saved(scope.step)
        if scope.resize_due and self.checkpoint is not None:
            self._leave_for_resize(scope.step)
        elif scope.resize_due:  # the loop saves itself: it leaves once it said it saved
            self._resize_at = scope.step

    def _leave_for_resize(self, step: int) -> None:
        """The ranks agreed to resize at `step` (the launcher asked: elastic.py): its
        checkpoint is written and validated, then the attempt ends here, in this process,
        and the next one (of the new size) resumes from it: no work lost."""
        self._resize_at = None
        wait = getattr(self.checkpoint, "wait_validated", None)
        if wait is not None:
            wait()  # rank 0's validation; every rank's write (a loop's own save: its own affair)
        log.warning("rank %d: leaving the attempt at step %d for a resize of the world", self.rank, step)
        raise inprocess.WorldResize(f"{inprocess.RESIZED} at the checkpoint of step {step}")

    def _drain(self, block: bool) -> None:
        marks = self._marks
        while self._pending:
            p = self._pending[0]
            if block and isinstance(marks, _CudaMarks):
                p.end.synchronize()
            elif not marks.ready(p.start, p.compute, p.end):
                return
            self._pending.popleft()
            compute_s = marks.seconds(p.start, p.compute)
            total_s = max(compute_s, marks.seconds(p.start, p.end))
            self.agent.step(p.step, compute_s, total_s, loss=p.loss, grad_norm=p.grad_norm)

    def _tick(self) -> None:
        while not self._ticker_stop.wait(min(1.0, self.config.heartbeat_interval_s)):
            self.beats.on_flush()

    def _close_telemetry(self, timeout_s: float) -> None:
        """Ship what is queued, bounded by timeout_s (used before an exit)."""
        self._drain(block=True)
        if self.shipper is not None:
            self.shipper.close(timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def close(
        self, exit_code: int | None = 0, timeout_s: float = 10.0, error: BaseException | None = None
    ) -> None:
        """End of training: report the rank's exit (`error`: what ended it, if anything),
        stop the threads, ship what is left."""
        if self._shut():
            lost = peer_lost(error)
            if lost is not None:
                note_exit(self.phases_file, lost)
            self._drain(block=True)
            if not self.agent.exited:
                self.agent.exit(exit_code=exit_code, peer_lost=lost is not None)
            self._release_clients(timeout_s)
            note_closed(self.phases_file, exit_code)  # last: the rank's telemetry is out

    def _end_attempt(self, error: BaseException | None) -> None:
        """In-process restart (inprocess.py): the attempt ended and this process lives on.
        As close(), but no exit is reported (the rank goes on in the next attempt, with its
        own Supervisor), and the Kafka clients' last flush runs aside, not waited for."""
        if self._shut():
            self.agent.exited = True  # this attempt's heartbeats stop
            if isinstance(self._marks, _HostMarks):  # CUDA events after an abort may never complete
                self._drain(block=True)
            flush_s = (self.config.exit_flush_s,)
            threading.Thread(target=self._release_clients, args=flush_s, daemon=True).start()

    def _shut(self) -> bool:
        """Once: undo what the constructor hooked into the process; False if done before."""
        if self._closed:
            return False
        self._closed = True
        self._remove_exit_hooks()
        self.progress.close()
        self._ticker_stop.set()
        return True

    def _release_clients(self, timeout_s: float) -> None:
        self.gpu.stop()
        if self.actuator is not None:
            self.actuator.stop(timeout_s)
        if self.shipper is not None:
            self.shipper.close(timeout_s)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1, error=error)


# A script's old path keeps working for a while, with a warning naming the public one.
deprecate_names(
    __name__, "trainguard.torch", ("Supervisor", "SupervisorConfig", "NonFiniteLoss", "init_process_group")
)
