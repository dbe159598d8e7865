"""Prometheus metrics of the archive writer (`trainguard archive --metrics-port`): what it
stored, when it last committed a batch, what failed, and (with trainguard/kafka/
lag_metrics.py) how far behind the topics it is, so that "archive down" and "archive
stalled" can alert (sinks/prometheus/trainguard.rules.yml)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ..processors.metrics import with_runtime
from .archive_schema import KEYS

#: What can fail, by stage: a batch's write to the lake, the offset commit after it, and
#: the maintenance pass (compaction, retention, vacuum).
ERROR_STAGES = ("write", "offset_commit", "maintenance")


class ArchiveMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.rows = Counter(
            "trainguard_archive_rows_total",
            "Rows stored, by table (before the views' dedup).",
            ["table"],
            registry=r,
        )
        self.records = Counter(
            "trainguard_archive_records_total", "Kafka records consumed and stored.", registry=r
        )
        self.batches = Counter(
            "trainguard_archive_batches_total", "Batches committed (their marks).", registry=r
        )
        self.last_commit = Gauge(
            "trainguard_archive_last_commit_timestamp_seconds",
            "When the newest batch was committed (0: none since the writer started).",
            registry=r,
        )
        self.errors = Counter(
            "trainguard_archive_errors_total", "Failures, by stage (each is retried).", ["stage"], registry=r
        )
        self.maintenance_seconds = Counter(
            "trainguard_archive_maintenance_seconds_total",
            "Time spent compacting, dropping, vacuuming.",
            registry=r,
        )
        for table in KEYS:  # every labelled counter starts at 0
            self.rows.labels(table=table)
        for stage in ERROR_STAGES:
            self.errors.labels(stage=stage)
        with_runtime(r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
