"""Executes signed commands on the rank side and acknowledges each one.

Two layers. :class:`~.gate.CommandGate` (gate.py) is pure (no broker, no threads): it turns the raw
bytes of one record from the commands topic into a decision — ignore (another run),
refuse (undecodable, bad signature, wrong attempt) or, per targeted local rank,
EXECUTE or DUPLICATE — and remembers which command ids each rank has executed, in
memory (bounded) and optionally in an append-only journal so that a restarted
actuator does not execute a command twice. :class:`Actuator` drives a gate from a
Kafka consumer thread, runs the registered handlers and produces one
:class:`~trainguard.schemas.Ack` per (command, rank).

Delivery semantics. Kafka delivers commands at least once; the gate makes execution
at most once per rank: a command id is recorded as executed (journal written and
fsynced) BEFORE its handler runs, so a crash between the two loses that execution
rather than repeating it. The consumer's offset is committed only after the handler
ran and its acks are delivered, so a crash anywhere before that redelivers the
command and the gate answers DUPLICATE (with an ack) instead of running it again.

Handlers run on the actuator's thread, never on the training thread, and must not
block for long: a handler that has to act on the training loop (checkpoint now,
skip the update, abort) should only set a flag or enqueue a request that the loop
reads between steps, and return a short detail string for the ack.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from ...kafka.security import KafkaCredentials, client_config, resolve
from ...kafka.topics import actuator_group_prefix, run_commands_topic
from ...schemas import RUN_LEVEL_RANK, Ack, AckStatus, Command, encode
from .gate import _MAX_DETAIL, C, CommandGate, GateCounters, GateOutcome, GateVerdict

log = logging.getLogger(__name__)

#: handler(command, rank) -> detail for the ack (None: no detail). Raising -> FAILED ack.
Handler = Callable[[Any, int], str | None]


# --------------------------------------------------------------------------- Kafka driver


def _default_instance(node: str, ranks: list[int]) -> str:
    digest = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:10]
    return f"{node or 'local'}-{digest}"


#: librdkafka settings for the ack producer: idempotent, so its retries add no duplicates.
ACK_PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "message.timeout.ms": 30_000,
}


@dataclass
class ActuatorStats:
    records: int = 0  # records read from the commands topic
    failed: int = 0  # (command, rank) pairs whose handler raised or had no handler
    acks_delivered: int = 0
    ack_retries: int = 0  # ack delivery rounds that had to be repeated
    commit_errors: int = 0


class Actuator:
    """Consumes the commands topic for one run and executes commands on a set of local
    ranks (a node's ranks, or the simulator's whole cluster).

    Each actuator instance assigns itself every partition of the topic (every instance must
    see every command, and a run's commands all sit on one) and stores its offsets in a
    group of its own, ``trainguard-actuator-{run_id}-{instance}``, which it never joins
    as a member, so a restart reads its commands at once (see :meth:`_assign`). The
    default instance name is derived from the node and the local ranks: stable across a
    restart, so that a restarted actuator resumes from its committed offset, and distinct
    for each process of a node. Give a `journal_path` too, or a restart forgets what was
    executed. A brand-new group starts at the END of the topic (`offset_reset="latest"`), because
    the commands already there were meant for processes that came before it; with
    `start_ts` (epoch seconds: a rank gives its process start), at the first command
    produced at or after it instead, so that a command of this attempt sent while the
    actuator was still being assigned (a rank on a spare node: a group of its own) is not
    skipped; an older attempt's command in that span is refused by the gate. Its start
    position is resolved and committed as soon as partitions are assigned, so
    :meth:`wait_ready` returning True means no later command can be skipped.

    On a secured broker (`credentials`, else TRAINGUARD_KAFKA_* in the environment) the
    rank principal may read only its run's topic, so the actuator reads
    `run_commands_topic(commands_topic, run_id)` instead of the shared topic, in the group
    `trainguard-actuator.<run token>.<instance>` that its ACL names (trainguard/kafka/acl.py).
    The gate is the same: ACLs keep other principals out, the HMAC keeps forgeries out.
    """

    def __init__(
        self,
        bootstrap: str,
        commands_topic: str,
        acks_topic: str,
        run_id: str,
        attempt: int,
        local_ranks: Iterable[int],
        key: bytes,
        node: str = "",
        instance: str | None = None,
        journal_path: Path | str | None = None,
        offset_reset: Literal["latest", "earliest"] = "latest",
        consumer_config: dict[str, Any] | None = None,
        producer_config: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        credentials: KafkaCredentials | None = None,
        start_ts: float | None = None,
        executes: Collection[type[Command]] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.start_ts = start_ts
        self.credentials = resolve(credentials)
        secured = self.credentials is not None
        self.commands_topic = run_commands_topic(commands_topic, run_id) if secured else commands_topic
        self.acks_topic = acks_topic
        self.run_id = run_id
        self.node = node
        ranks = sorted(set(local_ranks))
        self.instance = instance or _default_instance(node, ranks)
        if secured:
            self.group_id = actuator_group_prefix(run_id) + self.instance
        else:
            self.group_id = f"trainguard-actuator-{run_id}-{self.instance}"
        self.offset_reset = offset_reset
        #: How long the first assignment retries before it logs an error (it keeps trying).
        self.assign_timeout_s = 60.0
        #: How often the topic's partition count is re-read (partitions added while running).
        self.partition_refresh_s = 30.0
        # `executes`: the kinds this actuator's role executes (command_roles.kinds_of); a
        # command of another kind is not for it (the launcher's, at every rank): no ack.
        self.gate = CommandGate(run_id, attempt, ranks, key, journal_path, executes=executes)
        self.stats = ActuatorStats()
        self.clock = clock
        self._handlers: dict[type[Command], Handler] = {}
        consumer_defaults = {
            "bootstrap.servers": bootstrap,
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": offset_reset,
            **(consumer_config or {}),
        }
        self._consumer_config = client_config(consumer_defaults, self.credentials)
        self._producer = Producer(
            client_config(
                {**ACK_PRODUCER_DEFAULTS, **(producer_config or {}), "bootstrap.servers": bootstrap},
                self.credentials,
            )
        )
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set when the consumer thread died on an unexpected error (see :attr:`running`).
        self.error: Exception | None = None

    # ------------------------------------------------------------------ API
    @property
    def counters(self) -> GateCounters:
        return self.gate.counters

    def register(self, kind: type[C], handler: Callable[[C, int], str | None]) -> None:
        """Run `handler(command, rank)` for each targeted local rank of each `kind` command.
        It runs on the actuator thread: set flags for the training loop, do not block."""
        self._handlers[kind] = handler

    def set_attempt(self, attempt: int) -> None:
        """The job restarted: refuse commands of other attempts from now on."""
        self.gate.set_attempt(attempt)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Actuator:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"trainguard-actuator-{self.instance}")
            self._thread.daemon = True
            self._thread.start()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """True once the commands topic is assigned and the start offset is fixed."""
        return self._ready.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._producer.flush(min(timeout_s, 5.0))
        self.gate.close()

    def __enter__(self) -> Actuator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            consumer = Consumer(self._consumer_config)
            assigned = self._assign(consumer, set())
            next_refresh = time.monotonic() + self.partition_refresh_s
            while not self._stop.is_set():
                if time.monotonic() >= next_refresh:
                    assigned = self._assign(consumer, assigned)
                    next_refresh = time.monotonic() + self.partition_refresh_s
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error() is not None:
                    log.warning("actuator %s: consumer error %s", self.instance, msg.error())
                    continue
                self.stats.records += 1
                acks = self._handle(msg.value() or b"")
                if not self._deliver(acks):
                    return  # stopping with acks undelivered: no commit, the command comes back
                try:
                    consumer.commit(message=msg, asynchronous=False)
                except KafkaException as exc:  # a later commit covers this offset too
                    self.stats.commit_errors += 1
                    log.warning("actuator %s: commit failed: %s", self.instance, exc)
        except Exception as exc:
            # E.g. the journal cannot be written: executing without it could repeat commands
            # after a restart, so the actuator stops (fails closed) and says why.
            self.error = exc
            log.exception("actuator %s stopped on an unexpected error", self.instance)
        finally:
            if consumer is not None:
                consumer.close()

    def _assign(self, consumer: Consumer, assigned: set[int]) -> set[int]:
        """Assign the commands topic's partitions not assigned yet, each from its fixed start
        offset (committed, else end or beginning), and commit the fresh ones, so that
        neither this run nor a restart can skip a command produced after ready.

        Why not `subscribe`: the group has this one instance as its only member, and a
        restarted rank's new member could join only once the dead one's session expired and
        the group rebalanced (45-250 s seen), during which no command reached the rank. With
        its own assignment the group is only where offsets are stored: a restart reads its
        commands at once. Until the topic exists this keeps retrying (ready stays unset);
        the first call returns only once it is assigned or the actuator is stopping."""
        warned = False
        deadline = time.monotonic() + self.assign_timeout_s
        # A partition added while running holds only commands newer than this actuator:
        # read it from its beginning rather than from its end.
        reset = self.offset_reset if not assigned else "earliest"
        while not self._stop.is_set():
            try:
                partitions = self._partitions(consumer) - assigned
                if not partitions:  # a refresh that found no new partition
                    return assigned
                positions, fresh = self._start_positions(
                    consumer, [TopicPartition(self.commands_topic, p) for p in sorted(partitions)], reset
                )
            except KafkaException as exc:  # topic not created yet, leader unknown, broker down
                if not assigned and not warned and time.monotonic() >= deadline:
                    log.error("actuator %s: cannot assign %s yet (%s); still trying",
                              self.instance, self.commands_topic, exc)  # fmt: skip
                    warned = True
                if assigned:  # a failed refresh retries at the next one
                    return assigned
                self._stop.wait(0.5)
                continue
            consumer.incremental_assign(positions)
            if fresh:
                try:
                    consumer.commit(offsets=fresh, asynchronous=False)
                except KafkaException as exc:
                    self.stats.commit_errors += 1
                    log.warning("actuator %s: cannot commit start offsets: %s", self.instance, exc)
            self._ready.set()
            return assigned | partitions
        return assigned

    def _partitions(self, consumer: Consumer) -> set[int]:
        """The commands topic's partitions; raises while the topic does not exist."""
        metadata = consumer.list_topics(self.commands_topic, timeout=10).topics.get(self.commands_topic)
        if metadata is not None and metadata.error is not None:
            raise KafkaException(metadata.error)
        if metadata is None or not metadata.partitions:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC))
        return set(metadata.partitions)

    def _start_positions(
        self, consumer: Consumer, partitions: list[TopicPartition], reset: Literal["latest", "earliest"]
    ) -> tuple[list[TopicPartition], list[TopicPartition]]:
        """All partitions with their start offsets, and those of them that had no commit."""
        positions = consumer.committed(partitions, timeout=10)
        fresh = []
        for tp in positions:
            if tp.error is not None:
                raise KafkaException(tp.error)
            if tp.offset < 0:
                if reset == "latest":
                    _, tp.offset = consumer.get_watermark_offsets(
                        TopicPartition(tp.topic, tp.partition), timeout=10, cached=False
                    )
                    if self.start_ts is not None:  # the first command since start_ts, if any
                        since = TopicPartition(tp.topic, tp.partition, int(self.start_ts * 1000))
                        (found,) = consumer.offsets_for_times([since], timeout=10)
                        if found.error is None and 0 <= found.offset < tp.offset:
                            tp.offset = found.offset
                    fresh.append(tp)
                else:
                    tp.offset = OFFSET_BEGINNING
        return positions, fresh

    def _handle(self, raw: bytes) -> list[Ack]:
        decision = self.gate.check(raw)
        command = decision.command
        if decision.outcome is GateOutcome.OTHER_RUN:
            return []
        if decision.outcome is GateOutcome.REFUSED:
            # One ack per actuator, not per rank: a refusal concerns the command, and a
            # flood of forged commands must not turn into a flood of acks.
            if not decision.command_id:
                log.warning(
                    "actuator %s: refused an unidentifiable record: %s", self.instance, decision.detail
                )
                return []
            attempt = command.attempt if command is not None else self.gate.attempt
            return [
                self._ack(
                    decision.command_id,
                    decision.command_kind,
                    attempt,
                    RUN_LEVEL_RANK,
                    AckStatus.REFUSED,
                    f"{decision.reason}: {decision.detail}",
                )
            ]
        assert command is not None
        handler = self._handlers.get(type(command))
        acks = []
        failures: dict[str, list[int]] = {}  # one log line per distinct error, not per rank
        for rank in decision.ranks:
            if handler is None:
                self.stats.failed += 1
                status, detail = AckStatus.FAILED, f"no handler registered for {command.KIND}"
            elif self.gate.claim(command, rank) is GateVerdict.DUPLICATE:
                status, detail = AckStatus.DUPLICATE, "already executed on this rank"
            else:
                try:
                    status, detail = AckStatus.EXECUTED, handler(command, rank) or ""
                except Exception as exc:
                    self.stats.failed += 1
                    status, detail = AckStatus.FAILED, f"{type(exc).__name__}: {exc}"
                    failures.setdefault(str(exc), []).append(rank)
            acks.append(self._ack(command.command_id, command.KIND, command.attempt, rank, status, detail))
        for error, ranks in failures.items():
            shown = f"rank {ranks[0]}" if len(ranks) == 1 else f"{len(ranks)} ranks ({ranks[0]}..{ranks[-1]})"
            log.warning("actuator %s: %s on %s failed: %s", self.instance, command.KIND, shown, error)
        return acks

    def _ack(
        self, command_id: str, kind: str, attempt: int, rank: int, status: AckStatus, detail: str
    ) -> Ack:
        return Ack(
            command_id=command_id,
            command_kind=kind,
            run_id=self.run_id,
            attempt=attempt,
            rank=rank,
            node=self.node,
            status=status,
            detail=detail[:_MAX_DETAIL],
            ts=self.clock(),
        )

    def _deliver(self, acks: list[Ack]) -> bool:
        """Produce the acks and wait until all are delivered, retrying the undelivered
        ones; False only if the actuator is stopping first."""
        pending = [encode(ack) for ack in acks]
        while pending:
            failed: list[bytes] = []

            def done(err: KafkaError | None, msg: Message, failed: list[bytes] = failed) -> None:
                if err is not None:
                    failed.append(msg.value() or b"")

            for value in pending:
                self._producer.produce(
                    self.acks_topic, key=self.run_id.encode(), value=value, on_delivery=done
                )
            while self._producer.flush(1.0) > 0:
                if self._stop.is_set():
                    return False
            self.stats.acks_delivered += len(pending) - len(failed)
            if failed:
                self.stats.ack_retries += 1
                log.warning("actuator %s: %d acks not delivered, retrying", self.instance, len(failed))
                if self._stop.wait(1.0):
                    return False
            pending = failed
        return True
