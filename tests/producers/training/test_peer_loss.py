"""A rank that dies of a lost peer says so (producers/training/peer_loss.py): the error a
real gloo survivor raises is classified, a rank's own faults are not, and the verdict
reaches the phases file that the launcher turns into RankExit.peer_lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.records import peer_lost_of
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.training.peer_loss import peer_lost
from trainguard.producers.training.supervisor import Supervisor
from trainguard.schemas import RankExit

#: Two gloo ranks all-reduce in a loop; rank 1 vanishes (os._exit, as a lost host's rank
#: would) after 3 rounds; rank 0 runs under a Supervisor and lets the error escape.
RANKS = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from pathlib import Path
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        os._exit(0)
    from trainguard.producers.rank.agent import MemorySink
    from trainguard.producers.training.supervisor import Supervisor
    sup = Supervisor("run-p", sink=MemorySink(), run_dir=Path(sys.argv[2]), gpu_reader=None,
                     phases_file=Path(sys.argv[2]) / "attempt-0" / "rank-0.phases.json")
    for step in range(1000):
        with sup.step(step):
            dist.all_reduce(torch.ones(4))
    """
)


def test_a_gloo_survivor_notes_the_lost_peer_in_its_phases_file(tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS, str(r), str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[1].returncode == 0 and procs[0].returncode == 1, errors[0][-2000:]
    noted = peer_lost_of(tmp_path, 0, 0)
    assert noted, errors[0][-2000:]
    assert noted.lower() in errors[0].lower()  # the survivor's own error, first line
    assert "Traceback" in errors[0]  # the hook chains to the default one: the traceback is kept


def test_a_ranks_own_faults_are_not_a_lost_peer() -> None:
    assert peer_lost(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert peer_lost(ValueError("shapes (4,8) and (3,) not aligned")) is None
    assert peer_lost(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert peer_lost(None) is None


def test_a_lost_peer_wrapped_by_the_training_loop_is_still_found() -> None:
    try:
        try:
            raise RuntimeError(
                "[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer"
            )
        except RuntimeError as inner:
            raise KeyError("step 41 failed") from inner
    except KeyError as outer:
        found = peer_lost(outer)
    assert found is not None and "Connection reset by peer" in found
    nccl = RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"
    )
    assert peer_lost(nccl) is not None


def test_a_supervisor_closed_by_a_lost_peer_reports_its_exit_as_one(tmp_path: Path) -> None:
    sink = MemorySink()
    phases = tmp_path / "attempt-0" / "rank-3.phases.json"
    sup = Supervisor("run-p", sink=sink, run_dir=tmp_path, gpu_reader=None, phases_file=phases)
    with pytest.raises(RuntimeError), sup:
        raise RuntimeError("Connection closed by peer [10.0.0.7]:29500")
    (exit_,) = sink.of(RankExit)
    assert exit_.peer_lost and exit_.exit_code == 1
    noted = json.loads(phases.read_text())
    assert noted["peer_lost"].startswith("Connection closed by peer") and noted["closed"] == 1
    other = MemorySink()
    with pytest.raises(ValueError), Supervisor("run-q", sink=other, run_dir=tmp_path, gpu_reader=None):
        raise ValueError("a bug in the loss")
    (own,) = other.of(RankExit)
    assert not own.peer_lost
