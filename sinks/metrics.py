"""Prometheus metrics for the processors.

Naming follows Prometheus conventions (units in names, `_total` counters). Label
cardinality is bounded: no per-rank or per-node label; the slowest rank is a gauge
*value*. Per-run gauges carry `run_id` only while the run is live in this worker.
Gauges are refreshed from the core's state by the driver's event loop (a snapshot),
never read from it by the scrape thread, so a scrape cannot race the core.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..processors.core import CoreState, RunPhase, goodput, step_time_summary
from ..processors.driver import DriverResult
from ..schemas import Interruption


class ProcessorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, keep_finished: int = 20) -> None:
        self.registry = registry or CollectorRegistry()
        self.keep_finished = keep_finished
        r = self.registry
        self.events = Counter(
            "trainguard_events_processed_total", "Telemetry events folded into the core.", registry=r
        )
        self.duplicates = Counter(
            "trainguard_duplicate_events_total", "Redelivered events dropped by event_id.", registry=r
        )
        self.dead_letters = Counter(
            "trainguard_dead_letters_total", "Records sent to the dead-letter topic.", ["reason"], registry=r
        )
        self.interruptions = Counter(
            "trainguard_interruptions_total", "Interruptions declared, by cause.", ["cause"], registry=r
        )
        self.commands = Counter(
            "trainguard_commands_total", "Commands published, by kind.", ["kind"], registry=r
        )
        self.decision_latency = Histogram(
            "trainguard_decision_latency_seconds",
            "From the producer's timestamp of the telemetry record that caused a decision to the "
            "decision's delivery to Kafka.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.record_latency = Histogram(
            "trainguard_record_latency_seconds",
            "From the producer's timestamp of a telemetry record to the end of its processing, "
            "outputs delivered.",
            # Fine, so that a benchmark can read p50/p99 off them (bench/bench_live.py).
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)
            + (1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
            registry=r,
        )
        self.goodput = Gauge(
            "trainguard_goodput_ratio", "Useful step time over elapsed time.", ["run_id"], registry=r
        )
        self.step_p50 = Gauge(
            "trainguard_step_time_p50_seconds", "Median total step time over ranks.", ["run_id"], registry=r
        )
        self.step_max = Gauge(
            "trainguard_step_time_max_seconds", "Slowest total step time over ranks.", ["run_id"], registry=r
        )
        self.slowest_rank = Gauge(
            "trainguard_slowest_rank",
            "Rank with the longest pre-collective compute time.",
            ["run_id"],
            registry=r,
        )
        self._counted: set[str] = set()
        self._labelled: set[str] = set()

    def observe(self, result: DriverResult) -> None:
        self.events.inc(result.events - result.duplicates)
        self.duplicates.inc(result.duplicates)
        for rejection in result.rejections:
            self.dead_letters.labels(reason=rejection.reason.value).inc()
        for command in result.commands:
            self.commands.labels(kind=command.KIND).inc()
        for derived in result.derived:
            # Re-processing after a restart re-derives the same id: count it once.
            if isinstance(derived, Interruption) and derived.interruption_id not in self._counted:
                self._counted.add(derived.interruption_id)
                self.interruptions.labels(cause=derived.cause.value).inc()

    def refresh(self, state: CoreState) -> None:
        # Every run still training, plus the most recent finished ones: bounded labels.
        # A sharded run is shown by its coordinator (shard 0, keyed by the bare run id).
        runs = {run_id: run for run_id, run in state.runs.items() if run.coordinator}
        finished = sorted((r.last_ts, run_id) for run_id, r in runs.items() if r.phase == RunPhase.FINISHED)
        live = {run_id for run_id, run in runs.items() if run.phase != RunPhase.FINISHED}
        live |= {run_id for _, run_id in finished[-self.keep_finished :]}
        for gone in self._labelled - live:
            for gauge in (self.goodput, self.step_p50, self.step_max, self.slowest_rank):
                gauge.remove(gone)
        for run_id in live:
            run = state.runs[run_id]
            p50, worst, slowest = step_time_summary(run)
            self.goodput.labels(run_id=run_id).set(goodput(run))
            self.step_p50.labels(run_id=run_id).set(p50)
            self.step_max.labels(run_id=run_id).set(worst)
            self.slowest_rank.labels(run_id=run_id).set(slowest)
        self._labelled = live

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
