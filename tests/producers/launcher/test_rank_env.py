"""torchrun's environment contract: a script moved from ``torchrun --nproc-per-node 4`` to
``trainguard launch --nproc 4`` sees every variable torchrun sets, with the same value on
every rank (LOCAL_RANK per real host above all: a script picks its GPU from it), whatever
nodes trainguard models on the host and whatever its restart mode. Only the values that
name a port, an address, a run id or a per-run file may differ; those must still exist.

Both launchers run the same tiny script, which writes the environment it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.producers.launcher.config import LauncherConfig
from trainguard.producers.launcher.plan import make_pool, plan
from trainguard.producers.launcher.rank_env import host_layout
from trainguard.producers.launcher.rendezvous import RendezvousSpec

pytest.importorskip("torch")

NPROC = 4
MAX_RESTARTS = 3  # trainguard's default, given to torchrun explicitly: the same flags
#: Values that name a port, an address, a run id or a file of the run: present, not equal.
VARYING = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}

DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""


def _environment() -> dict[str, str]:
    """The test's environment without anything either launcher sets (a torchrun variable
    inherited from the test's own environment would hide a missing one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TRAINGUARD_"))}
    for name in ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    # Set in this process by any earlier test that built a HostRendezvous (the launcher's
    # own setting, rendezvous.py); torchrun given it turns its agent store off.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, env=_environment(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _dumps(out: Path) -> dict[int, dict[str, str]]:
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(NPROC)}


@pytest.fixture(scope="module")
def torchrun_env(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    work = tmp_path_factory.mktemp("torchrun")
    (work / "dump.py").write_text(DUMP)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC)]
    _run([*torchrun, "--max-restarts", str(MAX_RESTARTS), "dump.py", str(work)], work)
    return _dumps(work)


@pytest.mark.parametrize("restart", ["full", "in-process"])
def test_trainguard_launch_gives_every_rank_torchruns_environment(
    restart: str, torchrun_env: dict[int, dict[str, str]], tmp_path: Path
) -> None:
    (tmp_path / "dump.py").write_text(DUMP)
    launch = [sys.executable, "-m", "trainguard", "launch", "--offline", "--nproc", str(NPROC)]
    launch += ["--run-id", "env-contract", "--checkpoint-dir", str(tmp_path / "ckpt"), "--restart", restart]
    _run([*launch, "--", sys.executable, "dump.py", str(tmp_path)], tmp_path)
    ours = _dumps(tmp_path)
    torchruns = {k for k in torchrun_env[0] if k not in _environment()}
    assert {"LOCAL_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS"} <= torchruns
    for rank in range(NPROC):
        theirs, mine = torchrun_env[rank], ours[rank]
        missing = sorted(torchruns - mine.keys())
        assert not missing, f"rank {rank} lacks torchrun's {missing}"
        differ = {k: (theirs[k], mine[k]) for k in torchruns - VARYING - {"_"} if theirs[k] != mine[k]}
        assert not differ, f"rank {rank}: torchrun's value vs trainguard's: {differ}"
    assert [ours[r]["LOCAL_RANK"] for r in range(NPROC)] == ["0", "1", "2", "3"]


def test_across_hosts_the_local_variables_describe_each_host() -> None:
    """One agent per host (--nnodes 2 --nproc-per-node 2): each host's ranks count 0..1,
    the host's place in the world is its group rank, as torchrun's agents give them."""
    spec = RendezvousSpec("127.0.0.1:29400", "run", 2, 2, "c10d", {}, None)
    cfg = LauncherConfig(("true",), 4, 2, "run", Path("ckpt"), rendezvous=spec)
    placement = plan(make_pool(4, 2, spares=1), set(), 4)
    layouts = [host_layout(cfg, placement, rank) for rank in range(4)]
    assert layouts == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
