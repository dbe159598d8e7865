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

Compute time before the collective (seed §7 failure 2). After the all-reduce every rank
has waited for the slowest, so only the time before it tells ranks apart. Under DDP the
all-reduce overlaps backward and ``loss.backward()`` returns only after it, so timing
``backward()`` measures the collective too. The supervisor therefore registers a DDP
communication hook (:meth:`Supervisor.instrument_ddp`, automatic when `model` is a
``DistributedDataParallel``) that stamps the moment the LAST gradient bucket is handed to
the all-reduce: every gradient of this rank is computed then, and nothing waited for
another rank yet (earlier buckets' all-reduces are asynchronous). compute_s is step
start to that stamp (or to :meth:`StepScope.compute_done`, whichever comes first); total_s
is the whole scope. It keeps DDP's overlap of communication with backward (unlike
``no_sync()`` plus an explicit all-reduce). A user with a comm hook of their own passes it
as `inner`. On CUDA the stamps are CUDA events (host time only says when kernels were
queued); they are resolved a step or two later without waiting, so the StepTiming of a
step may be sent after the next one starts. FSDP: not instrumented yet; call
``compute_done()`` before the step's first collective.

Invariants (seed §7 failure 3 (a)), in :meth:`StepScope.check`: a non-finite loss or grad
norm is never applied (StepStats finite=False goes out; the processors decide the abort,
or set ``on_non_finite="raise"``); a grad norm above 10 x the running p99 of accepted
steps (after 50 of them; the core's definition, processors/core/sdc_state.py) is skipped
and counted; a step named by a SkipUpdate command is skipped. Under torch.distributed
the ranks agree on skipping with one all-reduce of a scalar (MAX), so that a skip seen by
one rank (its own NaN loss, a command that reached it first) skips everywhere and the
replicas never diverge.

Self-check (R3): when a RunSelfCheck command names this rank, at the first step at or
after its step the scope's batch is replayed twice by ``replay_fn`` after the update,
and the two gradient digests are reported (:mod:`.grad_checks`). The replay must not run
a collective: under DDP call the unwrapped ``model.module``.

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

Ring cross-rank check (R3, :mod:`.ring_check`): when a RunRingCheck arrives, every rank
recomputes its own microbatch and its ring neighbour's with the weights of the same step,
after that step's update, and reports both values (RingCheck). It needs ``replay_fn`` and
``batch_fn(rank, step)``, the batch ANY rank trains on at a step (the sampler knows every
rank's indices)::

    sup.batch_fn = lambda rank, step: batch_of(rank, step)

The ranks agree on the step inside the all-reduce of ``check()`` (no extra collective).

Three-rank cross check (R3, :mod:`.cross_check`): a RunCrossRankCheck (the bisection of a
ring edge that failed alone) names three ranks, which recompute ``batch_fn(batch_rank,
step)`` after the update of the step at which all three hold it, agreed in the same
all-reduce; every rank then joins one all-reduce of three floats that gathers the values,
and the first named rank reports them (CrossRankCheck). It needs the same two hooks, and
the agreement: without it (a single process, no ``check()``, ``agree_on_skip=False``) the
check is logged and dropped.

Chaos knob: with TRAINGUARD_INJECT_WRONG_DEVICE naming this rank's node and local rank
(:mod:`.device_fault`), the supervisor makes this process's matrix products wrong from
the named step on, installed at that step's start.

Skipped batches: a step that failed on every node (data or code) and that the policy
allows to skip comes back from the launcher as TRAINGUARD_SKIP_BATCHES; :meth:`steps`
reads and drops its batch, so the restarted run goes past it.

Phases (Heartbeat.phase): the supervisor tells its agent what the loop is doing, one
attribute store at each boundary: forward from the step's start, allreduce once this
rank's compute is done (the comm hook or compute_done()) and while the ranks agree in
check(), optimizer after check(), checkpoint while saving, data between steps (the
loader). When no stack dump arrives after a hang, the rank whose last phase differs from
everyone waiting in the all-reduce is the culprit (processors/core/stacks.py).

Nothing here blocks on the broker, the network or storage: events are queued; commands
are read and acked on the actuator's thread; GPU health is sampled on its own thread;
heartbeats come from the shipper's thread, so they continue while a step is stuck.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from ...common.quantiles import RunningQuantile
from ...kafka.topics import topic_names
from ...schemas import RunCrossRankCheck, auth
from ..checkpoint.cadence import CheckpointCadence
from ..rank.actuator import Actuator
from ..rank.agent import EventSink, MemorySink, NodeAgents, RankAgent
from ..rank.handlers import CheckpointManager, RankControl, RankHandlers
from ..rank.shipper import ShipperConfig, TelemetryShipper
from . import cross_check, grad_checks, ring_check
from .config import (
    _CODES,
    ENV_ATTEMPT,
    ENV_BOOTSTRAP,
    ENV_NODE,
    ENV_PHASES_FILE,
    ENV_PROGRESS_FILE,
    ENV_RUN_DIR,
    ENV_RUN_ID,
    ENV_SKIP_BATCHES,
    ENV_TOPIC_PREFIX,
    NonFiniteLoss,
    SupervisorConfig,
    SupervisorCounters,
    Verdict,
    init_process_group,
    pg_init_seconds,
    process_start_ts,
)
from .device_fault import WrongDevice, install_wrong_device, wrong_device_from_env
from .gpu_health import GpuHealthSampler, HealthReader, open_reader
from .timing import _CudaMarks, _HostMarks, _Pending

log = logging.getLogger(__name__)

# What a training script imports from here (docs/examples/train_tiny.py); the settings
# and the verdicts live in config.py.
__all__ = [
    "NonFiniteLoss",
    "StepScope",
    "Supervisor",
    "SupervisorConfig",
    "Verdict",
    "init_process_group",
    "process_start_ts",
]

# --------------------------------------------------------------------------- step scope


class StepScope:
    """One step; use through ``with sup.step(step, batch) as s``."""

    def __init__(self, sup: Supervisor, step: int, batch: Any, microbatch_id: str) -> None:
        self.sup = sup
        self.step = step
        self.batch = batch
        self.microbatch_id = microbatch_id
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.verdict: Verdict | None = None
        #: Save a checkpoint at the end of this step: decided in check(), agreed over ranks.
        self.checkpoint_due: bool | None = None
        #: The ranks agreed in check() (None: no agreement ran): run the pending ring check
        #: due from this step (-1: none) at the end of this step.
        self.ring_check_due: int | None = None
        #: The key of the cross check agreed to run at this step's end (0: none; None: no
        #: agreement ran, so a pending one is dropped).
        self.cross_check_due: int | None = None
        self._start: Any = None
        self._compute: Any = None

    def __enter__(self) -> StepScope:
        self.sup._begin(self)
        self._start = self.sup._marks.mark()
        self.sup.agent.phase = "forward"
        return self

    def compute_done(self) -> None:
        """Mark the end of this rank's compute, before any gradient collective. Under an
        instrumented DDP model the comm hook has marked it already; this is then a no-op."""
        if self._compute is None:
            self._compute = self.sup._marks.mark()
            self.sup.agent.phase = "allreduce"

    def check(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None) -> bool:
        """The invariants; True: apply the update. Reads the loss (and grad norm) as host
        floats, which waits for the device to compute them."""
        self.sup.agent.phase = "allreduce"  # the ranks agree on the verdict with one all-reduce
        applied = self.sup._check(self, loss, grad_norm)
        self.sup.agent.phase = "optimizer"
        return applied

    @property
    def applied(self) -> bool:
        return self.verdict is Verdict.APPLY

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sup._end(self, failed=exc_type is not None and not isinstance(exc, NonFiniteLoss))


# --------------------------------------------------------------------------- supervisor


class Supervisor:
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
        self.config = config or SupervisorConfig()
        if checkpoint_every_steps is not None:
            self.config = dataclasses.replace(self.config, checkpoint_every_steps=checkpoint_every_steps)
        #: Steps whose batch steps() passes over (the launcher's TRAINGUARD_SKIP_BATCHES).
        self.skip_batches = frozenset(skip_batches)
        self.run_id, self.rank, self.world_size, self.attempt = run_id, rank, world_size, attempt
        self.node = node or socket.gethostname()
        self.model = model
        self.optimizer = optimizer
        self.params = self._param_list(model, optimizer, params)
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
        self._progress_fd: int | None = None
        if self.progress_file is not None:
            try:
                self.progress_file.parent.mkdir(parents=True, exist_ok=True)
                self._progress_fd = os.open(self.progress_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:
                log.warning("trainguard: no progress file %s: %s", self.progress_file, exc)
        self.counters = SupervisorCounters()
        self.control = RankControl(checkpoint_interval_s=self.config.checkpoint_interval_s)
        self.self_check_results: list[grad_checks.SelfCheckResult] = []
        self._clock = clock
        self.cadence = CheckpointCadence(
            self.config.checkpoint_interval_s, every_steps=self.config.checkpoint_every_steps
        )
        #: (step, checkpoint due) as the ranks agreed in check(); cleared by checkpoint_saved.
        self._agreed: tuple[int, bool] | None = None
        self._grad_norms = RunningQuantile()
        self._pending: deque[_Pending] = deque()
        self._scope: StepScope | None = None
        self._batches: dict[int, Any] = {}
        self._closed = False
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        cuda = any(p.is_cuda for p in self.params)
        self._marks: _HostMarks | _CudaMarks = _CudaMarks() if cuda else _HostMarks(clock)

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

        self.handlers = RankHandlers(
            self.agent,
            self.control,
            self.run_dir,
            close_telemetry=self._close_telemetry,
            terminate=terminate,
            grace_s=self.config.exit_grace_s,
            flush_s=self.config.exit_flush_s,
            can_self_check=lambda: self.replay_fn is not None,
            can_ring_check=self._ring_check_missing,
            can_cross_check=self._cross_check_refusal,
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
            )
            self.handlers.register(self.actuator)
            self.actuator.start()

        reader = open_reader() if gpu_reader == "auto" else gpu_reader
        self.gpu = GpuHealthSampler(self.agent.gpu_health, reader, self.config.gpu_health_interval_s).start()

        if self.config.instrument_ddp and model is not None and _is_ddp(model):
            self.instrument_ddp(model)

        self._sigterm_installed = False
        self._exit_flush_started = False
        # A survivor of a peer's crash ends by an exception (gloo's "connection reset") or by
        # the launcher's SIGTERM: either way its last StepTimings leave the shipper first.
        atexit.register(self._flush_at_exit)
        if (
            self.shipper is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, self._exit_on_sigterm)
            self._sigterm_installed = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kwargs: Any) -> Supervisor:
        """Build from the launcher's environment: TRAINGUARD_RUN_ID, TRAINGUARD_ATTEMPT,
        TRAINGUARD_NODE, TRAINGUARD_BOOTSTRAP, TRAINGUARD_TOPIC_PREFIX, TRAINGUARD_RUN_DIR,
        TRAINGUARD_SECRET or TRAINGUARD_SECRET_FILE, and torch's RANK and WORLD_SIZE; without a
        `config`, the intervals of ENV_CONFIG (e.g. TRAINGUARD_FLUSH_INTERVAL_S) override the
        defaults. Keyword arguments (model, optimizer, checkpoint, sink...) pass through."""
        env = dict(os.environ) if env is None else env
        if "config" not in kwargs:
            kwargs["config"] = SupervisorConfig.from_env(env)
        run_id = env.get(ENV_RUN_ID)
        if not run_id:
            raise KeyError(f"{ENV_RUN_ID} is not set (the trainguard launcher sets it)")
        bootstrap = env.get(ENV_BOOTSTRAP) or None
        if bootstrap and "secret" not in kwargs and "sink" not in kwargs:
            kwargs["secret"] = auth.load_master_secret(env)
        if bootstrap and "sink" not in kwargs:
            kwargs["bootstrap"] = bootstrap
        kwargs.setdefault("topic_prefix", env.get(ENV_TOPIC_PREFIX, ""))
        if env.get(ENV_RUN_DIR):
            kwargs.setdefault("run_dir", env[ENV_RUN_DIR])
        if env.get(ENV_PHASES_FILE):
            kwargs.setdefault("phases_file", env[ENV_PHASES_FILE])
        kwargs.setdefault("local_rank", int(env.get("LOCAL_RANK", "0")))
        kwargs.setdefault("wrong_device", wrong_device_from_env(env))
        if env.get(ENV_PROGRESS_FILE):
            kwargs.setdefault("progress_file", env[ENV_PROGRESS_FILE])
        if env.get(ENV_SKIP_BATCHES):
            kwargs.setdefault("skip_batches", [int(s) for s in env[ENV_SKIP_BATCHES].split(",") if s])
        return cls(
            run_id,
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            attempt=int(env.get(ENV_ATTEMPT, "0")),
            node=env.get(ENV_NODE, ""),
            **kwargs,
        )

    @staticmethod
    def _param_list(
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        params: Iterable[torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        if params is not None:
            return list(params)
        if model is not None:
            return list(model.parameters())
        if optimizer is not None:
            return [p for group in optimizer.param_groups for p in group["params"]]
        return []

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
        run = inner or default

        def hook(hook_state: Any, bucket: Any) -> Any:
            if bucket.is_last() and self._scope is not None:
                self._scope.compute_done()
            return run(hook_state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings).
        hook.__annotations__ = {
            "hook_state": object,
            "bucket": torch.distributed.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        ddp.register_comm_hook(state, hook)  # type: ignore[operator]

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
        self.cadence.saved(step, time.monotonic() if now is None else now)
        self._agreed = (step, False)
        self.counters.checkpoints += 1

    def _wants_checkpoint(self, step: int | None, now: float | None = None) -> bool:
        """This rank's own answer (consumes a CheckpointNow)."""
        if self.control.take_checkpoint_request():
            return True
        with self.control.lock:
            interval = self.control.checkpoint_interval_s
        if interval != self.cadence.interval_s:
            self.cadence.set_interval(interval)
            log.info("rank %d: checkpoint %s", self.rank, self.cadence.describe())
        if step is None:
            step = self.control.current_step
        return self.cadence.due(step, time.monotonic() if now is None else now)

    # ------------------------------------------------------------------ internals
    def _begin(self, scope: StepScope) -> None:
        self._scope = scope
        self.cadence.begin(scope.step, time.monotonic())
        if self.wrong_device is not None and scope.step >= self.wrong_device.from_step:
            log.warning("rank %d: injected wrong device from step %d", self.rank, scope.step)
            install_wrong_device(self.wrong_device.bias)  # the chaos knob (device_fault.py)
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
        wants_checkpoint = self._wants_checkpoint(scope.step)
        verdict, due, scope.ring_check_due, scope.cross_check_due = self._agree(verdict, wants_checkpoint)
        scope.checkpoint_due, self._agreed = due, (scope.step, due)
        scope.verdict = verdict
        if verdict is Verdict.APPLY:
            if norm is not None:
                self._grad_norms.add(norm, self.config.grad_norm_window)
            self.counters.applied += 1
        else:
            attr = {
                Verdict.NON_FINITE: "non_finite",
                Verdict.GRAD_SPIKE: "grad_spikes",
                Verdict.COMMANDED: "commanded_skips",
                Verdict.PEER: "peer_skips",
            }[verdict]
            setattr(self.counters, attr, getattr(self.counters, attr) + 1)
            log.warning("rank %d step %d: update not applied (%s)", self.rank, scope.step, verdict)
        self.control.record_decision(scope.step, verdict is Verdict.APPLY)
        if verdict is Verdict.NON_FINITE and self.config.on_non_finite == "raise":
            raise NonFiniteLoss(f"step {scope.step}: loss {loss_f}, grad norm {norm}")
        return verdict is Verdict.APPLY

    def _local_verdict(self, step: int, loss: float, norm: float | None) -> Verdict:
        if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
            return Verdict.NON_FINITE
        if self.control.take_skip(step):
            return Verdict.COMMANDED
        judged = norm is not None and len(self._grad_norms) >= self.config.grad_norm_min_samples
        if judged and norm > self.config.grad_spike_multiplier * self._grad_norms.quantile(0.99):  # type: ignore[operator]
            return Verdict.GRAD_SPIKE
        return Verdict.APPLY

    def _agree(
        self, verdict: Verdict, wants_checkpoint: bool
    ) -> tuple[Verdict, bool, int | None, int | None]:
        """Every rank skips if one does, checkpoints if one wants to, runs a ring check
        once every rank holds it, and joins a cross check once every rank it names holds
        it: one MAX all-reduce over the default group of (verdict code, checkpoint wanted,
        the oldest pending ring check's codes, the cross check's slots). A CheckpointNow,
        the interval or a RunRingCheck reaches each rank at its own step; a checkpoint is
        collective and a ring check compares weights, so all ranks must act at the same
        step. The third value: the ring check to run at this step's end (-1: none; None:
        no agreement ran, each rank runs its own at its first step >= the command's); the
        fourth: the key of the cross check to run (0: none; None: no agreement ran)."""
        dist = torch.distributed
        if not (self.config.agree_on_skip and dist.is_available() and dist.is_initialized()):
            return verdict, wants_checkpoint, None, None
        if dist.get_world_size() < 2:
            return verdict, wants_checkpoint, None, None
        pending = self.control.oldest_ring_check()
        head, expired = self.control.cross_check_head(self.control.current_step)
        for check in expired:
            log.warning("rank %d: cross check %s dropped: a rank it names never held it", self.rank, check)
        mine = [
            _CODES[verdict],
            int(wants_checkpoint),
            *ring_check.agreement_codes(pending),
            *cross_check.agreement_codes(head, self.rank),
        ]
        codes = torch.tensor(mine, dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        worst, checkpoint, *rest = (int(v) for v in codes.tolist())
        ring = ring_check.agreed(rest[:3])
        if ring.stale is not None and ring.stale == pending:
            dropped = self.control.take_ring_check(ring.stale)
            log.warning("rank %d: ring check %s dropped: not every rank holds it", self.rank, dropped)
        due = -1 if ring.run is None else ring.run
        cross = cross_check.agreed(rest[3:]) or 0
        if verdict is not Verdict.APPLY or worst == 0:
            return verdict, bool(checkpoint), due, cross
        return Verdict.PEER, bool(checkpoint), due, cross

    def _collective_device(self) -> torch.device:
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
            self._write_phases(scope.step)
        if failed:  # it raised (a peer died mid-collective...): not a completed step, no StepTiming
            self._drain(block=False)
            return
        self._pending.append(_Pending(scope.step, scope._start, compute, end, scope.loss, scope.grad_norm))
        self._drain(block=False)
        self._write_progress(scope.step)
        if scope.verdict is None:  # the loop did not call check(): assume it applied
            self.control.record_decision(scope.step, True)
        if self.control.take_self_check(scope.step):
            self._self_check(scope)
        self._ring_check(scope)
        self._cross_check(scope)
        due = scope.checkpoint_due  # None: check() was not called, so nothing was agreed
        if due is None:
            due = self.checkpoint is not None and self._wants_checkpoint(scope.step)
        if due and self.checkpoint is not None:
            self.agent.phase = "checkpoint"
            self.checkpoint.save(scope.step)
            self.checkpoint_saved(scope.step)

    def _write_phases(self, step: int) -> None:
        """After the first step of this process: when it started, how long the checkpoint
        load took, when the first step completed, for the launcher's restart phases. Best
        effort (never raises into the loop)."""
        if self.phases_file is None:
            return
        load_s = getattr(self.checkpoint, "last_load_s", None)
        phases = {
            "start_ts": process_start_ts(),
            "checkpoint_load_s": load_s,
            "pg_init_s": pg_init_seconds(),
            "first_step_ts": time.time(),
            "last_step": step,
        }
        try:
            self.phases_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.phases_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: v for k, v in phases.items() if v is not None}))
            os.replace(tmp, self.phases_file)
        except OSError as exc:
            log.warning("trainguard: restart phases not written to %s: %s", self.phases_file, exc)

    def _write_progress(self, step: int) -> None:
        """This rank's newest completed step, for the launcher: one fixed-width record
        rewritten in place with pwrite (~6 µs; a write-then-rename took 1-2 ms a step on a
        loaded 2-core machine). No fsync: a host crash loses the ranks with it. The reader
        (launcher.read_progress) reads until two reads agree. Best effort."""
        if self._progress_fd is None:
            return
        try:
            os.pwrite(self._progress_fd, b"%20d\n" % step, 0)
        except OSError as exc:
            log.warning("trainguard: progress not written to %s: %s", self.progress_file, exc)
            os.close(self._progress_fd)
            self._progress_fd = None

    def _exit_on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM (the launcher's teardown): ship what is queued, bounded by exit_flush_s,
        then end at once as the default action would (no thread joins: a checkpoint thread
        stuck in a collective with dead peers would keep the rank, and its heartbeats,
        alive). The flush runs on its own thread: the interrupted main thread may hold the
        shipper's lock. A rank blocked in a collective runs this once the call returns; the
        launcher's SIGKILL after its term timeout bounds that."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self._exit_flush_started:  # atexit is flushing already (an exception exit): let it
            return
        self.agent.exited = True  # no more heartbeats: the rank is going, not hung
        flush = threading.Thread(target=self._flush_at_exit, name="trainguard-exit-flush", daemon=True)
        flush.start()
        flush.join(self.config.exit_flush_s + 1.0)
        os._exit(128 + signum)

    def _flush_at_exit(self) -> None:
        """atexit: the process ends without close() (an exception, SIGTERM): ship what is
        queued within exit_flush_s. No RankExit: the launcher reports how it ended."""
        if self._closed or self._exit_flush_started:
            return
        self._exit_flush_started = True
        try:
            self._close_telemetry(self.config.exit_flush_s)
        except Exception:
            log.exception("trainguard: flushing telemetry at exit failed")

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

    def _self_check(self, scope: StepScope) -> None:
        if self.replay_fn is None or scope.batch is None:
            log.warning("rank %d: self-check due at step %d but no replay_fn or batch", self.rank, scope.step)
            return
        module = self.model
        if module is not None and _is_ddp(module):
            inner = module.module
            module = inner if isinstance(inner, torch.nn.Module) else None
        result = grad_checks.self_check(
            self.replay_fn, scope.batch, self.params, scope.step, scope.microbatch_id, module=module
        )
        self.self_check_results.append(result)
        self.counters.self_checks += 1
        if not result.passed:
            self.counters.self_check_mismatches += 1
            log.error("rank %d step %d: self-check MISMATCH %s", self.rank, scope.step, result)
        self.agent.self_check(scope.step, result.microbatch_id, result.digest_first, result.digest_second)

    def _hooks_missing(self) -> str | None:
        if self.replay_fn is None:
            return "no replay function registered (Supervisor.replay_fn)"
        if self.batch_fn is None:
            return "no batch function registered (Supervisor.batch_fn(rank, step))"
        return None

    def _ring_check_missing(self) -> str | None:
        if (missing := self._hooks_missing()) is not None:
            return missing
        if self.world_size < 2:
            return "a ring check needs 2+ ranks"
        return None

    def _cross_check_refusal(self, command: RunCrossRankCheck) -> str | None:
        return self._hooks_missing() or cross_check.refusal(command, self.world_size)

    def _replay_module(self) -> torch.nn.Module | None:
        """The model the replays run on: DDP's inner module (a replay runs no collective)."""
        module = self.model
        if module is not None and _is_ddp(module):
            inner = module.module
            module = inner if isinstance(inner, torch.nn.Module) else None
        return module

    def _ring_check(self, scope: StepScope) -> None:
        """Run the ring check due at the end of this step, if any (see :mod:`.ring_check`)."""
        if scope.ring_check_due is None:  # no agreement: the first step >= the command's
            oldest = self.control.oldest_ring_check()
            first = oldest if oldest is not None and oldest <= scope.step else None
        else:
            first = scope.ring_check_due if scope.ring_check_due >= 0 else None
        taken = None if first is None else self.control.take_ring_check(first)
        if taken is None or self.replay_fn is None or self.batch_fn is None:
            return
        check_id, offset = taken
        module = self._replay_module()
        try:
            result = ring_check.ring_check(
                self.replay_fn,
                self.batch_fn,
                self.params,
                rank=self.rank,
                world_size=self.world_size,
                step=scope.step,
                check_id=check_id,
                offset=offset,
                module=module,
            )
        except Exception:  # the user's hooks: never end training over a check
            log.exception("rank %d step %d: ring check %s not run", self.rank, scope.step, check_id)
            return
        self.ring_results.append(result)
        self.counters.ring_checks += 1
        self.counters.ring_check_s += result.seconds
        self.agent.ring_check(scope.step, check_id, result.own_value, result.peer_rank, result.peer_value)

    def _cross_check(self, scope: StepScope) -> None:
        """Join the cross check agreed at this step, if any (see :mod:`.cross_check`)."""
        if scope.cross_check_due is None:  # no agreement: nowhere to gather the values
            for dropped in self.control.drop_cross_checks():
                log.warning("rank %d: cross check %s dropped: no agreement to run it", self.rank, dropped)
            return
        if scope.cross_check_due == 0:
            return
        check = self.control.take_cross_check(scope.cross_check_due)
        result = cross_check.gather(check, self.rank, scope.step, self._recompute_of, self._sum_over_ranks)
        self.counters.cross_check_s += result.seconds
        if check is None:  # it names other ranks: this one only joined the all-reduce
            return
        self.cross_results.append(result)
        self.counters.cross_checks += 1
        if result.values is not None and check.ranks[0] == self.rank:
            self.agent.cross_rank_check(scope.step, check.microbatch_id, list(check.ranks), result.values)

    def _recompute_of(self, rank: int, step: int) -> float:
        """The value of `rank`'s microbatch at `step`, recomputed with the current weights."""
        if self.replay_fn is None or self.batch_fn is None:
            raise RuntimeError(self._hooks_missing())
        value = ring_check.recompute(
            self.replay_fn, self.batch_fn(rank, step), self.params, self._replay_module()
        )
        return ring_check.reportable(value)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        dist = torch.distributed
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) for v in tensor.tolist()]

    def _tick(self) -> None:
        while not self._ticker_stop.wait(min(1.0, self.config.heartbeat_interval_s)):
            self.beats.on_flush()

    def _close_telemetry(self, timeout_s: float) -> None:
        """Ship what is queued, bounded by timeout_s (used before an exit)."""
        self._drain(block=True)
        if self.shipper is not None:
            self.shipper.close(timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def close(self, exit_code: int | None = 0, timeout_s: float = 10.0) -> None:
        """End of training: report the rank's exit, stop the threads, ship what is left."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._flush_at_exit)
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._drain(block=True)
        if not self.agent.exited:
            self.agent.exit(exit_code=exit_code)
        self.gpu.stop()
        self._ticker_stop.set()
        if self.actuator is not None:
            self.actuator.stop(timeout_s)
        if self.shipper is not None:
            self.shipper.close(timeout_s)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)
