"""The supervisor's configuration: what the launcher passes each rank in its environment
(TRAINGUARD_*), the typed settings read from it, the step verdicts, the counters, and
`init_process_group` (a process group with the restart phases recorded)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import psutil
import torch

from ...schemas import auth
from ..chaos import wrong_device_from_env

log = logging.getLogger(__name__)


ENV_RUN_ID = "TRAINGUARD_RUN_ID"
ENV_ATTEMPT = "TRAINGUARD_ATTEMPT"
ENV_NODE = "TRAINGUARD_NODE"
ENV_NODE_LOCAL_RANK = "TRAINGUARD_NODE_LOCAL_RANK"
ENV_BOOTSTRAP = "TRAINGUARD_BOOTSTRAP"
ENV_TOPIC_PREFIX = "TRAINGUARD_TOPIC_PREFIX"
ENV_RUN_DIR = "TRAINGUARD_RUN_DIR"
#: Where the launcher reads this rank's restart phases (producers/launcher/restarts.py).
ENV_PHASES_FILE = "TRAINGUARD_PHASES_FILE"
#: Where this rank's newest completed step is kept for the launcher (lost work, exactly).
ENV_PROGRESS_FILE = "TRAINGUARD_PROGRESS_FILE"
#: Steps whose batch this attempt must not train on, comma-separated: a SkipUpdate the
#: launcher took for a step that failed on every node (producers/launcher/commands.py).
ENV_SKIP_BATCHES = "TRAINGUARD_SKIP_BATCHES"
#: How many validated checkpoints retention keeps (producers/checkpoint/catalog.py): a
#: positive whole number, read by every CheckpointManager built without `keep`.
ENV_CHECKPOINT_KEEP = "TRAINGUARD_CHECKPOINT_KEEP"
DEFAULT_CHECKPOINT_KEEP = 5
#: SupervisorConfig fields an operator may set from the environment (seconds, but for
#: the counts of _COUNTS).
ENV_CONFIG = {
    "TRAINGUARD_FLUSH_INTERVAL_S": "flush_interval_s",
    "TRAINGUARD_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
    "TRAINGUARD_GPU_HEALTH_INTERVAL_S": "gpu_health_interval_s",
    # The interval in force when the attempt starts: the launcher's, the last the run was sent.
    "TRAINGUARD_CHECKPOINT_INTERVAL_S": "checkpoint_interval_s",
    # The job's MTBF the interval is derived from until one is in force (default: the prior
    # for the world size, trainguard/common/checkpoint_interval.py).
    "TRAINGUARD_MTBF_PRIOR_S": "mtbf_prior_s",
    ENV_CHECKPOINT_KEEP: "checkpoint_keep",
}
#: The ENV_CONFIG fields that are counts (a positive whole number), not seconds.
_COUNTS = frozenset({"checkpoint_keep"})


class UpdateVerdict(StrEnum):
    """What :meth:`StepScope.check` decided about a step's update."""

    APPLY = "apply"
    NON_FINITE = "non_finite"  # loss or grad norm NaN/Inf: never applied
    GRAD_SPIKE = "grad_spike"  # grad norm > multiplier x running p99: skipped, counted
    COMMANDED = "commanded"  # a SkipUpdate command named this step
    PEER = "peer"  # another rank skipped this step (agreement all-reduce)


_CODES = {
    UpdateVerdict.APPLY: 0,
    UpdateVerdict.GRAD_SPIKE: 1,
    UpdateVerdict.COMMANDED: 2,
    UpdateVerdict.NON_FINITE: 3,
}


class NonFiniteLoss(FloatingPointError):
    """Raised by check() with ``on_non_finite="raise"``."""


@dataclass(frozen=True)
class SupervisorConfig:
    """The rank side's settings; every field is optional."""

    #: Seconds between heartbeats (sent from the shipper's thread, not the loop).
    heartbeat_interval_s: float = 5.0
    #: Seconds between the shipper's batches (a rank process ships its own records).
    flush_interval_s: float = 2.0
    #: Seconds between GPU health samples (NVML), on their own thread.
    gpu_health_interval_s: float = 30.0
    #: A grad norm above this multiple of the running p99 is a spike (seed §7a).
    grad_spike_multiplier: float = 10.0
    #: Accepted steps the p99 is taken over.
    grad_norm_window: int = 1000
    #: Accepted steps with a grad norm before spikes are judged.
    grad_norm_min_samples: int = 50
    #: Measure the grad norm in check() when the loop does not pass one (one reduction).
    measure_grad_norm: bool = True
    #: "skip": a non-finite step is not applied, reported, and training goes on until the
    #: processors' Abort; "raise": check() raises NonFiniteLoss (after reporting).
    on_non_finite: Literal["skip", "raise"] = "skip"
    #: Under torch.distributed, all-reduce the skip decision so that every rank agrees.
    agree_on_skip: bool = True
    #: Seconds between checkpoints until a SetCheckpointInterval command says otherwise
    #: (counted in steps from the measured step time: producers/checkpoint/cadence.py).
    checkpoint_interval_s: float | None = None
    #: A fixed cadence instead: checkpoint after every step s with (s + 1) % N == 0.
    checkpoint_every_steps: int | None = None
    #: Until an interval is in force (offline; online before the processor's first
    #: SetCheckpointInterval), the cadence derives T* from the measured checkpoint cost and
    #: this MTBF (None: the seed's prior for the world size; producers/checkpoint/cadence.py).
    mtbf_prior_s: float | None = None
    #: Validated checkpoints kept: after each validation rank 0 deletes the older ones
    #: (producers/checkpoint/catalog.py, the rule). The manager the loop builds reads the
    #: same variable itself (:func:`checkpoint_keep`); a config made in code reaches it
    #: only through the manager's own `keep`.
    checkpoint_keep: int = DEFAULT_CHECKPOINT_KEEP
    #: Exit after an abort/rollback command: wait this long for the ack, then flush for
    #: at most exit_flush_s, then os._exit.
    exit_grace_s: float = 1.0
    exit_flush_s: float = 3.0
    #: Register the compute-time comm hook on a DistributedDataParallel model.
    instrument_ddp: bool = True
    #: With that hook, all-reduce each parameter's gradient on its own, so that a resumed
    #: run is bitwise identical to an uninterrupted one at any world size (DDP's first
    #: iteration buckets gradients differently; see grad_checks.per_parameter_allreduce).
    #: False: DDP's per-bucket all-reduce (fewer collectives, last-bit drift on resume).
    deterministic_reduction: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SupervisorConfig:
        """The defaults, with the fields of ENV_CONFIG that `env` sets (positive seconds,
        positive counts)."""
        values: dict[str, float] = {}
        for name, attr in ENV_CONFIG.items():
            if (raw := env.get(name)) is None:
                continue
            values[attr] = _count(name, raw) if attr in _COUNTS else _seconds(name, raw)
        return cls(**values)  # type: ignore[arg-type]


def checkpoint_keep(env: Mapping[str, str]) -> int:
    """TRAINGUARD_CHECKPOINT_KEEP, else DEFAULT_CHECKPOINT_KEEP (ValueError when malformed)."""
    raw = env.get(ENV_CHECKPOINT_KEEP)
    return DEFAULT_CHECKPOINT_KEEP if raw is None else _count(ENV_CHECKPOINT_KEEP, raw)


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def _count(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive whole number")
    return value


#: Seconds this process spent in :func:`init_process_group` (the restart phase pg_init),
#: and when (wall clock) the last call began: what came before it is the script's imports.
_pg_init_s: float | None = None
_pg_init_ts: float | None = None


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group``, timed: the Supervisor reports the seconds
    as the ``pg_init`` restart phase (the rendezvous with every other rank)."""
    global _pg_init_s, _pg_init_ts
    _pg_init_ts = time.time()
    t0 = time.perf_counter()
    torch.distributed.init_process_group(*args, **kwargs)
    _pg_init_s = time.perf_counter() - t0


def pg_init_seconds() -> float | None:
    """Seconds the last `init_process_group` took (None: not called in this process)."""
    return _pg_init_s


def pg_init_started_ts() -> float | None:
    """When the last `init_process_group` began (wall clock; None: not called)."""
    return _pg_init_ts


def process_start_ts() -> float:
    """When this process started, on the wall clock. /proc's start time (clock ticks since
    boot) is placed on the boot-time clock; psutil's create_time adds /proc/stat's boot
    time, which is in whole seconds, and can be up to a second off."""
    try:
        with open("/proc/self/stat") as fh:
            after_name = fh.read().rpartition(")")[2].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return psutil.Process().create_time()


@dataclass
class SupervisorCounters:
    steps: int = 0
    applied: int = 0
    non_finite: int = 0
    grad_spikes: int = 0
    commanded_skips: int = 0
    peer_skips: int = 0
    self_checks: int = 0
    self_check_mismatches: int = 0
    ring_checks: int = 0
    #: Seconds spent in ring checks (both recomputations), for their cost per check.
    ring_check_s: float = 0.0
    #: Cross checks this rank recomputed (it was named in them).
    cross_checks: int = 0
    #: Seconds in cross checks: the recomputation, and the all-reduce every rank joins.
    cross_check_s: float = 0.0
    checkpoints: int = 0
    skipped_batches: int = 0


def supervisor_arguments(env: dict[str, str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Supervisor(...)'s arguments from the launcher's environment: TRAINGUARD_RUN_ID,
    TRAINGUARD_ATTEMPT, TRAINGUARD_NODE, TRAINGUARD_BOOTSTRAP, TRAINGUARD_TOPIC_PREFIX,
    TRAINGUARD_RUN_DIR, TRAINGUARD_SECRET or TRAINGUARD_SECRET_FILE, the phases, progress
    and skip-batches settings, and torch's RANK, LOCAL_RANK and WORLD_SIZE; without a
    `config`, the intervals of ENV_CONFIG override the defaults. `kwargs` (model,
    optimizer, checkpoint, sink...) pass through and win over the environment."""
    kwargs = dict(kwargs)
    if "config" not in kwargs:
        kwargs["config"] = SupervisorConfig.from_env(env)
    # Under plain torchrun (no trainguard launcher) the run is torchrun's: its rendezvous id.
    run_id = env.get(ENV_RUN_ID) or env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        raise KeyError(
            f"{ENV_RUN_ID} is not set (the trainguard launcher sets it; torchrun sets TORCHELASTIC_RUN_ID)"
        )
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
    # The device on its node the chaos knob names: on the launcher's modelled nodes, else
    # torch's LOCAL_RANK (the real host's, which is the node under plain torchrun).
    kwargs.setdefault("local_rank", int(env.get(ENV_NODE_LOCAL_RANK) or env.get("LOCAL_RANK", "0")))
    kwargs.setdefault("wrong_device", wrong_device_from_env(env))
    if env.get(ENV_PROGRESS_FILE):
        kwargs.setdefault("progress_file", env[ENV_PROGRESS_FILE])
    if env.get(ENV_SKIP_BATCHES):
        kwargs.setdefault("skip_batches", [int(s) for s in env[ENV_SKIP_BATCHES].split(",") if s])
    return dict(
        run_id=run_id,
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        attempt=int(env.get(ENV_ATTEMPT, "0")),
        node=env.get(ENV_NODE, ""),
        **kwargs,
    )
