"""The live driver: a faust-streaming worker that folds telemetry into the core.

Delivery is at-least-once and processing idempotent (ARCHITECTURE.md): the core drops
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
from collections.abc import Awaitable
from dataclasses import dataclass, field

import faust
from faust.types import RecordMetadata

from ..broker.topics import TopicNames, partition_count, topic_names
from ..schemas import Command, Envelope, Tick, encode
from ..schemas.sharding import telemetry_key, telemetry_partition
from ..sinks.metrics import ProcessorMetrics
from . import api_web
from .api import ApiContext, RunsView
from .core import CorePolicy
from .driver import CoreDriver, DriverResult

log = logging.getLogger("trainguard.processor")


@dataclass(frozen=True)
class ProcessorSettings:
    bootstrap: str
    master_secret: bytes
    topic_prefix: str = ""
    app_id: str = "trainguard-processor"
    policy: CorePolicy = CorePolicy()
    metrics_port: int | None = 9464
    metrics_addr: str = "127.0.0.1"
    metrics_refresh_s: float = 1.0
    tick_interval_s: float = 5.0
    #: The run API (processors/api.py) on this port; None: off. It needs `api_token`.
    api_port: int | None = None
    api_host: str = "127.0.0.1"
    api_token: str | None = field(default=None, repr=False)

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
    app = faust.App(
        f"{settings.topic_prefix}{settings.app_id}",
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        datadir=_datadir(),
        **api_web.web_options(settings.api_port, settings.api_host),
        topic_replication_factor=1,
        topic_allow_declare=False,  # topics are created by the project, not by faust
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        broker_commit_every=1000,
        broker_commit_interval=1.0,
        # A telemetry record is a node's batch (up to 8 MiB): fetch more than faust's
        # 1 MiB per partition per round trip, or one busy partition starves the worker.
        consumer_max_fetch_size=8 * 1024 * 1024,
        stream_buffer_maxsize=16384,
    )
    names = settings.topics

    def raw_topic(name: str) -> faust.TopicT:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    telemetry, events, commands, deadletter = map(
        raw_topic, (names.telemetry, names.events, names.commands, names.deadletter)
    )

    driver = CoreDriver(settings.policy, settings.master_secret)
    metrics = ProcessorMetrics()
    # The API's projection of the outputs, folded with the core in the same step.
    view = RunsView() if settings.api_port is not None else None
    # Records this worker writes into the telemetry log (ticks, forwards) go to the run's
    # shard-0 partition, computed as the shippers compute it (schemas/sharding.py).
    partitions = partition_count(settings.bootstrap, names.telemetry)

    async def to_coordinator(record: Envelope) -> Awaitable[RecordMetadata]:
        return await telemetry.send(
            key=telemetry_key(record.run_id, 0),
            value=encode(record),
            partition=telemetry_partition(record.run_id, 0, 1, partitions),
        )

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
            pending.append(await commands.send(key=command.run_id.encode(), value=encode(command)))
        for forward in result.forwards:  # a report for the run's shard 0 (maybe another worker)
            pending.append(await to_coordinator(forward))
        for future in pending:  # durable before this offset may be committed
            await future

    @app.agent(telemetry)
    async def process(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            message = event.message
            value = event.value if isinstance(event.value, bytes) else b""
            result = driver.handle(value)
            if view is not None:
                view.observe(result.derived, result.commands)
            metrics.observe(result)
            if result.rejections or result.derived or result.commands or result.forwards:
                await publish(result, f"{message.topic}:{message.partition}:{message.offset}")
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
        for run in list(driver.state.runs.values()):
            if run.pending_hang is None:  # only a coordinator (shard 0) waits for stacks
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
        metrics.refresh(driver.state)

    if view is not None:

        async def publish_command(command: Command) -> None:
            await (await commands.send(key=command.run_id.encode(), value=encode(command)))

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
        metrics.serve(settings.metrics_port, settings.metrics_addr)
    asyncio.set_event_loop(asyncio.new_event_loop())
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
