"""The environment of one rank process: torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT, ...) so that a script written for
torchrun runs unchanged, and trainguard's (TRAINGUARD_*: the run, the attempt, the node,
the broker, the checkpoint to resume from, where to write the restart phases).

torchrun's contract is kept exactly (torch's ``LocalElasticAgent._start_workers``, and
what ``torchrun`` itself puts in its own environment): the local and group variables
describe the *real host*, whatever nodes trainguard models on it. One host runs every
rank (LOCAL_RANK = RANK, one group), as ``torchrun --nproc-per-node N`` does, so a script
that picks its GPU from LOCAL_RANK puts each rank on its own device; across hosts each
agent is one host of ``--nproc-per-node`` ranks, the host's place in the world its group
rank (tests/producers/launcher/test_rank_env.py compares the two launchers rank by rank).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..training.elastic import ENV_SHARDS
from .agent_bound import ENV_AGENT_PID
from .config import LauncherConfig
from .import_env import omp_threads
from .plan import Placement
from .records import phases_path, progress_path

#: torchrun's defaults: its worker role's name and the signals its agent forwards
#: (``--signals-to-handle``), which it leaves in every worker's environment.
ROLE_NAME = "default"
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def host_layout(cfg: LauncherConfig, placement: Placement, rank: int) -> tuple[int, int, int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE) of `rank` on real hosts:
    one host holds the whole world (its modelled nodes are trainguard's, not the OS's);
    across hosts every node of the placement is a host of ``ranks_per_node`` ranks."""
    if cfg.rendezvous is None:
        return rank, placement.world_size, 0, 1
    rpn = placement.ranks_per_node
    node = placement.node_of(rank)
    return rank % rpn, len(placement.ranks_of(node)), rank // rpn, len(placement.nodes)


def _full_world(cfg: LauncherConfig) -> int:
    """Across hosts: MAX hosts x ranks per host (--nnodes MIN:MAX)."""
    assert cfg.rendezvous is not None
    return cfg.rendezvous.max_nodes * cfg.ranks_per_node


def rank_env(
    cfg: LauncherConfig,
    run_dir: Path,
    attempt: int,
    rank: int,
    placement: Placement,
    resume: int,
    port: int,
    skip_batches: Sequence[int],
    checkpoint_interval_s: float | None,
    master_addr: str | None = None,
    agent_store: bool = False,
) -> dict[str, str]:
    """`placement` says where every rank runs (one host's modelled nodes, or the hosts of
    a rendezvous round); `master_addr` where the attempt's store listens (default: the
    configured); `agent_store`: the launcher serves it at `port`, not rank 0."""
    world = str(placement.world_size)
    local_rank, local_world, group_rank, groups = host_layout(cfg, placement, rank)
    env = {
        **omp_threads(local_world),
        **cfg.env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(groups),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": master_addr or cfg.master_addr,
        "MASTER_PORT": str(port),
        # Full restarts on one host: the launcher serves the attempt's store, as torchrun's
        # agent does (attempt.py); across hosts rank 0 serves it, or in process the first
        # host's agent (attempt.py); hot.py sets its own on one host.
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCHELASTIC_RUN_ID": cfg.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TRAINGUARD_RUN_ID": cfg.run_id,
        "TRAINGUARD_ATTEMPT": str(attempt),
        "TRAINGUARD_NODE": placement.node_of(rank),
        # The rank's device on its modelled node (LOCAL_RANK is the real host's).
        "TRAINGUARD_NODE_LOCAL_RANK": str(rank % placement.ranks_per_node),
        # Always set (empty: none), so that the launcher's own environment cannot leak in.
        "TRAINGUARD_BOOTSTRAP": cfg.bootstrap,
        "TRAINGUARD_TOPIC_PREFIX": cfg.topic_prefix,
        "TRAINGUARD_SECRET_FILE": cfg.secret_file,
        "TRAINGUARD_CHECKPOINT_DIR": str(cfg.checkpoint_dir),
        "TRAINGUARD_RESUME_STEP": str(resume),
        "TRAINGUARD_PHASES_FILE": str(phases_path(run_dir, attempt, rank)),
        "TRAINGUARD_PROGRESS_FILE": str(progress_path(run_dir, attempt, rank)),
        "TRAINGUARD_RUN_DIR": str(run_dir),  # the Supervisor's stack dumps and journals
        "TRAINGUARD_SKIP_BATCHES": ",".join(map(str, skip_batches)),
        # The job's data shards: its full world, whatever this attempt's size (elastic.py).
        ENV_SHARDS: str(cfg.nproc if cfg.rendezvous is None else _full_world(cfg)),
        # This host's launcher: a rank whose agent is gone ends (agent_bound.py, agent_watch.py).
        ENV_AGENT_PID: str(os.getpid()),
    }
    if checkpoint_interval_s is not None:  # else the operator's (cfg.env or the launcher's own)
        env["TRAINGUARD_CHECKPOINT_INTERVAL_S"] = f"{checkpoint_interval_s:g}"
    return env
