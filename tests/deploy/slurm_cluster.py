"""A private Slurm cluster on this one machine, for tests/deploy/test_slurm.py: its own
munged (its own key and socket), a slurmctld and one slurmd per node (Debian's build runs
several slurmd on one host: `slurmd -N NODE`, each node with its own port), a slurm.conf
in a temporary directory, nothing of the machine's Slurm or munge touched. Every daemon,
job step and task it started is killed at the end, by process id, and the directory removed.

What it took (Debian 12's slurm-wlm 22.05.8, munge 0.5.15, as root):

- munged refuses a socket in a directory that not everyone may traverse ("Socket is
  inaccessible: execute permissions for all required on <dir>"): the cluster's directory
  is mode 755, the key's own directory 700.
- The clients find no configuration without SLURM_CONF ("fetch_config: DNS SRV lookup
  failed"): every command here gets it in its environment (`env`), the daemons `-f`.
- slurmd logs "mpi/pmix: can not load PMIx library" on start: harmless (MpiDefault=none).
- Every node is on 127.0.0.1 (NodeHostname=localhost), so the tasks' `hostname` is the
  same on all of them: a job names a task's node by SLURMD_NODENAME.
- cgroups are not used (proctrack/linuxproc, task/none): a task's processes are found
  through their parents, which is enough to list and kill them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainguard.producers.launcher.config import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo")
INSTALL = (
    "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge (scripts/setup, as root)"
)

#: slurmctld pings a node every SlurmdTimeout/3 s and sets it DOWN once a ping found it
#: silent for SlurmdTimeout; a ping of a node whose slurmd is gone fails only after ~11 s
#: of connection retries, so a lost node is DOWN 15-25 s after its death (300 s by default).
SLURMD_TIMEOUT_S = 3

CONF = """\
ClusterName=trainguard-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait=5
"""
NODE = "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN\n"
PARTITION = "PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP\n"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why and what to install."""


@dataclass
class SlurmCluster:
    """The cluster's files, under `root`; `env` is what a client command needs."""

    root: Path
    nodes: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(
        self,
        *command: str,
        check: bool = True,
        timeout: float = 60,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        """A Slurm command (scontrol, sbatch, ...) on this cluster: its stdout. `env` adds to
        the cluster's environment (an sbatch's job gets all of it)."""
        done = subprocess.run(
            command, env=self.env | dict(env or {}), cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(command)} exited {done.returncode}: {done.stderr}{self.log_tails()}"
            )
        return done.stdout

    def start_slurmd(self, node: str) -> None:
        """`node`'s slurmd (again, for a node that comes back)."""
        self._daemon("slurmd", "-f", str(self.conf), "-N", node)

    def node_state(self, node: str) -> str:
        return self.run("sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%T").strip()

    def wait_nodes(self, state: str, nodes: Sequence[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.node_state(node).startswith(state) for node in nodes):
            assert time.monotonic() < deadline, (
                f"nodes {nodes} not {state}: {self.run('sinfo', '-N')}{self.log_tails()}"
            )
            time.sleep(0.2)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (the job's record lasts MinJobAge, 300 s, after its end)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_job_ended(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (record := self.job(job_id))["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, f"job {job_id} still {record['JobState']}{self.log_tails()}"
            time.sleep(0.2)
        return record

    def step_pids(self, step: str, node: str) -> list[int]:
        """The processes of a job step's task on `node`, as its slurmd tracks them."""
        lines = self.run("scontrol", "listpids", step, node).splitlines()[1:]
        return [int(line.split()[0]) for line in lines if line.strip()]

    def lose_node(self, step: str, node: str) -> None:
        """The whole host gone at once: its slurmd, the step's slurmstepd there and every
        process of its task (trainguard's agent and ranks), SIGKILLed. slurmctld finds out
        by itself, as it would of a dead host (SLURMD_TIMEOUT_S)."""
        pids = self.step_pids(step, node)
        assert pids, f"step {step} has no process on {node}"
        stepd: psutil.Process | None = psutil.Process(pids[0])
        while stepd is not None and not stepd.name().startswith("slurmstepd"):
            stepd = stepd.parent()  # a rank's parent is the agent, the agent's the slurmstepd
        assert stepd is not None, f"no slurmstepd above {pids[0]}"
        family = [stepd, *stepd.children(recursive=True)]
        slurmd = psutil.Process(int((self.root / "run" / f"slurmd-{node}.pid").read_text()))
        for proc in (slurmd, *family):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"\n--- {log.name}\n" + "\n".join(tail))
        return "".join(out)

    def _daemon(self, *command: str) -> None:
        """A daemon that forks into the background: its start must succeed."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SlurmUnavailable(
                f"{' '.join(command)} exited {done.returncode}: {done.stderr}{self.log_tails()}"
            )


def _ours(conf: Path) -> list[psutil.Process]:
    """Every process that runs with this cluster's SLURM_CONF: the daemons, the job steps'
    slurmstepd (forked from a slurmd) and the jobs' processes (which inherit the submitter's
    environment)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == str(conf):
                found.append(proc)
    return found


def _stop(cluster: SlurmCluster) -> None:
    """Jobs cancelled, daemons stopped (munged with them: its pid file is there too), and
    whatever of ours is left after 10 s (a step's processes) killed."""
    with contextlib.suppress(Exception):
        cluster.run("scancel", "--user=root", check=False, timeout=10)
    for pidfile in sorted((cluster.root / "run").glob("*.pid")):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (left := _ours(cluster.conf)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@contextlib.contextmanager
def slurm_cluster(nodes: Sequence[str], extra_env: Mapping[str, str] = {}) -> Iterator[SlurmCluster]:
    """A running cluster of `nodes` (all idle), torn down on exit."""
    missing = [exe for exe in DAEMONS if not shutil.which(exe)]
    if missing:
        raise SlurmUnavailable(f"not on PATH: {', '.join(missing)}; {INSTALL}")
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            "the private cluster's slurmd runs jobs as root (SlurmdUser=root): run as root"
        )
    root = Path(tempfile.mkdtemp(prefix="trainguard-slurm-"))
    root.chmod(0o755)  # munged's socket: every directory above it traversable by all
    for sub in ("key", "munge", "state", "run", "log", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True)
    (root / "key").chmod(0o700)
    key = root / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    socket = root / "munge" / "munge.socket"
    cpus = os.cpu_count() or 1
    text = CONF.format(root=root, ctld_port=free_port(), munge_socket=socket, slurmd_timeout=SLURMD_TIMEOUT_S)
    text += "".join(NODE.format(name=n, port=free_port(), cpus=cpus) for n in nodes)
    (root / "slurm.conf").write_text(text + PARTITION.format(nodes=",".join(nodes)))
    # No outer job's Slurm settings, and none of trainguard's (the suite's broker, a secret):
    # a job gets what its test gives it (an sbatch's job inherits this whole environment).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TRAINGUARD_", "TRAIN_"))}
    cluster = SlurmCluster(
        root, list(nodes), env | dict(extra_env) | {"SLURM_CONF": str(root / "slurm.conf")}
    )
    try:
        cluster._daemon(
            "munged", f"--socket={socket}", f"--key-file={key}", f"--pid-file={root}/run/munged.pid",
            f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed",
        )  # fmt: skip
        cluster._daemon("slurmctld", "-f", str(cluster.conf))
        for node in nodes:
            cluster.start_slurmd(node)
        cluster.wait_nodes("idle", nodes)
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(root, ignore_errors=True)
