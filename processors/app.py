"""The live driver: a faust-streaming worker that folds telemetry into the core.

Delivery is at-least-once and processing idempotent (docs/architecture.md): the core drops
redelivered events by event_id, and every output has an id derived from its cause,
so a re-made decision dedupes downstream. An offset is only acknowledged to faust
after the outputs it caused are delivered (we await each send's delivery future);
faust commits acknowledged offsets. faust's exactly_once mode is deliberately not used.

Bad input never stops the stream: rejected records go to the dead-letter topic with
`reason`, `detail` and `source` headers and their original bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import faust
from faust.types import TP, RecordMetadata

from ..kafka.acl import PROCESSOR_APP
from ..kafka.lag_metrics import ConsumerLagCollector
from ..kafka.security import KafkaCredentials, resolve
from ..kafka.topics import TopicNames, ensure_run_commands_topic, partition_count, topic_names
from ..schemas import Command, Envelope, Tick, encode
from ..schemas.sharding import telemetry_key, telemetry_partition
from . import api_web, eager_delivery, faust_monitor
from .api import ApiContext, RunsView
from .core import CorePolicy
from .driver import CoreDriver, DriverResult
from .metrics import ProcessorMetrics
from .partitions import Action, Held, PartitionBook
from .recovery import recover_partition
from .snapshot import Snapshot, freeze, seal, snapshot_key

log = logging.getLogger("trainguard.processor")


@dataclass(frozen=True)
class ProcessorSettings:
    bootstrap: str
    master_secret: bytes
    topic_prefix: str = ""
    app_id: str = PROCESSOR_APP
    policy: CorePolicy = CorePolicy()
    metrics_port: int | None = 9464
    metrics_addr: str = "127.0.0.1"
    metrics_refresh_s: float = 1.0
    #: Ticks are written only while a run waits for a hang's stack dumps; a run none answers
    #: opens its collection window at the first tick after the abort (core/detectors/stack_window.py).
    tick_interval_s: float = 1.0
    #: How often a partition's state is snapshotted (processors/snapshot.py); 0: never, a
    #: worker that takes a partition over then folds its whole retained log.
    snapshot_interval_s: float = 30.0
    #: How often faust commits the offsets of processed records. A crash redoes at most
    #: this much; the outputs already published are then recognised and not repeated.
    commit_interval_s: float = 1.0
    #: A worker silent this long leaves the group and its partitions move to the others.
    session_timeout_s: float = 15.0
    #: Static group membership (KIP-345): a worker restarted under the same id within the
    #: session timeout gets its partitions back without a rebalance. None: dynamic member.
    instance_id: str | None = None
    #: The run API (processors/api.py) on this port; None: off. It needs `api_token`.
    api_port: int | None = None
    api_host: str = "127.0.0.1"
    api_token: str | None = field(default=None, repr=False)
    #: SASL principal on a secured broker (trainguard/kafka/acl.py); None: from the environment.
    credentials: KafkaCredentials | None = None

    @property
    def topics(self) -> TopicNames:
        return topic_names(self.topic_prefix)


def _datadir() -> str:
    """faust's worker directory (no table lives there: the store is memory://), under
    $TRAINGUARD_HOME (else ./.trainguard) rather than in the working directory."""
    parent = os.path.join(os.environ.get("TRAINGUARD_HOME") or ".trainguard", "processor")
    os.makedirs(parent, exist_ok=True)  # faust creates only the last level
    return os.path.join(parent, "{conf.id}-data")


def create_app(settings: ProcessorSettings) -> tuple[faust.App, CoreDriver, ProcessorMetrics]:
    credentials = resolve(settings.credentials)
    app = faust.App(
        f"{settings.topic_prefix}{settings.app_id}",
        broker=f"kafka://{settings.bootstrap}",
        broker_credentials=credentials.faust() if credentials is not None else None,
        store="memory://",
        datadir=_datadir(),
        **api_web.web_options(settings.api_port, settings.api_host),
        topic_replication_factor=1,
        topic_allow_declare=False,  # topics are created by the project, not by faust
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        broker_commit_every=1000,
        broker_commit_interval=settings.commit_interval_s,
        broker_session_timeout=settings.session_timeout_s,
        consumer_group_instance_id=settings.instance_id,
        # A snapshot of a large run's partition is MiBs (the topic admits 64 MiB).
        producer_max_request_size=64 * 1024 * 1024,
        # A telemetry record is a node's batch (up to 8 MiB): fetch more than faust's
        # 1 MiB per partition per round trip, or one busy partition starves the worker.
        consumer_max_fetch_size=8 * 1024 * 1024,
        stream_buffer_maxsize=16384,
    )
    eager_delivery.install(app)  # before the first topic: a record reaches its stream without tasks
    faust_monitor.drop(app)  # faust's own per-record statistics: nothing reads them
    names = settings.topics

    def raw_topic(name: str) -> faust.TopicT:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    telemetry, events, commands, deadletter, snapshots = map(
        raw_topic, (names.telemetry, names.events, names.commands, names.deadletter, names.snapshots)
    )

    driver = CoreDriver(settings.policy, settings.master_secret)
    metrics = ProcessorMetrics()
    # The API's projection of the outputs, folded with the core in the same step.
    view = RunsView() if settings.api_port is not None else None
    # Records this worker writes into the telemetry log (ticks, forwards) go to the run's
    # shard-0 partition, computed as the shippers compute it (schemas/sharding.py).
    partitions = partition_count(settings.bootstrap, names.telemetry, credentials=credentials)
    book = PartitionBook()
    # Snapshot partition p holds telemetry partition p's snapshots: the counts must match.
    snapshot_key_ = snapshot_key(settings.master_secret)
    if (
        settings.snapshot_interval_s > 0
        and partition_count(settings.bootstrap, names.snapshots, credentials=credentials) != partitions
    ):
        log.warning("%s and %s differ in partitions: snapshots off", names.snapshots, names.telemetry)
        settings = replace(settings, snapshot_interval_s=0.0)

    async def to_coordinator(record: Envelope) -> Awaitable[RecordMetadata]:
        return await telemetry.send(
            key=telemetry_key(record.run_id, 0),
            value=encode(record),
            partition=telemetry_partition(record.run_id, 0, 1, partitions),
        )

    # Secured broker: each command also goes to its run's own topic, the only commands topic
    # its ranks may read (trainguard/kafka/acl.py); the shared topic stays the audit log.
    run_topics: dict[str, faust.TopicT] = {}

    async def run_topic(run_id: str) -> faust.TopicT:
        topic = run_topics.get(run_id)
        if topic is None:  # first command to the run from this worker: make sure it exists
            name = names.run_commands(run_id)
            await asyncio.to_thread(
                ensure_run_commands_topic, settings.bootstrap, name, credentials=credentials
            )
            topic = run_topics[run_id] = raw_topic(name)
        return topic

    async def send_command(command: Command) -> list[Awaitable[RecordMetadata]]:
        key, value = command.run_id.encode(), encode(command)
        sent = [await commands.send(key=key, value=value)]  # the audit log first
        if credentials is not None:
            sent.append(await (await run_topic(command.run_id)).send(key=key, value=value))
        return sent

    async def publish(result: DriverResult, source: str) -> None:
        pending = []
        for rejection in result.rejections:
            headers = {
                "reason": rejection.reason.value.encode(),
                "detail": rejection.detail[:1000].encode(),
                "source": source.encode(),
            }
            pending.append(await deadletter.send(key=source.encode(), value=rejection.raw, headers=headers))
        for derived in result.derived:
            pending.append(await events.send(key=derived.run_id.encode(), value=encode(derived)))
        for command in result.commands:
            pending.extend(await send_command(command))
        for forward in result.forwards:  # a report for the run's shard 0 (maybe another worker)
            pending.append(await to_coordinator(forward))
        for future in pending:  # durable before this offset may be committed
            await future

    def drop(keys: set[str]) -> None:
        for key in keys:
            driver.state.runs.pop(key, None)

    async def recover(partition: int, offset: int) -> None:
        """Rebuild the partition's state up to `offset` (processors/recovery.py) on a
        thread, then swap it in: the loop (timers, the API) never sees it half-built."""
        recovered = await asyncio.to_thread(
            recover_partition,
            settings.bootstrap,
            names,
            partition,
            offset,
            driver,
            snapshot_key_ if settings.snapshot_interval_s > 0 else None,
        )
        held = Held(
            recovered.next_offset, set(recovered.runs), recovered.published, recovered.published_until
        )
        held.snapshot_at = time.monotonic()
        drop(book.hold(partition, held))
        driver.state.runs.update(recovered.runs)
        if view is not None:
            view.observe(recovered.derived, recovered.commands)
        metrics.recoveries.inc()
        metrics.recovery_records.inc(recovered.replayed)
        metrics.recovery_seconds.observe(recovered.seconds)
        for warning in recovered.warnings:
            log.warning("recovery of %s[%d]: %s", names.telemetry, partition, warning)
        log.info(
            "recovered %s[%d] at %d: snapshot %s, %d records folded, %d outputs published, %.2f s "
            "(snapshot %.2f s, fold %.2f s, outputs %.2f s)",
            names.telemetry,
            partition,
            offset,
            recovered.snapshot_offset,
            recovered.replayed,
            len(recovered.published),
            recovered.seconds,
            recovered.snapshot_s,
            recovered.fold_s,
            recovered.published_s,
        )

    def write_snapshot(partition: int) -> None:
        t0 = time.perf_counter()
        held = book.held[partition]
        runs = {key: driver.state.runs[key] for key in held.keys if key in driver.state.runs}
        frozen_at = held.next_offset
        frozen = freeze(Snapshot(names.telemetry, partition, frozen_at, time.time(), runs))
        held.snapshot_cost_s = time.perf_counter() - t0  # the loop's share: what the budget bounds

        async def send() -> None:  # not awaited by the agent: a lost snapshot only costs time
            try:
                value = await asyncio.to_thread(seal, frozen, snapshot_key_)
                metrics.snapshot_bytes.set(len(value))
                await (
                    await snapshots.send(
                        key=f"{names.telemetry}:{partition}".encode(), value=value, partition=partition
                    )
                )
            except Exception as exc:  # noqa: BLE001 - counted and logged; the next one may land
                metrics.snapshots.labels(outcome="failed").inc()
                log.warning("snapshot of %s[%d] not written: %s", names.telemetry, partition, exc)
            else:
                metrics.snapshots.labels(outcome="written").inc()
                log.info(
                    "snapshot of %s[%d] at %d written: %d bytes, %.3f s on the loop",
                    names.telemetry, partition, frozen_at, len(value), held.snapshot_cost_s,
                )  # fmt: skip
            finally:
                held.sending = False

        held.sending = True
        asyncio.ensure_future(send())

    async def on_revoked(sender: object, revoked: set[TP], **kwargs: object) -> None:
        """A rebalance began: suspend the revoked partitions' states until the assignment
        says whether they come back (processors/partitions.py). faust's generation is
        still the one they were held in."""
        for tp in revoked:
            if tp.topic == names.telemetry:
                book.suspend(tp.partition, app.consumer_generation_id)

    async def on_assigned(sender: object, assigned: set[TP], **kwargs: object) -> None:
        """Keep the states of the partitions given straight back; another worker may fold
        the others next (or did meanwhile): forget them, so that holding one again starts
        with a recovery rather than a stale state."""
        mine = {tp.partition for tp in assigned if tp.topic == names.telemetry}
        suspended, kept = set(book.suspended), book.kept
        drop(book.reassigned(mine, app.consumer_generation_id))
        if suspended:
            log.info(
                "generation %d: kept %d of %d revoked partitions of %s without a recovery",
                app.consumer_generation_id, book.kept - kept, len(suspended), names.telemetry,
            )  # fmt: skip

    app.on_partitions_revoked.connect(cast(Any, on_revoked))
    app.on_partitions_assigned.connect(cast(Any, on_assigned))

    async def until_done(attempt: Callable[[], Awaitable[None]], what: str) -> None:
        """Retry until it succeeds: faust acks a record even when the agent raises, so a
        failure that escaped would commit a record whose outputs were never delivered.
        Retrying holds the stream (backpressure) until the broker answers again; a
        retried publish may repeat outputs, with their ids, which consumers dedupe."""
        delay = 0.5
        while True:
            try:
                await attempt()
                return
            except Exception as exc:  # noqa: BLE001 - logged, counted, retried
                metrics.retries.inc()
                log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    @app.agent(telemetry)
    async def process(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            message = event.message
            value = event.value if isinstance(event.value, bytes) else b""
            partition, offset = message.partition, message.offset
            action = book.action(partition, offset)
            if action is Action.RECOVER:
                await until_done(partial(recover, partition, offset), f"recovery of partition {partition}")
                action = book.action(partition, offset)
            if action is Action.SKIP:  # folded already, its outputs delivered
                metrics.redelivered_records.inc()
                continue
            source = f"{message.topic}:{partition}:{offset}"
            result = driver.handle(value)
            book.folded(partition, offset, result.state_key)
            suppressed = book.suppressed
            result = book.unpublished(partition, result, source)
            metrics.suppressed_outputs.inc(book.suppressed - suppressed)
            if view is not None:
                view.observe(result.derived, result.commands)
            metrics.observe(result)
            if result.rejections or result.derived or result.commands or result.forwards:
                await until_done(partial(publish, result, source), f"outputs of {source}")
            if settings.snapshot_interval_s > 0 and book.snapshot_due(
                partition, time.monotonic(), settings.snapshot_interval_s
            ):
                write_snapshot(partition)
            # Kafka's CreateTime of the record -> processed, its outputs delivered.
            latency = max(0.0, time.time() - message.timestamp)
            metrics.record_latency.observe(latency)
            if result.derived or result.commands:
                metrics.decision_latency.observe(latency)
            for derived in result.derived:
                log.info("%s %s: %s", derived.KIND, derived.run_id, derived.reason.text)

    ticks = itertools.count()
    worker_id = uuid.uuid4().hex[:12]

    @app.timer(interval=settings.tick_interval_s)
    async def tick() -> None:
        """Time must pass for a run that has gone silent (e.g. waiting for the stack
        dumps of ranks that will never answer). The tick is written INTO the telemetry
        log, so the core sees it in order and a replay sees the same ticks."""
        suspended = book.suspended_keys()  # a rebalance is under way: their holder is open
        for key, run in list(driver.state.runs.items()):
            if run.pending_hang is None or key in suspended:  # only a coordinator waits for stacks
                continue
            event = Tick(
                event_id=f"tick-{worker_id}-{next(ticks)}",
                run_id=run.run_id,
                attempt=run.attempt,
                rank=-1,
                node="",
                step=run.job_step,
                ts=time.time(),
            )
            await to_coordinator(event)

    @app.timer(interval=settings.metrics_refresh_s)
    async def refresh_metrics() -> None:
        metrics.refresh(driver.state, time.monotonic())

    if view is not None:

        async def publish_command(command: Command) -> None:
            for future in await send_command(command):
                await future

        token = settings.api_token or ""  # mount refuses an empty or short one
        api_web.mount(
            app,
            ApiContext(driver.state, view, settings.policy, token, settings.master_secret),
            publish_command,
        )

    return app, driver, metrics


def run_worker(settings: ProcessorSettings, loglevel: str = "warning") -> None:
    """Run the processor until SIGINT/SIGTERM (blocks)."""
    app, _, metrics = create_app(settings)
    if settings.metrics_port is not None:
        # The lag of this worker's group on the telemetry topic (processors falling behind).
        group, telemetry = f"{settings.topic_prefix}{settings.app_id}", settings.topics.telemetry
        credentials = resolve(settings.credentials)
        ConsumerLagCollector(
            settings.bootstrap, group, [telemetry], "processor", credentials=credentials
        ).start(metrics.registry)
        metrics.serve(settings.metrics_port, settings.metrics_addr)
    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
