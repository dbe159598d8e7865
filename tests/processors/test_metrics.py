"""The processor's Prometheus metrics for alerting: pages by rule, and the stragglers and
world size behind the straggler ratio, driven through the real driver (encoded batches
in, DriverResult out) by realistic telemetry streams, refreshed as the worker's timer does."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest

from harness.straggler_streams import HealthFault, Slow, SyncJob
from harness.streams import Job
from trainguard.processors import metrics as metrics_module
from trainguard.processors.core import CorePolicy
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy
from trainguard.processors.core.decisions.paging import page
from trainguard.processors.driver import CoreDriver, DriverResult
from trainguard.processors.metrics import OTHER_RULE, PAGE_RULES, ProcessorMetrics
from trainguard.schemas import Envelope, Interruption, Page, ReasonCode, encode, encode_batch
from trainguard.schemas.sharding import route

#: A 16-rank test job given the seed's 16,384-GPU failure rate, as in tests/processors/test_paging.py.
POLICY = CorePolicy(baseline=BaselinePolicy(reference_world_size=16))
SECRET = b"metrics-test-secret-0123456789"
#: Events per telemetry record (a node's flush holds a few hundred).
CHUNK = 256


class Worker:
    """One processor worker: the driver, its metrics, and the refresh after every record."""

    def __init__(self, policy: CorePolicy = POLICY, keep_finished: int = 20) -> None:
        self.driver = CoreDriver(policy, SECRET)
        self.metrics = ProcessorMetrics(keep_finished=keep_finished)
        self.results: list[DriverResult] = []
        self._seq = itertools.count()
        #: The worker's monotonic clock at each refresh (None: every gauge every time).
        self.now: float | None = None

    def feed(self, events: Iterable[Envelope], world_size: int, shard_ranks: int = 0) -> None:
        """Ships `events` as the rank side does: batches of one shard of one run, in order."""
        batch: list[bytes] = []
        run_id, shard = "", 0
        for event in events:
            for target in route(event, world_size, shard_ranks):
                if (event.run_id, target) != (run_id, shard) or len(batch) >= CHUNK:
                    self._send(batch, run_id, world_size, shard, shard_ranks)
                    batch, run_id, shard = [], event.run_id, target
                batch.append(encode(event))
        self._send(batch, run_id, world_size, shard, shard_ranks)

    def _send(self, records: list[bytes], run_id: str, world_size: int, shard: int, shard_ranks: int) -> None:
        if not records:
            return
        header = dict(
            run_id=run_id, node="node-000", world_size=world_size, producer_id="test",
            seq=next(self._seq), shard=shard, shard_ranks=shard_ranks,
        )  # fmt: skip
        result = self.driver.handle(encode_batch(header, records))
        assert result.rejections == []
        self.results.append(result)
        self.metrics.observe(result)
        self.metrics.refresh(self.driver.state, self.now)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def pages(self, run_id: str) -> dict[str, float | None]:
        rules = (*PAGE_RULES, OTHER_RULE)
        return {rule: self.value("trainguard_pages_total", run_id=run_id, rule=rule) for rule in rules}

    def derived_pages(self) -> list[Page]:
        return [d for result in self.results for d in result.derived if isinstance(d, Page)]


def crash_and_restart(job: Job, rank: int, then_steps: int, resume_from: int | None = None) -> None:
    job.exit(rank, exit_code=1)
    job.restart(resumed_from_step=job.step if resume_from is None else resume_from)
    job.steps(then_steps)


def test_independent_failures_at_the_normal_rate_leave_every_page_counter_at_zero() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(150)
    for rank in (3, 9, 14, 6):  # four nodes, four steps, ~3 h apart
        crash_and_restart(job, rank, 180)
    worker = Worker()
    worker.feed(job.events, job.world_size)
    assert worker.value("trainguard_interruptions_total", cause="crash") == 4
    # Every rule's series exists at 0, so that the first page shows as an increase.
    assert worker.pages(job.run_id) == dict.fromkeys((*PAGE_RULES, OTHER_RULE), 0.0)


def test_the_same_node_twice_counts_one_page_under_its_rule() -> None:
    job = Job(step_s=60.0).start().steps(150)
    for rank in (1, 2, 3):  # node-000 three times: one pattern, one page
        crash_and_restart(job, rank, 150)
    worker = Worker()
    worker.feed(job.events, job.world_size)
    assert [p.rule for p in worker.derived_pages()] == ["same_node"]
    assert worker.pages(job.run_id) == {**dict.fromkeys((*PAGE_RULES, OTHER_RULE), 0.0), "same_node": 1.0}


def test_the_same_step_failing_twice_counts_under_same_step_and_a_redelivery_counts_once() -> None:
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    crash_and_restart(job, 5, 5, resume_from=120)  # a bad batch at step 125, on any node
    crash_and_restart(job, 12, 5, resume_from=120)
    worker = Worker()
    worker.feed(job.events, job.world_size)
    (paged,) = worker.derived_pages()
    assert paged.rule == "same_step"
    # The worker re-derives and republishes the page after a rebalance: still one page.
    worker.metrics.observe(DriverResult(derived=[paged]))
    assert worker.value("trainguard_pages_total", run_id=job.run_id, rule="same_step") == 1.0


def test_a_page_of_a_rule_unknown_here_counts_as_other_and_its_run_gets_every_series() -> None:
    job = Job(run_id="run-new-rule").start().steps(3)
    metrics = ProcessorMetrics()
    cause = job.events[-1]
    new = page(cause, "some_future_rule", ReasonCode.PAGE_SAME_NODE, "a rule added later", [cause.event_id])
    metrics.observe(DriverResult(derived=[new]))  # before any refresh has seen the run
    sample = metrics.registry.get_sample_value
    rules = (*PAGE_RULES, OTHER_RULE, "some_future_rule")
    values = {rule: sample("trainguard_pages_total", {"run_id": job.run_id, "rule": rule}) for rule in rules}
    assert values == {**dict.fromkeys(PAGE_RULES, 0.0), OTHER_RULE: 1.0, "some_future_rule": None}
    # The page alerts read the series' age for a page counted before its first scrape.
    created = {"run_id": job.run_id, "rule": OTHER_RULE}
    assert (sample("trainguard_pages_created", created) or 0) > 1e9


def test_a_flagged_straggler_shows_in_the_gauges_and_leaves_with_its_attempt() -> None:
    job = SyncJob(run_id="run-slow", slow=[Slow(rank=13, factor=1.3, from_step=20)]).start()
    worker = Worker(CorePolicy())
    worker.feed(job.steps(60).events, job.world_size)
    assert worker.value("trainguard_stragglers", run_id="run-slow") == 0  # 40 slow steps: not yet
    assert worker.value("trainguard_world_size", run_id="run-slow") == 64
    job.events.clear()
    worker.feed(job.steps(120).events, job.world_size)
    assert worker.value("trainguard_stragglers", run_id="run-slow") == 1
    # A crash and the next attempt's launch: the old attempt's flag no longer counts, even
    # before the detector sees the new attempt's first step.
    job.events.clear()
    job.exit(40, exit_code=1)
    job.restart(resumed_from_step=job.step)
    worker.feed(job.events, job.world_size)
    assert worker.driver.state.runs["run-slow"].straggler.flagged  # still held by the detector
    assert worker.value("trainguard_stragglers", run_id="run-slow") == 0


def test_the_step_time_gauges_follow_the_slow_rank_at_their_own_cadence() -> None:
    """The pass over every rank runs every rank_summary_every_s of the worker's clock; the
    other gauges at every refresh."""
    job = SyncJob(run_id="run-slow", slow=[Slow(rank=13, factor=1.3, from_step=20)]).start()
    worker = Worker(CorePolicy())
    metrics = worker.metrics = ProcessorMetrics(rank_summary_every_s=5.0)
    worker.feed(job.steps(10).events, job.world_size)
    state = worker.driver.state
    metrics.refresh(state, now=100.0)
    fast_p50 = worker.value("trainguard_step_time_p50_seconds", run_id="run-slow")
    assert fast_p50 is not None and fast_p50 > 0
    job.events.clear()
    worker.now = 104.9
    worker.feed(job.steps(20).events, job.world_size)  # rank 13 now 30% slower
    assert worker.value("trainguard_slowest_rank", run_id="run-slow") != 13  # not yet refreshed
    assert worker.value("trainguard_world_size", run_id="run-slow") == 64  # refreshed every time
    metrics.refresh(state, now=105.0)
    assert worker.value("trainguard_slowest_rank", run_id="run-slow") == 13
    worst = worker.value("trainguard_step_time_max_seconds", run_id="run-slow")
    assert worst is not None and worst > fast_p50


def test_a_sharded_run_counts_the_stragglers_of_every_shard_under_its_run_id_alone() -> None:
    slow = [Slow(rank=5, factor=1.3), Slow(rank=40, factor=1.3)]  # one in each of two shards
    job = SyncJob(run_id="run-big", slow=slow).start().steps(130)
    worker = Worker(CorePolicy())
    worker.feed(job.events, job.world_size, shard_ranks=32)
    assert set(worker.driver.state.runs) == {"run-big", "run-big#1"}
    assert worker.value("trainguard_stragglers", run_id="run-big") == 2
    assert worker.value("trainguard_world_size", run_id="run-big") == 64
    assert worker.value("trainguard_stragglers", run_id="run-big#1") is None


def test_a_finished_run_past_the_kept_ones_loses_its_gauges_and_page_series() -> None:
    worker = Worker(keep_finished=1)
    for run_id in ("run-a", "run-b"):
        job = Job(run_id=run_id, world_size=4, ranks_per_node=2).start().steps(5)
        for rank in range(job.world_size):
            job.exit(rank, exit_code=0)
        worker.feed(job.events, job.world_size)
    assert worker.value("trainguard_world_size", run_id="run-b") == 4
    assert worker.value("trainguard_pages_total", run_id="run-b", rule="goodput") == 0
    for name in ("trainguard_world_size", "trainguard_stragglers", "trainguard_goodput_ratio"):
        assert worker.value(name, run_id="run-a") is None
    assert set(worker.pages("run-a").values()) == {None}


def test_the_counted_ids_are_bounded_and_a_recent_redelivery_still_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_module, "COUNTED_IDS", 2)
    job = Job(step_s=60.0).start().steps(150)
    for rank in (1, 2, 3):  # node-000 three times: three interruptions, a page after the second
        crash_and_restart(job, rank, 150)
    worker = Worker()
    worker.feed(job.events, job.world_size)
    counted = [d for r in worker.results for d in r.derived if isinstance(d, Interruption | Page)]
    assert [type(d) for d in counted] == [Interruption, Interruption, Page, Interruption]
    assert worker.value("trainguard_interruptions_total", cause="crash") == 3
    assert len(worker.metrics._counted) == 2  # the page and the last interruption
    # Redelivered recent ids count nothing more.
    worker.metrics.observe(DriverResult(derived=counted[2:]))
    assert worker.value("trainguard_interruptions_total", cause="crash") == 3
    assert worker.value("trainguard_pages_total", run_id=job.run_id, rule="same_node") == 1.0
    # An id older than the bound is forgotten: its redelivery would count again.
    worker.metrics.observe(DriverResult(derived=counted[:1]))
    assert worker.value("trainguard_interruptions_total", cause="crash") == 4


def test_a_hot_rack_shows_in_the_slow_groups_gauge_and_pages_facilities_once() -> None:
    # 256 ranks in 8 racks of 32; rack-3 8% slow as a whole from step 10, its GPUs hot.
    job = SyncJob(run_id="run-rack", world_size=256, nodes_per_rack=4).start()
    rack = [r for r in range(job.world_size) if job.rack(job.node(r)) == "rack-3"]
    job.slow = [Slow(rank=r, factor=1.08, from_step=10) for r in rack]
    worker = Worker(CorePolicy())
    for _ in range(4):
        job.steps(10).health([HealthFault("hot_rack", rack="rack-3")])
    worker.feed(job.events, job.world_size)
    assert worker.value("trainguard_slow_groups", run_id="run-rack") == 0  # 30 slow steps: not yet
    job.events.clear()
    for _ in range(4):
        job.steps(10).health([HealthFault("hot_rack", rack="rack-3")])
    worker.feed(job.events, job.world_size)
    assert worker.value("trainguard_slow_groups", run_id="run-rack") == 1
    assert worker.pages("run-rack")["facilities"] == 1
    assert [p.rule for p in worker.derived_pages()] == ["facilities"]
