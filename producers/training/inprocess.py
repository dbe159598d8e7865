"""In-process restart, the rank's side (issue 18; seed §6 (3), R4): a fault ends the
training function, not the process.

A training script hands its function to :func:`run` (one line; the README's example)::

    if __name__ == "__main__":
        inprocess.run(main)

Outside ``trainguard launch --restart in-process`` that is ``main()``. Under it:

- A **survivor** of a peer's death: the collective raises (gloo: "connection reset by
  peer"; NCCL: the communicator aborted by :class:`_AbortWatch` when the launcher says
  so), :func:`~.peer_loss.peer_lost` says the error is a lost peer's, and this wrapper
  ends the attempt inside the process: the attempt's resources are released (the
  Supervisor's telemetry threads, the checkpoint manager's, registered with
  :func:`on_restart`), the frames holding the old model are cleared, every process group
  is destroyed; then it waits in the launcher's store for the next attempt's environment
  (RANK, WORLD_SIZE, TRAINGUARD_ATTEMPT, TRAINGUARD_RESUME_STEP, MASTER_PORT of that
  attempt's store...), puts it in ``os.environ`` and calls the function again. The
  interpreter, torch and the user's modules stay imported; the checkpoint manager's host
  memory copy (:func:`keep`: the peer replica outlives the attempt) is what it restores.
- A **warm spare** (``TRAINGUARD_WORKER`` starting with ``spare``): the script ran up to
  this call, so everything it imports is imported; it registers in the store, idles until
  the launcher gives it a failed rank's environment, and then calls the function, which
  restores that rank's state from the peer replica (the rank holding its copy), falling
  back to storage.

Any other error (this rank's own fault: a bug, an OOM, a NaN raised) ends the process as
before: the launcher replaces it. The launcher owns the decision (which ranks are
replaced, whether a full restart is needed instead) and kills a process it gives up on;
so this side only ever waits for the launcher, bounded by ``TRAINGUARD_RESTART_WAIT_S``,
and leaves with the original error if the launcher is gone.

Keys in the launcher's control store (producers/launcher/hot.py writes the other side):
``spare/<worker>/ready`` (a spare idles), ``spare/<worker>/attempt`` (its assignment),
``env/<attempt>/<worker>`` (a JSON environment), ``left/<attempt>/<worker>`` (a survivor
reached the barrier, with its error), ``resize/<attempt>`` (a planned leave: checkpoint at an
agreed step, then leave: :class:`WorldResize`; for a world of another size, or a node drained
before it fails; its value, :func:`resize_value`, may carry the latest the boundary may come),
``abort/<attempt>`` (end that attempt's collectives: NCCL's abort; gloo's cannot be aborted, the
launcher ends the stuck rank).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from .peer_loss import chain, peer_lost

log = logging.getLogger(__name__)

T = TypeVar("T")

ENV_STORE = "TRAINGUARD_RESTART_STORE"  # host:port of the launcher's control store
ENV_WORKER = "TRAINGUARD_WORKER"  # this process's name in it
ENV_WAIT_S = "TRAINGUARD_RESTART_WAIT_S"  # how long a survivor or a spare waits for the launcher
#: A resize waits for the next checkpoint the cadence makes due, at most this long (then
#: one is taken for it): the world stays small no longer than that once capacity is back.
ENV_GROW_WITHIN_S = "TRAINGUARD_GROW_WITHIN_S"
PREFIX = "trainguard/"
POLL_S = 0.02  # the store is local to the launcher: a check is one round trip on loopback
WAIT_SLICE = timedelta(seconds=0.2)  # how often a collective's wait looks for the launcher's abort


#: How a rank's planned leaving (:class:`WorldResize`) reads in ``left/<attempt>/<worker>``.
RESIZED = "the world is resized"


class WorldResize(RuntimeError):
    """A planned membership change (elastic training, issue 45): the launcher asked for a
    world of another size, the ranks agreed on a step, checkpointed at it and leave the
    attempt there, in their processes (the Supervisor raises it at that step's end; its
    message starts with :data:`RESIZED`)."""


class AttemptAborted(RuntimeError):
    """The launcher ended the attempt (a peer was lost or stuck) while this rank waited in
    a collective: raised out of :func:`wait` so that the wrapper restarts in process."""


def env_key(attempt: int, worker: str) -> str:
    return f"{PREFIX}env/{attempt}/{worker}"


def left_key(attempt: int, worker: str) -> str:
    return f"{PREFIX}left/{attempt}/{worker}"


def spare_ready_key(worker: str) -> str:
    return f"{PREFIX}spare/{worker}/ready"


def spare_attempt_key(worker: str) -> str:
    return f"{PREFIX}spare/{worker}/attempt"


def abort_key(attempt: int) -> str:
    return f"{PREFIX}abort/{attempt}"


def resize_key(attempt: int) -> str:
    return f"{PREFIX}resize/{attempt}"


def resize_value(within_s: float | None = None, why: str = "") -> str:
    """What the launcher sets ``resize/<attempt>`` to: ``"1"`` (a grow-back: the boundary
    within ``TRAINGUARD_GROW_WITHIN_S``), or JSON with the latest the boundary may come,
    counted from when the rank notes it (a DrainNode's ``within_s``), and why."""
    if within_s is None:
        return "1"
    return json.dumps({"within_s": max(0.0, within_s), "why": why[:500]})


def resize_within(value: str) -> float:
    """The seconds a resize may wait for the checkpoint the cadence makes due, from the
    key's value (:func:`resize_value`); ``TRAINGUARD_GROW_WITHIN_S`` (default 60) when it
    names none."""
    try:
        within = json.loads(value).get("within_s") if value.startswith("{") else None
    except (ValueError, AttributeError):
        within = None
    if isinstance(within, int | float) and within >= 0:
        return float(within)
    return float(os.environ.get(ENV_GROW_WITHIN_S, "60"))


def stack_key(attempt: int, rank: int) -> str:
    return f"{PREFIX}stack/{attempt}/{rank}"


def is_spare(worker: str) -> bool:
    return worker.startswith("spare")


class Restartable:
    """One process's in-process restarts: the store, the resources of the attempt in
    progress, and what outlives attempts (:meth:`keep`)."""

    def __init__(self, store: Any, worker: str, wait_s: float) -> None:
        self.store = store
        self.worker = worker
        self.wait_s = wait_s
        #: When the current attempt began in this process (the wall clock): the restart
        #: phases of a survivor start here, not at the process's start.
        self.attempt_start_ts: float | None = None
        self._closers: list[Callable[[BaseException | None], None]] = []
        self._kept: dict[str, Any] = {}
        #: Set by the abort watch when the launcher ends the attempt; cleared per attempt.
        self.aborting = threading.Event()
        #: Set by the same watch when the launcher asks for a world of another size (a
        #: spare is back): the Supervisor checkpoints at a step the ranks agree on and
        #: leaves there (:class:`WorldResize`); cleared per attempt.
        self.resizing = threading.Event()
        #: Gloo process groups of ended attempts: not destroyed (a pending operation would
        #: block the destroy until gloo's timeout), only forgotten by torch.distributed.
        self._ended_groups: list[Any] = []
        self._abort = _AbortWatch(store, self.aborting, self.resizing)

    @property
    def attempt(self) -> int:
        return int(os.environ.get("TRAINGUARD_ATTEMPT", "0"))

    def resize_now(self, checkpoint_due: bool) -> bool:
        """The launcher asked for a planned leave (a resize, a drain) and this step is its
        boundary: a checkpoint is due anyway, or the leave's deadline passed (the key's
        ``within_s``, else ``TRAINGUARD_GROW_WITHIN_S``, default 60 s, from when it was noted)."""
        by = self._abort.resize_by
        if not self.resizing.is_set() or by is None:
            return False
        return checkpoint_due or time.monotonic() >= by

    def run(self, main: Callable[[], T]) -> T:
        if is_spare(self.worker):
            self._await_assignment()
        while True:
            self.aborting.clear()
            self.resizing.clear()
            self._abort.watch(self.attempt)
            try:
                return main()
            except Exception as error:  # BaseException (SystemExit, KeyboardInterrupt) ends the process
                why = str(error) if isinstance(error, WorldResize) else peer_lost(error)
                if why is None:
                    raise
                _release_frames(error)  # they hold the old model, DDP and its process group
            finally:
                self._abort.stop()
            # Out of the except clause: nothing references the ended attempt's objects now,
            # so its process groups close their connections (a survivor still waiting on
            # this one in a collective fails at once instead of at gloo's timeout).
            attempt = self.attempt
            log.warning(
                "trainguard: attempt %d ended in this process (%s); waiting for the next", attempt, why
            )
            self._end_attempt()
            self._leave(attempt, why)
            self._await_env(attempt + 1, self.wait_s)

    # ------------------------------------------------------------ the attempt's resources
    def on_restart(self, close: Callable[[BaseException | None], None]) -> None:
        """Run ``close(error)`` when the attempt ends in this process (first registered, last run)."""
        self._closers.append(close)

    def keep(self, key: str, make: Callable[[], T]) -> T:
        """The object kept under ``key`` across attempts, made by ``make`` the first time."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def forget(self, key: str) -> None:
        self._kept.pop(key, None)

    def _end_attempt(self) -> None:
        while self._closers:  # last registered first; none kept once run
            close = self._closers.pop()
            try:
                close(None)
            except Exception:
                log.exception("trainguard: releasing the ended attempt's resources failed")
            del close
        if dist.is_initialized():
            if dist.get_backend() == "nccl":  # aborted already (the abort watch): destroy at once
                try:
                    dist.destroy_process_group()
                except Exception:
                    log.exception("trainguard: destroying the ended attempt's process groups failed")
            else:
                self._ended_groups += _forget_process_groups()
        gc.collect()

    # ------------------------------------------------------------ the launcher's store
    def note_stack(self, rank: int, signature: str) -> None:
        """An Abort's stack signature of this rank (rank/handlers.py), for the launcher to
        name the stuck rank (the odd stack out) and end only that one."""
        try:
            self.store.set(stack_key(self.attempt, rank), signature)
        except Exception:
            log.exception("trainguard: the launcher's store is unreachable")

    def _leave(self, attempt: int, why: str) -> None:
        try:
            self.store.set(left_key(attempt, self.worker), json.dumps({"pid": os.getpid(), "error": why}))
        except Exception:
            log.exception("trainguard: the launcher's store is unreachable")

    def _await_assignment(self) -> None:
        """A warm spare: warm up, then idle until the launcher gives this process a rank."""
        _warm_up()
        self.store.set(spare_ready_key(self.worker), str(os.getpid()))
        attempt = int(self._get(spare_attempt_key(self.worker), None))
        self._await_env(attempt, self.wait_s)

    def _await_env(self, attempt: int, wait_s: float | None) -> None:
        env = json.loads(self._get(env_key(attempt, self.worker), wait_s))
        os.environ.update({str(k): str(v) for k, v in env.items()})
        self.attempt_start_ts = time.time()

    def _get(self, key: str, wait_s: float | None) -> str:
        """Until the launcher sets ``key``; a spare waits without limit (the launcher ends
        it), a survivor at most ``wait_s``. Polled with ``check`` (a store's blocking wait
        logs a warning at every timeout); a lost launcher raises (its store is gone)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not self.store.check([key]):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the launcher set no {key} within {wait_s:g} s")
            time.sleep(POLL_S)
        return bytes(self.store.get(key)).decode()


def _warm_up() -> None:
    """What a rank's first DistributedDataParallel costs a new process, paid before it is
    needed: its construction imports some 900 modules lazily (torch._dynamo, sympy...),
    ~1-2 s here against ~5 ms the second time. A throwaway DDP on a one-process gloo
    world does it; the RNG is left as it was (a Linear's init draws from it)."""
    import torch
    from torch import nn

    if dist.is_initialized():
        return
    try:
        with torch.random.fork_rng(devices=[]):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
            finally:
                dist.destroy_process_group()
    except Exception:  # a warm-up, never a reason not to be a spare
        log.exception("trainguard: the warm spare's DDP warm-up failed")


def _release_frames(error: BaseException) -> None:
    """Clear the frames of every traceback in `error`'s chain (their locals are the ended
    attempt's model, optimizer, DDP...) and drop the tracebacks."""
    for link in list(chain(error)):
        if link.__traceback__ is not None:
            traceback.clear_frames(link.__traceback__)
            link.__traceback__ = None


def _forget_process_groups() -> list[Any]:
    """torch.distributed forgets every process group, as ``destroy_process_group()`` does
    after shutting them down, without the shutdown: a gloo group with an operation pending
    on a peer that is gone (or that moved on without closing its connections: a DDP
    reducer keeps its group alive) would block it until gloo's timeout. Returns the groups,
    which the caller keeps (their connections close when the process ends). Private torch
    API, pinned with torch (pyproject.toml)."""
    c10d = dist.distributed_c10d
    world = c10d._world
    groups = list(world.pg_names)
    c10d._update_default_pg(None)
    tables = (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag)
    for table in (*tables, world.tags_to_pg, world.pg_coalesce_state, world.pg_flight_recorder_hooks):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    return groups


def wait(work: Any) -> None:
    """``work.wait()`` for trainguard's own collectives (the DDP gradient hook, the ranks'
    agreement): under in-process restart it gives up with :class:`AttemptAborted` when the
    launcher ends the attempt, since a gloo collective cannot be aborted and a peer that
    moved on may keep its connection open (this rank would wait for gloo's timeout)."""
    restartable = _current
    if restartable is None or dist.get_backend() == "nccl":  # NCCL: the abort makes it raise
        work.wait()
        return
    while True:
        started = time.monotonic()
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError as exc:
            if time.monotonic() - started < WAIT_SLICE.total_seconds() / 2:
                raise  # the operation failed (a peer's error, gloo's own timeout), not our slice
            if restartable.aborting.is_set():
                raise AttemptAborted(
                    f"attempt {restartable.attempt} was ended by the launcher while this rank waited "
                    "in a collective (a peer lost or stuck)"
                ) from exc


class _AbortWatch:
    """A thread that notes the launcher's ``abort/<attempt>`` (a peer lost or stuck): the
    collectives waiting in :func:`wait` give up; NCCL's communicators are aborted, so that
    any collective raises. Gloo's cannot be aborted (NOTES.md): a rank stuck in a gloo
    collective outside :func:`wait` waits until its peers' connections close."""

    def __init__(self, store: Any, aborting: threading.Event, resizing: threading.Event) -> None:
        self.store = store
        self.aborting = aborting
        self.resizing = resizing
        #: Monotonic deadline of the planned leave asked for (None: none asked this attempt):
        #: the earliest of the deadlines the key's values named (a drain may tighten a grow's).
        self.resize_by: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, attempt: int) -> None:
        self.resize_by = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(attempt, self._stop), name="trainguard-abort-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, attempt: int, stop: threading.Event) -> None:
        key, resize = abort_key(attempt), resize_key(attempt)
        while not stop.wait(0.1):
            try:
                if self.store.check([resize]):
                    self._note_resize(bytes(self.store.get(resize)).decode())
                if not self.store.check([key]):
                    continue
            except Exception:
                return  # the launcher is gone: its teardown ends this process
            self.aborting.set()
            if dist.is_initialized() and dist.get_backend() == "nccl":
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    log.warning("trainguard: aborting attempt %d's NCCL communicators", attempt)
                    abort()
            return

    def _note_resize(self, value: str) -> None:
        """The launcher asked for a planned leave: its deadline from now, the earliest one
        kept (the value is read again at every poll: a drain may come after a grow)."""
        by = time.monotonic() + resize_within(value)
        if self.resize_by is None or by < self.resize_by:
            self.resize_by = by
        self.resizing.set()


_current: Restartable | None = None


def current() -> Restartable | None:
    """The in-process restart this process runs under (None: a plain process)."""
    return _current


def run(main: Callable[[], T]) -> T:
    """Call ``main()``; under ``trainguard launch --restart in-process``, again after each
    fault the process survives (module docstring)."""
    global _current
    address, worker = os.environ.get(ENV_STORE, ""), os.environ.get(ENV_WORKER, "")
    if not address or not worker:
        return main()
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    _current = Restartable(store, worker, float(os.environ.get(ENV_WAIT_S, "300")))
    try:
        return _current.run(main)
    finally:
        _current = None
        sys.stdout.flush()
