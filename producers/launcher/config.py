"""`trainguard launch`'s configuration (`LauncherConfig`, every field documented), and small
helpers to build a command and a port. (Its kill points are a chaos knob: producers/chaos.)"""

from __future__ import annotations

import hashlib
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ...common.checkpoint_location import is_url
from ...home import trainguard_home
from .rendezvous import RendezvousSpec

#: --preload's default: the fork server imports torch and trainguard's rank side. (Not
#: torch._dynamo, which DistributedDataParallel imports when first built, 1.3 s of CPU per
#: rank: with it preloaded, spares were ready early enough to change what a drain test saw,
#: and it is not yet measured; `--preload torch,torch._dynamo,trainguard.torch` adds it.)
PRELOAD = ("torch", "trainguard.torch")


@dataclass(frozen=True)
class LauncherConfig:
    """Everything `trainguard launch` takes; every field documented."""

    #: The rank program and its arguments, e.g. ["python", "train.py", "--lr", "3e-4"].
    command: tuple[str, ...]
    #: World size: rank processes per attempt.
    nproc: int
    #: Ranks of one modelled node (on one machine, a node is a group of ranks).
    ranks_per_node: int
    run_id: str
    #: Where validated checkpoints live (root/step-000000123/VALIDATED): a directory, or an
    #: fsspec URL such as s3://bucket/ckpt (trainguard/common/checkpoint_location.py).
    checkpoint_dir: Path | str
    #: Spare node names beyond the job's own nodes (what quarantine can swap in).
    spares: int = 2
    nodes_per_rack: int = 4
    #: Restarts (of any cause) before the launcher gives up with status "failed".
    max_restarts: int = 3
    #: After an Abort: time the ranks get to dump their stacks and exit on their own.
    grace_s: float = 15.0
    #: After SIGTERM: time before SIGKILL (whole seconds; torch elastic's close()).
    term_timeout_s: int = 10
    #: After a crash: time the processor gets to decide (quarantine) before the respawn.
    decision_wait_s: float = 3.0
    poll_s: float = 0.05
    #: Launcher files: attempt-N/rank-R.phases.json, restarts.jsonl (default: shared_dir).
    run_dir: Path | None = None
    #: The launcher's state, a directory (--state-dir; see shared_dir).
    state_dir: Path | None = None
    master_addr: str = "127.0.0.1"
    bootstrap: str = ""
    topic_prefix: str = ""
    secret_file: str = ""
    #: Extra environment for every rank.
    env: dict[str, str] = field(default_factory=dict)
    #: Test hook, FAULT_ENV's value: SIGKILL the launcher at this point (FAULT_POINTS).
    fault: str = ""
    #: When a spare is self-tested (known-answer GEMM + all-reduce, producers/launcher/node_selftest.py)
    #: before it joins: "ahead" (the default) one idle spare at a time from the start of the
    #: run and again whenever its pass is older than `self_test_fresh_s`, so a restart finds
    #: its spare proven and waits for nothing; "on-demand" only when a quarantine makes it the
    #: next placement's (the restart may wait for the test); "off": untested.
    self_test_spares: Literal["on-demand", "ahead", "off"] = "ahead"
    #: How long a spare's passed self-test stays good: an older pass is renewed while the
    #: spare idles ("ahead") and, if still stale when the spare is needed, before it joins.
    self_test_fresh_s: float = 1800.0
    #: Longest a node self-test may take (its worker processes are killed after it).
    self_test_timeout_s: float = 120.0
    #: When every checkpoint was rejected (none valid left): False stops the run with a
    #: message that says so; True starts the next attempt from step 0 (scratch).
    restart_from_scratch: bool = False
    #: Across hosts (docs/multihost.md): torchrun's rendezvous flags. None: one host, every
    #: rank here, nodes modelled as groups of `ranks_per_node` ranks.
    rendezvous: RendezvousSpec | None = None
    #: This host's node name in every event (--node-name; default: the hostname).
    node_name: str = ""
    #: Across hosts (--spare): this agent waits outside the rendezvous until the run needs
    #: a host (one of the newest world's stopped beating or was quarantined), then joins;
    #: it never grows a world below MAX, and ends (status ok) when the run finished.
    spare: bool = False
    #: Across hosts: a host whose beat did not change for this long is taken for lost
    #: (producers/launcher/liveness.py): the rendezvous' keep-alive, 1 s x 3.
    host_stale_s: float = 3.0
    #: What a rank's fault restarts (--restart): "full", every rank process ended and
    #: spawned again; "in-process" (producers/launcher/hot.py), the survivors stay in their
    #: processes and only the failed ranks' processes are replaced, by a warm spare when
    #: one is ready (docs/inprocess.md; across hosts too).
    restart: Literal["full", "in-process"] = "full"
    #: In-process restart (--warm-spares): processes kept per host with the interpreter,
    #: torch and the user's modules imported, idle until one takes a failed rank.
    warm_spares: int = 0
    #: --preload: modules a fork server imports once (producers/launcher/fork_server.py);
    #: each rank of a ``python script.py`` or ``python -m module`` command is then forked
    #: from it instead of being a new interpreter that imports them again (full restarts;
    #: in-process workers and warm spares too). (): a new process per rank.
    preload: tuple[str, ...] = PRELOAD
    #: In-process restart: how long a survivor waits in the store for the next attempt
    #: before it gives up (the launcher ends it sooner when it restarts in full instead).
    restart_wait_s: float = 300.0
    #: Elastic training (--min-nproc; issue 45, docs/elastic.md): under in-process restart,
    #: a rank lost with no ready spare lets the survivors go on in a smaller world of at
    #: least this many ranks (when the policy prefers it to waiting), and the world grows
    #: back at a checkpoint boundary once a spare is ready. None: never smaller than nproc.
    min_nproc: int | None = None
    #: Elastic training across hosts (--nnodes MIN:MAX with MIN < MAX under in-process
    #: restart; docs/elastic.md): after a lost peer, how long the survivors' agents wait for
    #: every host of the attempt to answer (producers/launcher/roll_call.py) before the ones
    #: that did go on without the others, in their processes.
    survivors_wait_s: float = 1.0
    #: After a rank's error before any rank completed a step: how long the other ranks get
    #: to end on their own before the teardown, so that the same error on other nodes is
    #: seen (producers/launcher/startup.py); a rank blocked in a collective is torn down after it.
    startup_settle_s: float = 2.0
    #: --log-dir (torchrun's): the base directory of the ranks' log files, a directory per
    #: run below it (log_root). None: the launcher's files' directory (run dir)/logs.
    log_dir: Path | None = None
    #: --tee (torchrun's Std: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank
    #: "0:3,1:2"): the ranks' streams copied to the console with a [rankN]: prefix. Every
    #: stream is in the ranks' log files whatever these say (rank_output.py).
    tee: str = "3"
    #: --redirects (torchrun's Std): streams kept off the console (their log files only).
    redirects: str = "0"
    #: Lemon nodes (issue 46, producers/launcher/lemons.py): the archive whose history
    #: across runs keeps them out of the launch (--archive: a directory or an object-store
    #: URI; "": no history read, no node kept out for it).
    archive: str = ""
    #: A node with this many failures within `lemon_days` in the archive is kept out of the
    #: run, with the reason (trainguard/common/lemons.py; 0: never).
    lemon_failures: int = 3
    lemon_days: float = 30.0

    @property
    def node(self) -> str:
        return self.node_name or socket.gethostname()

    @property
    def shared_dir(self) -> Path:
        """The launcher's state: across hosts a directory every host mounts (beats, journals,
        the quarantine list). --state-dir, else DIR/.trainguard beside the checkpoints; with an
        object-store DIR, $TRAINGUARD_HOME/launch/RUN_ID (one host: the CLI requires
        --state-dir across hosts)."""
        if self.state_dir is not None:
            return self.state_dir
        if isinstance(self.checkpoint_dir, str) and is_url(self.checkpoint_dir):
            return trainguard_home() / "launch" / self.run_id
        return Path(self.checkpoint_dir) / ".trainguard"

    @property
    def elastic(self) -> bool:
        """The world may shrink below nproc (and grow back) under in-process restart: on one
        host with --min-nproc; across hosts with --nnodes MIN:MAX, MIN < MAX (torchrun's)."""
        if self.restart != "in-process":
            return False
        if self.rendezvous is not None:
            return self.rendezvous.min_nodes < self.rendezvous.max_nodes
        return self.min_nproc is not None and self.min_nproc < self.nproc

    @property
    def resolved_run_dir(self) -> Path:
        """The launcher's files. Across hosts each agent has its own under the shared
        directory (its journal must not be another host's)."""
        if self.run_dir is not None:
            return self.run_dir
        base = self.shared_dir
        return base / "hosts" / self.node if self.rendezvous is not None else base

    @property
    def log_root(self) -> Path:
        """The ranks' log files (producers/launcher/rank_output.py): --log-dir/RUN_ID (across
        hosts /NODE too: one agent's ranks each), else the run dir's logs/."""
        if self.log_dir is None:
            return self.resolved_run_dir / "logs"
        root = self.log_dir / self.run_id
        return root / self.node if self.rendezvous is not None else root


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def rank_program(command: Sequence[str]) -> tuple[str, ...]:
    """What each rank runs. torchrun's form, a script and its arguments (``train.py
    --lr 3e-4``), runs it with this interpreter (``python -u``, as torchrun does); any other
    program (``python train.py``, a binary) runs as given."""
    if command and command[0].endswith(".py"):
        return (sys.executable, "-u", *command)
    return tuple(command)


def default_run_id(command: Sequence[str], cwd: Path) -> str:
    """The run id when none is given (one host): the script's name and a digest of the
    working directory and the command, e.g. ``train-1f2e3d4c``. The same command relaunched
    in the same directory (after a killed launcher, a reboot) is the same run and resumes
    it; another script, other arguments or another directory is another run."""
    first = Path(command[0]).name if command else "run"
    script = next((Path(a).stem for a in command if a.endswith(".py")), first)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", script).strip("-.")[:40] or "run"
    digest = hashlib.sha256("\0".join([str(cwd), *command]).encode()).hexdigest()[:8]
    return f"{name}-{digest}"


def python_command(script: str, *args: str) -> tuple[str, ...]:
    """The current interpreter running `script` (tests, examples)."""
    return (sys.executable, script, *args)
