"""Prometheus metrics for the processors.

Naming follows Prometheus conventions (units in names, `_total` counters). Label
cardinality is bounded: no per-rank or per-node label; the slowest rank is a gauge
*value*, the stragglers a count. Per-run gauges, and the pages counter (`run_id` and a
rule from a fixed set), carry `run_id` only while the run is live in this worker.
Gauges are refreshed from the core's state by the driver's event loop (a snapshot),
never read from it by the scrape thread, so a scrape cannot race the core.
"""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ..schemas import Interruption, InterruptionCause, InterruptionRecovered, Page, RejectReason
from ..schemas.commands import COMMAND_KINDS
from ..schemas.events import PAGE_RULES
from .core import CoreState, RunPhase, RunState, goodput, step_time_summary
from .core.detectors.sdc_state import remember
from .driver import DriverResult

#: The pages counter's `rule` label takes PAGE_RULES (schemas/events.py), with OTHER_RULE for
#: one not listed there, so a new rule still pages (sinks/prometheus/trainguard.rules.yml) and
#: the label stays bounded.
OTHER_RULE = "other"
#: Interruption and page ids remembered against double counting (a month at 16k ranks has
#: ~233 interruptions; recent ids are what a redelivery re-derives).
COUNTED_IDS = 65_536


#: The snapshots counter's outcomes.
SNAPSHOT_OUTCOMES = ("written", "failed")


def with_runtime(registry: CollectorRegistry) -> CollectorRegistry:
    """The process (CPU, memory, file descriptors), Python and GC metrics on `registry` (the
    default registry has them; a custom one has not)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def page_rule(rule: str) -> str:
    """The `rule` label of a page."""
    return rule if rule in PAGE_RULES else OTHER_RULE


def flagged_ranks(run: RunState) -> int:
    """Ranks of the current attempt flagged as stragglers; the detector keeps an older
    attempt's flags until the new attempt's first step, and those ranks may be gone."""
    return len(run.straggler.flagged) if run.straggler.attempt == run.attempt else 0


def slow_groups(run: RunState) -> int:
    """Racks and placement groups of the current attempt flagged slow as a whole (issue 14):
    only the coordinator (shard 0) holds the group findings."""
    return len(run.groups.flagged) if run.groups.attempt == run.attempt else 0


class ProcessorMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        keep_finished: int = 20,
        rank_summary_every_s: float = 5.0,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.keep_finished = keep_finished
        #: The step-time gauges (p50, max, slowest rank) pass over every rank of a run:
        #: 7-25 ms at 16,384 ranks, 9% of a saturated worker when done every second (issue
        #: 20). They are refreshed this often; the other gauges at every refresh.
        self.rank_summary_every_s = rank_summary_every_s
        self._summarised: dict[str, float] = {}
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
        self.restart_seconds = Histogram(
            "trainguard_restart_seconds",
            "Seconds from an interruption's detection to the run's first step after it (the seed's R).",
            buckets=(1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0),
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
        # run_id, so that the alert names the run to act on. Bounded like the gauges: a run has
        # series only while it has gauges (every live run plus `keep_finished` finished ones),
        # one per rule of a fixed set. They start at 0 with the run's gauges, because
        # increase() over a series born at 1 is 0: the run's first page would not alert
        # (for one paged before its first scrape the alerts read `trainguard_pages_created`).
        self.pages = Counter(
            "trainguard_pages_total",
            "Pages sent by the core (seed R5), by rule.",
            ["run_id", "rule"],
            registry=r,
        )
        self.stragglers = Gauge(
            "trainguard_stragglers",
            "Ranks of the run's current attempt flagged as stragglers, in the run's shards held "
            "by this worker.",
            ["run_id"],
            registry=r,
        )
        self.slow_groups = Gauge(
            "trainguard_slow_groups",
            "Racks and placement groups of the run's current attempt flagged slow as a whole "
            "(0 on a worker that does not hold the run's shard 0).",
            ["run_id"],
            registry=r,
        )
        self.world_size = Gauge(
            "trainguard_world_size", "Ranks in the run (0 while unknown).", ["run_id"], registry=r
        )
        # State recovery (processors/recovery.py): a partition taken over, at start, after a
        # rebalance or a crash, is rebuilt from its newest snapshot and the records after it.
        self.recoveries = Counter(
            "trainguard_recoveries_total", "Telemetry partitions whose state was recovered.", registry=r
        )
        self.recovery_records = Counter(
            "trainguard_recovery_records_total",
            "Telemetry records folded again to recover partitions (those after the snapshot).",
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "trainguard_recovery_seconds",
            "Time to recover a partition's state: snapshot load, fold, and the list of outputs.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
            registry=r,
        )
        self.redelivered_records = Counter(
            "trainguard_redelivered_records_total",
            "Telemetry records skipped: below the worker's folded offset (already processed).",
            registry=r,
        )
        self.suppressed_outputs = Counter(
            "trainguard_suppressed_outputs_total",
            "Outputs re-made after a recovery and not published again: already on their topic.",
            registry=r,
        )
        self.retries = Counter(
            "trainguard_processor_retries_total",
            "Publishes or recoveries that failed and were retried (the stream waits meanwhile).",
            registry=r,
        )
        self.snapshots = Counter(
            "trainguard_snapshots_total", "State snapshots written, by outcome.", ["outcome"], registry=r
        )
        self.snapshot_bytes = Gauge(
            "trainguard_snapshot_bytes", "Size of the last state snapshot written.", registry=r
        )
        # Every labelled counter has its series from the start, at 0: rate() and increase()
        # over a series born at 1 miss the first event (the first dead letter would not alert).
        for reason in RejectReason:
            self.dead_letters.labels(reason=reason.value)
        for cause in InterruptionCause:
            self.interruptions.labels(cause=cause.value)
        for kind in COMMAND_KINDS:
            self.commands.labels(kind=kind.KIND)
        for outcome in SNAPSHOT_OUTCOMES:
            self.snapshots.labels(outcome=outcome)
        with_runtime(r)
        self._per_run = (
            self.goodput,
            self.step_p50,
            self.step_max,
            self.slowest_rank,
            self.stragglers,
            self.slow_groups,
            self.world_size,
        )
        #: Interruption and page ids counted, the newest COUNTED_IDS: a redelivery re-derives
        #: recent ids only, and a month-long processor must not keep every id it ever saw.
        self._counted: OrderedDict[str, None] = OrderedDict()
        self._recovered: OrderedDict[str, None] = OrderedDict()  # the same, for restart seconds
        self._labelled: set[str] = set()
        #: Runs with page series (a page may come before its run's first refresh).
        self._paged_runs: set[str] = set()

    def observe(self, result: DriverResult) -> None:
        self.events.inc(result.events - result.duplicates)
        self.duplicates.inc(result.duplicates)
        for rejection in result.rejections:
            self.dead_letters.labels(reason=rejection.reason.value).inc()
        for command in result.commands:
            self.commands.labels(kind=command.KIND).inc()
        for derived in result.derived:
            # Re-processing after a restart re-derives the same id: count it once.
            if isinstance(derived, Interruption) and remember(
                self._counted, derived.interruption_id, COUNTED_IDS
            ):
                self.interruptions.labels(cause=derived.cause.value).inc()
            elif isinstance(derived, InterruptionRecovered) and remember(
                self._recovered, derived.interruption_id, COUNTED_IDS
            ):
                self.restart_seconds.observe(derived.restart_s)
            elif isinstance(derived, Page) and remember(self._counted, derived.event_id, COUNTED_IDS):
                self._page_series(derived.run_id)
                self.pages.labels(run_id=derived.run_id, rule=page_rule(derived.rule)).inc()

    def refresh(self, state: CoreState, now: float | None = None) -> None:
        """Every gauge from the core's state; `now` (a monotonic clock): the step-time
        gauges only when `rank_summary_every_s` has passed for the run (None: always)."""
        # Every run still training, plus the most recent finished ones: bounded labels.
        # A sharded run is shown by its coordinator (shard 0, keyed by the bare run id).
        runs = {run_id: run for run_id, run in state.runs.items() if run.coordinator}
        finished = sorted((r.last_ts, run_id) for run_id, r in runs.items() if r.phase == RunPhase.FINISHED)
        live = {run_id for run_id, run in runs.items() if run.phase != RunPhase.FINISHED}
        live |= {run_id for _, run_id in finished[-self.keep_finished :]}
        for gone in self._labelled - live:
            for gauge in self._per_run:
                gauge.remove(gone)
        for gone in self._paged_runs - live:
            self.pages.remove_by_labels({"run_id": gone})
        self._paged_runs &= live
        shards: dict[str, list[RunState]] = {}
        for run in state.runs.values():
            shards.setdefault(run.run_id, []).append(run)
        self._summarised = {run_id: at for run_id, at in self._summarised.items() if run_id in live}
        for run_id in live:
            run = state.runs[run_id]
            last = self._summarised.get(run_id)
            if now is None or last is None or now - last >= self.rank_summary_every_s:
                p50, worst, slowest = step_time_summary(run)
                self.step_p50.labels(run_id=run_id).set(p50)
                self.step_max.labels(run_id=run_id).set(worst)
                self.slowest_rank.labels(run_id=run_id).set(slowest)
                if now is not None:
                    self._summarised[run_id] = now
            self.goodput.labels(run_id=run_id).set(goodput(run))
            self.stragglers.labels(run_id=run_id).set(sum(map(flagged_ranks, shards[run_id])))
            self.slow_groups.labels(run_id=run_id).set(slow_groups(run))
            self.world_size.labels(run_id=run_id).set(run.world_size or 0)
            self._page_series(run_id)
        self._labelled = live

    def _page_series(self, run_id: str) -> None:
        """The run's page counters, every rule at 0 until it pages."""
        if run_id not in self._paged_runs:
            self._paged_runs.add(run_id)
            for rule in (*PAGE_RULES, OTHER_RULE):
                self.pages.labels(run_id=run_id, rule=rule)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
