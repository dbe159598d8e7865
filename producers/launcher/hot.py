"""In-process restart, the launcher's side (issue 18; the rank's side is
producers/training/inprocess.py): rank processes that outlive attempts, warm spares, and
the store through which both meet.

``trainguard launch --restart in-process [--warm-spares K]``. The launcher serves a
control store (torch's ``TCPStore``) for the whole run, and one store per attempt for that
attempt's process group: the ranks run with torchrun's agent-store contract
(``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` = that attempt's store), so a plain
``init_process_group`` joins the attempt's world, and a new attempt never meets an old
one's keys (pytorch#135712 is that bug for one shared store).

Across hosts (``--nnodes``) each host's agent has a HotRanks of its own (its control store
stays local: its survivors wait there); the agent of the plan's first host serves the
attempt's store, on the port it proposed (agent_store.py), and the hosts of an attempt
share the round's own store for what crosses hosts: the abort and the stacks.

When a rank dies, the others' collectives fail at once (gloo; NCCL once aborted) and they
wait in the control store. :class:`HotRanks` then gives each survivor the next attempt's
environment and each failed rank to a warm spare (a process of the same command that
imported everything and idles: ``spare/<worker>/ready``), or to a new process when no
spare is ready. Spares are topped up again in the background. What cannot go on in
process (no survivor, the launcher's own restart) is the full restart of today.

Every process is bound to the launcher (agent_bound.py: it dies with it, a warm spare
too). Its streams go to ``workers/<worker>.{stdout,stderr}.log`` under the log root;
rank_output.py copies each line to the console, prefixed by the rank the process serves
(``[spare-N]:`` before it has one), and into that rank's files of the attempt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from subprocess import Popen
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ...common.stacks import odd_stack
from ..training.inprocess import (
    ENV_STORE,
    ENV_WAIT_S,
    ENV_WORKER,
    abort_key,
    env_key,
    left_key,
    resize_key,
    resize_value,
    spare_attempt_key,
    spare_ready_key,
    stack_key,
)
from .agent_bound import bound
from .agent_store import AgentStores
from .config import LauncherConfig, rank_program
from .fork_server import ForkServers, start_handler
from .rank_output import Console, Owner, RankOutput, rank_dir

log = logging.getLogger(__name__)

#: Across hosts, how much longer than its own ranks an agent waits for the others'
#: stacks (each host's agent sets them once its own ranks' are in or its wait is over).
SHARED_WAIT_S = 2.0


class HotRanks:
    """The run's rank processes and warm spares, across attempts."""

    def __init__(
        self,
        config: LauncherConfig,
        run_dir: Path,
        output: RankOutput | None = None,
        forks: ForkServers | None = None,
    ) -> None:
        self.config = config
        #: Workers forked from a server that imported torch (fork_server.py), when the
        #: command is a Python script or module; else each a new process.
        self.forks = forks
        self.run_dir = run_dir
        self.output = output or RankOutput(Console(config.tee, config.redirects))
        #: worker -> (attempt, rank, local rank) it serves: where its lines go (rank_output.py).
        self.serving: dict[str, tuple[int, int, int]] = {}
        host = config.master_addr
        self.control = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.address = f"{host}:{self.control.port}"
        #: rank -> its live process, and the worker name it has in the control store.
        self.procs: dict[int, SubprocessHandler] = {}
        self.workers: dict[int, str] = {}
        #: Idle spares, oldest first: (worker, process).
        self.spares: list[tuple[str, SubprocessHandler]] = []
        self.stores = AgentStores(config.master_addr)  # each attempt's process group's store
        self._count = 0
        #: The last start's ranks kept in process, given to a warm spare, to a new process.
        self.taken: dict[str, list[int]] = {}
        #: Across hosts: the store the hosts of the current attempt share (None: one host).
        self.shared: Any = None
        #: Elastic training: ranks the world is short of (a smaller world runs): workers
        #: started beyond the warm spares, to grow back with once ready.
        self.missing = 0

    # ------------------------------------------------------------ an attempt's processes
    def attempt_env(self, attempt: int, rank_env: Mapping[str, str], worker: str) -> dict[str, str]:
        """A rank's environment with this attempt's store, its worker name and its error
        file (torch elastic's process layer, which names one per rank in a full restart,
        does not start these processes)."""
        errors = rank_dir(self.config.log_root, attempt, int(rank_env["RANK"]))
        errors.mkdir(parents=True, exist_ok=True)
        ours = {
            ENV_STORE: self.address,
            ENV_WORKER: worker,
            ENV_WAIT_S: f"{self.config.restart_wait_s:g}",
            "TORCHELASTIC_ERROR_FILE": str(errors / "error.json"),
        }
        if self.shared is not None:  # across hosts: the first host's agent serves it (the plan's port)
            return {**rank_env, **ours}
        return {
            **rank_env,
            "MASTER_PORT": str(self.stores.port(attempt)),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            **ours,
        }

    def survivors(self) -> list[int]:
        return sorted(r for r, p in self.procs.items() if p.proc.poll() is None)

    def start(
        self, attempt: int, envs: Mapping[int, Mapping[str, str]], in_process: bool, shared: Any = None
    ) -> dict[int, Popen[Any]]:
        """Attempt `attempt`'s rank processes. `in_process`: the live ones go on in their
        processes, each failed rank goes to a ready warm spare or a new process; else every
        process is new (the first attempt, a full restart); a survivor whose rank or node
        changed was ended by the caller (attempt.py). `shared`: the store of the attempt's
        hosts (across hosts)."""
        taken: dict[str, list[int]] = {"kept": [], "warm": [], "new": []}
        self.shared = shared
        live = set(self.survivors()) if in_process else set()
        if not in_process:  # every rank starts as an idle worker, as the spares do, so that
            self.kill(list(self.procs))  # they are ready (imported) when the ranks are
            self.top_up(len(envs))
            self.wait_ready(len(envs) + self.config.warm_spares, self.config.restart_wait_s)
        for rank in sorted(envs):
            local_rank = int(envs[rank].get("LOCAL_RANK", rank))
            if rank in live:
                worker = self.workers[rank]
                self.serving[worker] = (attempt, rank, local_rank)
                self.control.set(
                    env_key(attempt, worker), json.dumps(self.attempt_env(attempt, envs[rank], worker))
                )
                taken["kept"].append(rank)
                continue
            spare = self._ready_spare()
            if spare is not None:
                worker, handler = spare
                self.serving[worker] = (attempt, rank, local_rank)
                env = self.attempt_env(attempt, envs[rank], worker)
                self.control.set(env_key(attempt, worker), json.dumps(env))
                self.control.set(spare_attempt_key(worker), str(attempt))
                taken["warm"].append(rank)
            else:
                worker = self._name("rank")
                self.serving[worker] = (attempt, rank, local_rank)
                handler = self._spawn(worker, self.attempt_env(attempt, envs[rank], worker))
                taken["new"].append(rank)
            self.procs[rank], self.workers[rank] = handler, worker
        self.taken = taken
        self.top_up()
        return {r: self.procs[r].proc for r in envs}

    def renumber(self, ranks: Mapping[int, int]) -> None:
        """Elastic training: the survivors take the ranks of a world of another size (old
        rank -> new rank); a survivor left out is ended."""
        procs, workers = self.procs, self.workers
        self.kill([r for r in procs if r not in ranks])
        self.procs = {ranks[r]: h for r, h in procs.items() if r in ranks}
        self.workers = {ranks[r]: w for r, w in workers.items() if r in ranks}

    def ready(self) -> int:
        """Warm spares ready (imported, idling) now."""
        return sum(1 for w, h in self.spares if h.proc.poll() is None and self._ready(w))

    def resize(self, attempt: int, within_s: float | None = None, why: str = "") -> None:
        """Ask `attempt`'s ranks to checkpoint at a step they agree on and leave there, in
        their processes (inprocess.WorldResize): for a world of another size (the boundary
        the cadence makes due, or one within TRAINGUARD_GROW_WITHIN_S), or to drain a node
        (drain.py: at the latest `within_s` from now). A grow asked after a drain leaves the
        drain's deadline in place."""
        key = resize_key(attempt)
        if within_s is None and self.control.check([key]):
            return
        self.control.set(key, resize_value(within_s, why))

    def culprits(self, attempt: int, ranks: list[int], world: list[int], timeout_s: float) -> list[int]:
        """After an Abort with stack dumps: the ranks of `world` whose stack is the odd one
        out (the processor's rule, processors/core/detectors/stacks.py), once every rank noted its
        signature or `timeout_s` passed; [] when none stands out (a full restart then).
        `ranks`: this host's; across hosts each agent passes its ranks' signatures on in
        the shared store and reads the others'."""
        deadline = time.monotonic() + timeout_s
        signatures = _noted(self.control, {r: stack_key(attempt, r) for r in ranks}, deadline)
        if self.shared is not None:
            for rank in ranks:  # "" for one that noted nothing: the others need not wait for it
                self.shared.set(stack_key(attempt, rank), signatures.get(rank, ""))
            others = {r: stack_key(attempt, r) for r in world if r not in ranks}
            signatures |= _noted(self.shared, others, deadline + SHARED_WAIT_S)
        verdict = odd_stack({r: s for r, s in signatures.items() if s})
        return verdict.culprits if verdict is not None else []

    def abort(self, attempt: int) -> None:
        """Tell `attempt`'s ranks to abort their communicators (NCCL; gloo's fail by
        themselves), on every host of the attempt."""
        self.control.set(abort_key(attempt), "1")
        if self.shared is not None:
            with contextlib.suppress(Exception):  # the rendezvous host may be the one lost
                self.shared.set(abort_key(attempt), "1")

    def aborted_elsewhere(self, attempt: int) -> bool:
        """Across hosts: another host's agent ended `attempt` (its ranks are told here too)."""
        try:
            if self.shared is None or not self.shared.check([abort_key(attempt)]):
                return False
        except Exception:  # the rendezvous host is gone: its ranks' loss ends the attempt
            return False
        self.control.set(abort_key(attempt), "1")
        return True

    def left(self, attempt: int, ranks: list[int]) -> dict[int, str]:
        """Which of `ranks` left `attempt` alive (inprocess.py: a lost peer), and why."""
        keys = {r: left_key(attempt, self.workers[r]) for r in ranks if r in self.workers}
        noted = {r: k for r, k in keys.items() if self.control.check([k])}
        return {r: str(json.loads(bytes(self.control.get(k))).get("error", "")) for r, k in noted.items()}

    # ------------------------------------------------------------ warm spares
    def top_up(self, extra: int = 0) -> None:
        """Start workers until `warm_spares` + `extra` are alive (ready once imported)."""
        self.spares = [(w, h) for w, h in self.spares if h.proc.poll() is None]
        while len(self.spares) < self.config.warm_spares + extra + self.missing:
            worker = self._name("spare")
            env = {
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                **self.config.env,
                ENV_STORE: self.address,
                ENV_WORKER: worker,
                "TRAINGUARD_RUN_ID": self.config.run_id,
            }
            self.spares.append((worker, self._spawn(worker, env)))

    def wait_ready(self, count: int, timeout_s: float) -> bool:
        """Until `count` workers idle, or `timeout_s`, or none is left still importing
        (one that died at import left its error in its log under workers/)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [w for w, h in self.spares if h.proc.poll() is None]
            ready = self.ready()
            if ready >= count:
                return True
            if ready == len(alive) or time.monotonic() > deadline:
                log.warning("%d of %d workers ready (the others: %s/workers/*.log)", ready, count,
                            self.config.log_root)  # fmt: skip
                return False
            time.sleep(0.02)

    def _ready(self, worker: str) -> bool:
        return bool(self.control.check([spare_ready_key(worker)]))

    def _ready_spare(self) -> tuple[str, SubprocessHandler] | None:
        for i, (worker, handler) in enumerate(self.spares):
            if handler.proc.poll() is None and self._ready(worker):
                return self.spares.pop(i)
        return None

    # ------------------------------------------------------------ processes
    def _name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}-{self._count - 1}"

    def _spawn(self, worker: str, env: Mapping[str, str]) -> SubprocessHandler:
        logs = self.config.log_root / "workers"
        logs.mkdir(parents=True, exist_ok=True)
        program = bound(rank_program(self.config.command))
        out, err = logs / f"{worker}.stdout.log", logs / f"{worker}.stderr.log"
        spec: dict[str, Any] = {
            "entrypoint": program[0], "args": tuple(program[1:]), "env": dict(env),
            "stdout": str(out), "stderr": str(err), "local_rank_id": 0, "numa_options": None,
        }  # fmt: skip
        handler = start_handler(self.forks, spec)
        self.output.follow(out, Std.OUT, lambda: self._owner(worker))
        self.output.follow(err, Std.ERR, lambda: self._owner(worker))
        return handler

    def _owner(self, worker: str) -> Owner:
        """Whose lines `worker`'s streams hold now: the rank it serves, else its own name."""
        serving = self.serving.get(worker)
        if serving is None:
            return Owner(worker)
        attempt, rank, local_rank = serving
        return Owner(f"rank{rank}", local_rank, rank_dir(self.config.log_root, attempt, rank))

    def kill(self, ranks: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
        """End these ranks' processes (their process groups) and forget them."""
        for rank in ranks:
            handler = self.procs.pop(rank, None)
            self.workers.pop(rank, None)
            if handler is not None:
                _signal(handler, sig)

    def end(self, ranks: list[int], sig: signal.Signals, timeout_s: float) -> None:
        """End these ranks' processes: `sig`, then SIGKILL after `timeout_s`; forget them."""
        handlers = [self.procs[r] for r in ranks if r in self.procs]
        for handler in handlers:
            _signal(handler, sig)
        _reap(handlers, timeout_s)
        self.kill(ranks)

    def close(self, sig: signal.Signals, timeout_s: float) -> None:
        """End every rank and spare: `sig`, then SIGKILL after `timeout_s`."""
        spares, self.spares = [h for _, h in self.spares], []
        for handler in spares:
            _signal(handler, sig)
        self.end(list(self.procs), sig, timeout_s)
        _reap(spares, timeout_s)
        for handler in spares:
            _signal(handler, signal.SIGKILL)


def _noted(store: Any, keys: Mapping[int, str], deadline: float) -> dict[int, str]:
    """The values of `keys` (rank -> key) set in `store` by `deadline` (polled: a blocking
    wait would hold the store's connection)."""
    while not store.check(list(keys.values())) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {r: bytes(store.get(k)).decode() for r, k in keys.items() if store.check([k])}


def _reap(handlers: list[SubprocessHandler], timeout_s: float) -> None:
    """Until every one of `handlers` exited, or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(h.proc.poll() is None for h in handlers) and time.monotonic() < deadline:
        time.sleep(0.02)


def _signal(handler: SubprocessHandler, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(handler.proc.pid, sig)
