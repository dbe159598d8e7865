"""The rank agent: the few calls a training loop makes to report what it is doing.

Every method builds one typed event (:mod:`trainguard.schemas`) and hands it to the
shipper's non-blocking ``submit``; a call costs a few microseconds (pydantic
validation plus a deque append) and never touches the network. Telemetry must not
hurt training, so a method never raises either: an event whose values fail
validation (a negative duration from a clock step, say) is counted in
:attr:`RankAgent.invalid`, logged once per kind, and not sent.

Heartbeats while stuck. A hang differs from a crash in that the process is alive
but makes no progress, so heartbeats must keep coming while the training thread sits
inside a collective. They are therefore not sent from the training loop but from the
shipper's background flush thread: :class:`NodeAgents` is the shipper's ``on_flush``
hook and emits one heartbeat per registered agent every ``heartbeat_interval_s``::

    beats = NodeAgents(heartbeat_interval_s=5.0)
    shipper = TelemetryShipper(config, run_id, world_size, on_flush=beats.on_flush)
    agent = beats.add(RankAgent(shipper, run_id, attempt, rank=r, node=host))

A shipper can serve several agents (the ranks of one node, or a whole simulated
cluster); one ``NodeAgents`` serves them all. (Collectives in torch release the GIL,
so the flush thread runs while the training thread waits.)
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import ValidationError

from ...schemas import (
    NO_STEP,
    CheckpointFailed,
    CheckpointRejected,
    CheckpointValidated,
    CheckpointWritten,
    CrossRankCheck,
    Envelope,
    GpuHealth,
    Heartbeat,
    RankExit,
    RingCheck,
    SdcSelfCheck,
    StepStats,
    StepTiming,
)

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """What the agent needs from a shipper (TelemetryShipper satisfies it)."""

    def submit(self, event: Envelope) -> bool: ...


class MemorySink:
    """An in-process EventSink (tests, dry runs without a broker): keeps the last `limit`
    events, thread-safe (the launcher and the Supervisor emit from several threads)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.events: deque[Envelope] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def submit(self, event: Envelope) -> bool:
        with self._lock:
            self.events.append(event)
        return True

    def of(self, kind: type[Envelope]) -> list[Any]:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]


class RankAgent:
    """Emits one rank's telemetry. Thread-safe enough for its use: the training thread
    calls the step methods, the shipper's flush thread calls :meth:`heartbeat`."""

    def __init__(
        self,
        shipper: EventSink,
        run_id: str,
        attempt: int,
        rank: int,
        node: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.shipper = shipper
        self.run_id = run_id
        self.attempt = attempt
        self.rank = rank
        self.node = node
        self.clock = clock
        #: Last completed step; heartbeats carry it (NO_STEP before the first).
        self.last_step = NO_STEP
        #: Events not sent because their values failed validation.
        self.invalid = 0
        #: What the training loop is doing now (Heartbeat.phase: forward, allreduce, optimizer,
        #: data, checkpoint; '' unknown). The loop assigns it (one attribute store, no lock:
        #: the flush thread reads whatever was last written); a hang's culprit is the rank
        #: whose phase differs from everyone waiting in the collective.
        self.phase = ""
        #: Set by :meth:`exit`; heartbeats stop after it.
        self.exited = False
        self._id_prefix = uuid.uuid4().hex
        # next() on itertools.count is atomic under the GIL: ids stay unique across threads.
        self._ids = itertools.count()
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ internals
    def _envelope(self, step: int) -> dict[str, Any]:
        return {
            "event_id": f"{self._id_prefix}-{next(self._ids)}",
            "run_id": self.run_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "node": self.node,
            "step": step,
            "ts": self.clock(),
        }

    def _emit(self, cls: type[Envelope], step: int, **fields: Any) -> bool:
        """Build and submit one event; False when it was invalid or the shipper dropped one."""
        try:
            event = cls(**self._envelope(step), **fields)
        except ValidationError as exc:
            self.invalid += 1
            if cls.KIND not in self._warned:
                self._warned.add(cls.KIND)
                log.warning("rank %d: %s event not sent (invalid values): %s", self.rank, cls.KIND, exc)
            return False
        return self.shipper.submit(event)

    # ------------------------------------------------------------------ training loop
    def step(
        self,
        step: int,
        compute_s: float,
        total_s: float,
        loss: float | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Report a completed step. `compute_s` must be measured BEFORE the gradient
        collective (it is what straggler detection compares across ranks).

        With `loss`, a StepStats event follows; `finite` covers the loss and, when it was
        measured, the grad norm."""
        self.last_step = step
        self._emit(StepTiming, step, compute_s=compute_s, total_s=total_s)
        if loss is not None:
            finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
            self._emit(StepStats, step, loss=loss, grad_norm=grad_norm, finite=finite)

    def heartbeat(self) -> None:
        """Liveness with the last completed step and the current phase; normally called by
        :class:`NodeAgents`."""
        if not self.exited:
            self._emit(Heartbeat, self.last_step, phase=self.phase)

    def gpu_health(self, **fields: Any) -> None:
        """GPU and link health (the GpuHealth fields; `present` defaults to True)."""
        fields.setdefault("present", True)
        self._emit(GpuHealth, self.last_step, **fields)

    def self_check(self, step: int, microbatch_id: str, digest_first: str, digest_second: str) -> None:
        """Result of the bitwise self-check: the same microbatch computed twice on this device."""
        self._emit(
            SdcSelfCheck,
            step,
            microbatch_id=microbatch_id,
            digest_first=digest_first,
            digest_second=digest_second,
        )

    def ring_check(
        self, step: int, check_id: str, own_value: float, peer_rank: int, peer_value: float
    ) -> None:
        """This rank's part of a ring cross-rank check: its own microbatch's value and its
        recomputation of ring neighbour `peer_rank`'s, with the weights of `step`."""
        fields = {"own_value": own_value, "peer_rank": peer_rank, "peer_value": peer_value}
        self._emit(RingCheck, step, check_id=check_id, **fields)

    def cross_rank_check(self, step: int, microbatch_id: str, ranks: list[int], values: list[float]) -> None:
        """A cross-rank check's values, one per rank in the order of `ranks`: the same
        microbatch recomputed by each with the weights of `step` (sent by ``ranks[0]``)."""
        self._emit(CrossRankCheck, step, microbatch_id=microbatch_id, ranks=ranks, values=values)

    def checkpoint_written(
        self,
        checkpoint_step: int,
        uri: str,
        shards: int,
        digest: str,
        nbytes: int,
        blocking_s: float,
        write_s: float,
    ) -> None:
        """This rank's part of a checkpoint is durable (not yet resumable)."""
        self._emit(
            CheckpointWritten,
            checkpoint_step,
            checkpoint_step=checkpoint_step,
            uri=uri,
            shards=shards,
            digest=digest,
            bytes=nbytes,
            blocking_s=blocking_s,
            write_s=write_s,
        )

    def checkpoint_validated(self, checkpoint_step: int, uri: str, last_verified_step: int) -> None:
        """The checkpoint passed validation and is resumable (R6: with its verification watermark)."""
        self._emit(
            CheckpointValidated,
            checkpoint_step,
            checkpoint_step=checkpoint_step,
            uri=uri,
            last_verified_step=last_verified_step,
        )

    def checkpoint_failed(self, checkpoint_step: int, uri: str, error: str) -> None:
        """Writing or validating the checkpoint failed (error truncated to the schema's bound)."""
        self._emit(
            CheckpointFailed, checkpoint_step, checkpoint_step=checkpoint_step, uri=uri, error=error[:4000]
        )

    def checkpoint_rejected(self, checkpoint_step: int, uri: str, error: str, resumed_from_step: int) -> None:
        """A checkpoint failed verification before resume; this attempt resumes from
        `resumed_from_step` instead (-1: none left). Not a node fault."""
        self._emit(
            CheckpointRejected,
            checkpoint_step,
            checkpoint_step=checkpoint_step,
            uri=uri,
            error=error[:4000],
            resumed_from_step=max(-1, resumed_from_step),
        )

    def exit(
        self,
        exit_code: int | None = None,
        signal: int | None = None,
        requested: bool = False,
        stack_dump_ref: str = "",
        stack_signature: str = "",
        peer_lost: bool = False,
    ) -> None:
        """The rank process is ending; heartbeats stop. Flush the shipper afterwards."""
        self.exited = True
        self._emit(
            RankExit,
            self.last_step,
            exit_code=exit_code,
            signal=signal,
            requested=requested,
            stack_dump_ref=stack_dump_ref,
            stack_signature=stack_signature,
            peer_lost=peer_lost,
        )

    @property
    def drops(self) -> int:
        """Events lost by the shipper (queue overflow plus delivery failures); shared by
        every agent on that shipper. 0 for a sink without stats."""
        stats = getattr(self.shipper, "stats", None)
        return 0 if stats is None else stats.dropped + stats.failed


class NodeAgents:
    """The agents served by one shipper, and their heartbeats.

    Pass :meth:`on_flush` as the shipper's ``on_flush`` hook: the shipper's background
    thread calls it once per flush, and it emits a heartbeat for every live agent when
    `heartbeat_interval_s` has passed since the last round. A heartbeat interval
    shorter than the shipper's flush interval is effectively the flush interval.
    """

    def __init__(
        self,
        heartbeat_interval_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self._monotonic = monotonic
        self._agents: list[RankAgent] = []
        self._lock = threading.Lock()
        self._next_beat = -math.inf

    def add(self, agent: RankAgent) -> RankAgent:
        with self._lock:
            self._agents.append(agent)
        return agent

    def remove(self, agent: RankAgent) -> None:
        with self._lock:
            self._agents.remove(agent)

    @property
    def agents(self) -> list[RankAgent]:
        with self._lock:
            return list(self._agents)

    def on_flush(self) -> None:
        """Emit a heartbeat round if one is due (never raises: it runs in the shipper's thread)."""
        now = self._monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self.heartbeat_interval_s
        for agent in self.agents:
            try:
                agent.heartbeat()
            except Exception:  # a broken agent must not kill the shipper thread
                log.exception("heartbeat of rank %d failed", agent.rank)
