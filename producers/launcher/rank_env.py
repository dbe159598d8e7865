"""The environment of one rank process: torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT, ...) so that a script written for
torchrun runs unchanged, and trainguard's (TRAINGUARD_*: the run, the attempt, the node,
the broker, the checkpoint to resume from, where to write the restart phases)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .config import LauncherConfig
from .plan import Placement
from .records import phases_path, progress_path


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
) -> dict[str, str]:
    """`placement` says where every rank runs (one host's modelled nodes, or the hosts of
    a rendezvous round); `master_addr` where rank 0 listens (default: the configured)."""
    rpn = placement.ranks_per_node
    world = str(placement.world_size)
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **cfg.env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % rpn),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(len(placement.ranks_of(placement.node_of(rank)))),
        "GROUP_RANK": str(rank // rpn),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": master_addr or cfg.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": cfg.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TRAINGUARD_RUN_ID": cfg.run_id,
        "TRAINGUARD_ATTEMPT": str(attempt),
        "TRAINGUARD_NODE": placement.node_of(rank),
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
    }
    if checkpoint_interval_s is not None:  # else the operator's (cfg.env or the launcher's own)
        env["TRAINGUARD_CHECKPOINT_INTERVAL_S"] = f"{checkpoint_interval_s:g}"
    return env
