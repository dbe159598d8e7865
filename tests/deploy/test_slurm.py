"""docs/deploy/slurm.sbatch, as a user submits it, run by a real Slurm (issue 45, item 4): a
private cluster of three Slurm nodes on this machine (tests/deploy/slurm_cluster.py: its own
munged, slurmctld and one slurmd per node), the README's example trained offline by one
`trainguard launch` agent per node, with the guide's rendezvous store off the training
hosts (slurm.md's command, RDZV_HOST). The job is the guide's file; from here come only
what a user sets for their site: the environment (the checkpoint directory, the world,
NNODES=2:2 and one rank per node on two cores, where the store is) and sbatch's options
over its directives (three nodes instead of four; no GPUs, one CPU per task on this machine).

- A clean job: one agent per Slurm node, named after it; the third node's agent waits as
  the spare and ends ok with the others; the job ends COMPLETED.
- A lost host: once a checkpoint is validated, node n2 dies whole (its slurmd, the step's
  slurmstepd there, the agent and its rank, SIGKILLed at once). The spare's agent takes its
  ranks within seconds; slurmctld finds n2 dead 15-25 s later, sets it DOWN and, as the job
  asks (--no-kill on the job and on its step), takes n2 out of the job instead of ending it;
  the run ends with the weights of the clean job and the job ends COMPLETED. Then n2 comes
  back (its slurmd again, the node idle) and its agent is started as the guide says (a
  one-node job of the script with --agent): it is refused, in one line, as a lost host is
  for the rest of a run that is not elastic (docs/multihost.md).
- Elastic training (RESTART=in-process, NNODES=1:2, docs/elastic.md), two nodes and no
  spare: n2 dies whole; n1 goes on alone in its processes; n2 comes back, its agent is
  started again as the guide says, passes its self-test and the world grows back to both
  hosts at a checkpoint; both jobs end COMPLETED, every sample of every epoch trained once.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.hosts import EXAMPLE, ROOT, environment, journal, kill_tree
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine

from ..producers.launcher.elastic_checks import assert_each_sample_once, trained
from .slurm_cluster import SlurmCluster, SlurmUnavailable, slurm_cluster

torch = pytest.importorskip("torch")

SBATCH = ROOT / "docs" / "deploy" / "slurm.sbatch"
ELASTIC = ROOT / "docs" / "examples" / "train_elastic.py"
GUIDE = ROOT / "docs" / "deploy" / "slurm.md"
NODES = ("n1", "n2", "n3")
STEPS = 300
#: This machine's resources over the file's directives (4 nodes of 8 GPUs and 32 CPUs).
HERE = ("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=1")
VENV_PATH = f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"


def guide_block(heading: str) -> str:
    """The first bash block under `heading` in slurm.md."""
    text = GUIDE.read_text()
    assert heading in text, f"{GUIDE} lost its section {heading!r}"
    match = re.search(r"```bash\n(.*?)\n```", text.split(heading, 1)[1], re.DOTALL)
    assert match, f"no bash block under {heading!r} in {GUIDE}"
    return match.group(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    try:
        with slurm_cluster(NODES) as running:
            yield running
    except SlurmUnavailable as why:  # fail, not skip: CI must not pass without running the guide
        pytest.fail(f"no Slurm cluster here: {why}")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The rendezvous store off the training hosts, started with slurm.md's command: its port."""
    port = free_port()
    log = (tmp_path_factory.mktemp("store") / "store.log").open("w")
    env = environment(STEPS) | {"RDZV_PORT": str(port), "PATH": VENV_PATH}
    proc = subprocess.Popen(
        ["bash", "-c", guide_block("## The rendezvous store")], env=env, stdout=log, stderr=log, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, f"the store never listened on {port}"
            time.sleep(0.1)
        yield port
    finally:
        kill_tree(proc)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def job_env(workdir: Path, store: int, **extra: str) -> dict[str, str]:
    """What the user sets for the job (sbatch passes the submitter's environment on)."""
    env = environment(STEPS, **extra) | {"PATH": VENV_PATH}  # trainguard on every node's PATH
    return {k: v for k, v in env.items() if not k.startswith("SLURM")} | {
        "TRAINGUARD_CHECKPOINT_DIR": str(workdir / "ckpt"),
        "NNODES": "2:2",
        "NPROC_PER_NODE": "1",
        "RDZV_HOST": "127.0.0.1",
        "RDZV_PORT": str(store),
    }


def sbatch(cluster: SlurmCluster, workdir: Path, env: dict[str, str], *args: str) -> str:
    """The job's id; its output is workdir/trainguard-run-ID.out (the file's --output)."""
    return cluster.run("sbatch", "--parsable", *args, env=env, cwd=workdir).strip()


def output(workdir: Path, job: str) -> str:
    path = workdir / f"trainguard-run-{job}.out"
    return path.read_text() if path.exists() else ""


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def worlds(ckpt: Path, node: str) -> list[list[str]]:
    return [sorted(r["nodes"]) for r in journal(ckpt, node) if r["op"] == "attempt"]


def final_weights(ckpt: Path) -> dict[str, Any]:
    return torch.load(next(ckpt.glob(".trainguard/hosts/*/final.pt")))


@pytest.fixture(scope="module")
def clean(cluster: SlurmCluster, store: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The guide's job with no fault: its directory and job id."""
    workdir = tmp_path_factory.mktemp("clean")
    job = sbatch(cluster, workdir, job_env(workdir, store), *HERE, str(SBATCH), str(EXAMPLE))
    cluster.wait_job_ended(job, 240)
    return workdir, job


def test_the_guides_sbatch_runs_one_agent_per_slurm_node_and_the_spare_ends_ok(
    cluster: SlurmCluster, clean: tuple[Path, str], store: int
) -> None:
    workdir, job = clean
    out, ckpt = output(workdir, job), workdir / "ckpt"
    record = cluster.job(job)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    # The job says how to start a host's agent again: the run's id and where its store is.
    assert f"trainguard: run trainguard-run-{job}, rendezvous at 127.0.0.1:{store};" in out, out
    # One agent per Slurm node, each named after its node (all three share one hostname).
    assert worlds(ckpt, "n1") == worlds(ckpt, "n2") == [["n1", "n2"]], out[-3000:]
    assert f"trainguard n3: waits as a spare for run trainguard-run-{job}" in out, out[-3000:]
    for node in NODES:  # the spare too ends ok: the job's status is the run's
        (session,) = [r for r in journal(ckpt, node) if r["op"] == "session"]
        assert session["status"] == "ok", (node, session)
        assert not (ckpt / ".trainguard" / "hosts" / node / "restarts.jsonl").exists()
    assert out.count("ok: all 2 ranks exited 0 (1 attempts)") == 2, out[-3000:]
    assert f"ok: spare n3 not needed: run trainguard-run-{job} finished" in out, out[-3000:]


def lose_n2_and_bring_it_back(cluster: SlurmCluster, workdir: Path, job: str, env: dict[str, str]) -> str:
    """Once step 49 is validated: n2 dies whole, slurmctld finds it DOWN, its slurmd comes
    back (the node idle, ReturnToService=2) and its agent is started as the guide says (a
    one-node job of the same script, --agent, with the RUN_ID and RDZV_HOST the job printed).
    The agent's job id."""
    ckpt, deadline = workdir / "ckpt", time.monotonic() + 240
    while not (ckpt / "step-000000049" / "VALIDATED").exists():
        assert time.monotonic() < deadline, f"no checkpoint at step 49: {output(workdir, job)[-3000:]}"
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), output(workdir, job)[-3000:]
        time.sleep(0.1)
    cluster.lose_node(f"{job}.0", "n2")
    listed = SharedQuarantine(ckpt / ".trainguard")
    while "n2" not in listed.nodes():
        assert time.monotonic() < deadline, f"n2 was never put out: {output(workdir, job)[-3000:]}"
        time.sleep(0.1)
    cluster.wait_nodes("down", ["n2"], timeout=90)
    cluster.start_slurmd("n2")
    cluster.wait_nodes("idle", ["n2"])
    back_env = env | {"RUN_ID": f"trainguard-run-{job}"}
    args = (*HERE[1:], "--nodes=1", "--nodelist=n2", str(SBATCH), "--agent")
    return sbatch(cluster, workdir, back_env, *args, str(ELASTIC if "RESTART" in env else EXAMPLE))


def test_a_lost_slurm_node_is_replaced_by_the_spare_the_job_completes_and_the_host_is_refused_back(
    cluster: SlurmCluster, clean: tuple[Path, str], store: int, tmp_path: Path
) -> None:
    # Attempt 1 (after the loss) 0.05 s slower a step on one rank, sleeping: the run goes on
    # towards slurmctld's finding n2 dead without keeping the two cores busy; the weights
    # are the same.
    env = job_env(tmp_path, store, TRAINGUARD_EXAMPLE_FAULT="slow:0:0:1")
    ckpt = tmp_path / "ckpt"
    job = sbatch(cluster, tmp_path, env, *HERE, str(SBATCH), str(EXAMPLE))
    # n2 is put out of the run; slurmctld finds n2 dead by itself, later, and sets it DOWN
    # (the job must outlive that: checked at its end); n2 comes back, and its agent.
    back = lose_n2_and_bring_it_back(cluster, tmp_path, job, env)
    came_back = cluster.wait_job_ended(back, 120)
    # A lost host does not rejoin a run that is not elastic: refused in one line, before
    # torch is imported, writing nothing (the elastic case: the last test).
    assert (came_back["JobState"], came_back["ExitCode"]) == ("FAILED", "1:0"), output(tmp_path, back)
    (refused,) = output(tmp_path, back).splitlines()
    assert re.fullmatch(
        rf"n2 is quarantined for run trainguard-run-{job} \(host lost: .*\): it does not rejoin", refused
    )
    listed = SharedQuarantine(ckpt / ".trainguard")

    # The node's failure did not end the job (--no-kill on the job: not requeued; on its
    # step: the agents not killed): slurmctld took n2 out of it, and it completed.
    record = cluster.wait_job_ended(job, 240)
    out = output(tmp_path, job)
    ended = (record["JobState"], record["ExitCode"], record["NodeList"], record["Restarts"])
    assert ended == ("COMPLETED", "0:0", "n[1,3]", "0"), out[-3000:]
    assert "srun: error: Node failure on n2" in out, out[-3000:]
    # The spare took n2's ranks from the newest validated checkpoint; each agent of the new
    # world recorded its share, and told it.
    assert worlds(ckpt, "n1") == [["n1", "n2"], ["n1", "n3"]], out[-3000:]
    # n1's is a crash (its rank lost its peer), or, when its rank's exit came after the
    # spare was seen waiting to join (a loaded machine), a membership change.
    for node, causes in (("n1", ("crash", "membership")), ("n3", ("host_lost",))):
        (restart,) = records(ckpt / ".trainguard" / "hosts" / node / "restarts.jsonl")
        assert restart["cause"] in causes, restart
        assert (restart["hosts_lost"], restart["replaced_by"]) == (["n2"], {"n2": "n3"}), restart
        assert restart["resumed_from_step"] >= 49 and restart["complete"], restart
        assert f"trainguard {node}: n3 replaces n2: rank " in out, out[-3000:]
    assert not (ckpt / ".trainguard" / "hosts" / "n2" / "restarts.jsonl").exists()
    (decision,) = records(listed.path)
    assert decision["node"] == "n2" and decision["by"] in ("n1", "n3"), decision
    assert out.count("ok: all 2 ranks exited 0") == 2, out[-3000:]
    # The same weights as the clean job's: the loss cost time, not correctness.
    expected, got = final_weights(clean[0] / "ckpt"), final_weights(ckpt)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights diverged"


def test_elastic_a_lost_slurm_node_shrinks_the_world_and_its_return_grows_it_back(
    cluster: SlurmCluster, store: int, tmp_path: Path
) -> None:
    # No spare: two nodes. The smaller world waits before step 149 (a checkpoint step)
    # until n2 is back and asks to join, so that the run is still going when it returns.
    env = job_env(tmp_path, store, RESTART="in-process", TRAIN_GROW_AT="149")
    env |= {"NNODES": "1:2", "TRAIN_SAMPLES_FILE": str(tmp_path / "samples.jsonl")}
    ckpt = tmp_path / "ckpt"
    two = ("--nodes=2", "--nodelist=n1,n2")
    job = sbatch(cluster, tmp_path, env, *HERE[1:], *two, str(SBATCH), str(ELASTIC))
    back = lose_n2_and_bring_it_back(cluster, tmp_path, job, env)

    came_back = cluster.wait_job_ended(back, 240)
    record = cluster.wait_job_ended(job, 240)
    out, back_out = output(tmp_path, job), output(tmp_path, back)
    assert (came_back["JobState"], came_back["ExitCode"]) == ("COMPLETED", "0:0"), back_out[-3000:]
    ended = (record["JobState"], record["ExitCode"], record["Restarts"])
    assert ended == ("COMPLETED", "0:0", "0"), out[-3000:]
    # n1 trained alone after the loss, in its process, then with n2 again from a checkpoint.
    assert worlds(ckpt, "n1") == [["n1", "n2"], ["n1"], ["n1", "n2"]], out[-3000:]
    shrink, grow = records(ckpt / ".trainguard" / "hosts" / "n1" / "restarts.jsonl")
    assert (shrink["path"], shrink["world_size"], shrink["hosts_lost"]) == ("in-process", 1, ["n2"]), shrink
    assert (grow["cause"], grow["path"], grow["world_size"]) == ("resize", "in-process", 2), grow
    assert grow["resumed_from_step"] == 149 and grow["complete"], grow
    # Each sample of each epoch once (the last attempt's training of a step is the one kept).
    assert_each_sample_once(trained(tmp_path / "samples.jsonl"), STEPS, 2048, 64)
