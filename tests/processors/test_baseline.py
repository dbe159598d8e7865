"""The failure-rate baseline on the pure core: no broker, no clock.

Runs are simulated as what the engine would feed the baseline: a Tick every few minutes
of event time (exposure) and Interruption events whose arrivals are a Poisson process at
a known true MTBF, drawn with a seeded RNG."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import pytest

from trainguard.processors.core.accounting.baseline import (
    baseline_rate_per_h,
    burst_p_value,
    gamma_quantile,
    mtbf_interval_s,
    mtbf_s,
    on_interruption,
    on_time,
    prior_mtbf_s,
    rate_1h,
    rate_ratio,
    regularized_gamma_p,
)
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy, BaselineState
from trainguard.processors.core.state import RunState
from trainguard.schemas import (
    Interruption,
    InterruptionCause,
    MtbfUpdate,
    Reason,
    ReasonCode,
    Tick,
)

POLICY = BaselinePolicy()
HOUR = 3600.0
DAY = 24 * HOUR
T0 = 1_800_000_000.0

#: Roughly the mix of a large run's unexpected interruptions: mostly crashes (GPU, NIC,
#: host), some hangs, the odd SDC or non-finite loss.
CAUSE_MIX = {
    InterruptionCause.CRASH: 0.78,
    InterruptionCause.HANG: 0.15,
    InterruptionCause.SDC: 0.04,
    InterruptionCause.NON_FINITE: 0.03,
}


@dataclass
class SimRun:
    """A run as the baseline sees it: ticks (exposure) and interruptions (evidence)."""

    world_size: int | None
    seed: int = 0
    policy: BaselinePolicy = POLICY
    tick_s: float = 600.0
    t: float = T0
    attempt: int = 0
    state: BaselineState = field(default_factory=BaselineState)
    outputs: list[MtbfUpdate] = field(default_factory=list)
    causes: list[InterruptionCause] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run = RunState("run-baseline", world_size=self.world_size)
        self.rng = random.Random(self.seed)
        self._ids = 0

    def _id(self) -> str:
        self._ids += 1
        return f"{self.run.run_id}-{self._ids}"

    def tick(self, ts: float) -> None:
        self.t = ts
        event = Tick(
            event_id=self._id(),
            run_id=self.run.run_id,
            attempt=self.attempt,
            rank=-1,
            node="",
            step=-1,
            ts=ts,
        )
        self.outputs += on_time(self.state, self.run, event, self.policy)

    def interrupt(self, ts: float, cause: InterruptionCause = InterruptionCause.CRASH) -> Interruption:
        self.t = ts
        event_id = self._id()
        event = Interruption(
            event_id=event_id,
            run_id=self.run.run_id,
            attempt=self.attempt,
            rank=7,
            node="node-001",
            step=100,
            ts=ts,
            reason=Reason(code=ReasonCode.RANK_EXITED, text="rank 7 died"),
            caused_by=[f"exit-{event_id}"],
            interruption_id=event_id,
            cause=cause,
            detected_by="rank_exit",
            lost_steps=3,
            last_checkpoint_step=97,
        )
        self.attempt += 1
        self.causes.append(cause)
        self.times.append(ts)
        self.outputs += on_interruption(self.state, self.run, event, self.policy)
        return event

    def _gap(self, true_mtbf_s: float) -> float:
        return self.rng.expovariate(1 / true_mtbf_s) if true_mtbf_s < math.inf else math.inf

    def run_for(self, duration_s: float, true_mtbf_s: float) -> SimRun:
        """Advance event time by duration_s, ticking, with Poisson interruptions."""
        end = self.t + duration_s
        next_failure = self.t + self._gap(true_mtbf_s)
        next_tick = self.t + self.tick_s
        while min(next_failure, next_tick) <= end:
            if next_failure < next_tick:
                cause = self.rng.choices(list(CAUSE_MIX), weights=list(CAUSE_MIX.values()))[0]
                self.interrupt(next_failure, cause)
                next_failure += self._gap(true_mtbf_s)
            else:
                self.tick(next_tick)
                next_tick += self.tick_s
        self.tick(end)
        return self


def sim(world_size: int | None, seed: int = 0, tick_s: float = 600.0) -> SimRun:
    """A run whose event time starts at T0."""
    run = SimRun(world_size, seed=seed, tick_s=tick_s)
    run.tick(T0)
    return run


# --------------------------------------------------------------------------- prior


def test_prior_is_the_seeds_scale_table_and_halves_when_the_cluster_doubles() -> None:
    assert prior_mtbf_s(16_384, POLICY) == pytest.approx(3.1 * HOUR)
    # seed §2: "At 1,024 GPUs: MTBF 49.5 h" (16 x 3.1 h = 49.6 h; the seed rounds)
    assert prior_mtbf_s(1_024, POLICY) / HOUR == pytest.approx(49.5, abs=0.15)
    for w in (512, 1_024, 4_096, 16_384, 65_536):
        assert prior_mtbf_s(2 * w, POLICY) == pytest.approx(prior_mtbf_s(w, POLICY) / 2)
    # seed: "A 30-day run takes 233 interruptions" at 16,384 GPUs
    assert 30 * DAY / prior_mtbf_s(16_384, POLICY) == pytest.approx(233, abs=1)


@pytest.mark.parametrize("world_size", [1_024, 16_384])
def test_young_run_reports_the_world_size_prior(world_size: int) -> None:
    run = sim(world_size).run_for(2 * HOUR, true_mtbf_s=math.inf)
    prior = prior_mtbf_s(world_size, POLICY)
    assert run.state.interruptions == 0 and run.state.exposure_s == pytest.approx(2 * HOUR)
    assert mtbf_s(run.state, POLICY) == pytest.approx(prior, rel=0.35)
    low, high = mtbf_interval_s(run.state, POLICY)
    assert low < prior < high
    assert high / low > 10  # two pseudo-interruptions: the prior is honest about its doubt
    assert run.outputs == [] or world_size == 16_384  # 1,024: 2 h is 2% of the prior's weight

    # The first interruption publishes, and the estimate is still mostly the prior.
    run.interrupt(run.t + 60)
    update = run.outputs[-1]
    assert update.interruptions == 1 and update.prior_mtbf_s == pytest.approx(prior)
    assert 0.5 * prior < update.mtbf_s < prior
    assert update.ci_low_s < update.mtbf_s < update.ci_high_s


def test_quiet_run_publishes_only_when_the_estimate_moves() -> None:
    run = sim(16_384).run_for(3 * DAY, true_mtbf_s=math.inf)  # a lucky run: no failures at all
    updates = run.outputs
    assert 5 <= len(updates) <= 30  # not one per tick (432 ticks)
    previous = prior_mtbf_s(16_384, POLICY)
    for update in updates:
        assert update.interruptions == 0 and update.rate_1h == 0
        assert update.mtbf_s > previous * (1 + POLICY.publish_change_fraction)
        previous = update.mtbf_s
    # (beta0 + exposure) / alpha0: 3 days with no failure moves a 3.1 h prior to ~39 h
    assert updates[-1].mtbf_s == pytest.approx((2 * 3.1 * HOUR + updates[-1].exposure_s) / 2)


def test_unknown_world_size_uses_the_reference_prior_until_the_run_says() -> None:
    run = sim(None).run_for(HOUR, true_mtbf_s=math.inf)
    assert mtbf_s(run.state, POLICY) == pytest.approx(3.1 * HOUR + HOUR / 2)
    run.interrupt(run.t + 1)
    assert "16,384 ranks (world size unknown)" in run.outputs[-1].reason.text
    run.run.world_size = 2_048  # RunStarted arrived
    run.tick(run.t + 1)
    assert run.outputs[-1].prior_mtbf_s == pytest.approx(prior_mtbf_s(2_048, POLICY))
    assert "for 2,048 ranks;" in run.outputs[-1].reason.text + ";"


# --------------------------------------------------------------------------- convergence


def test_long_run_converges_to_the_true_mtbf_not_the_prior() -> None:
    true_mtbf = 2.0 * HOUR  # a flaky cluster: worse than the 3.1 h the world size predicts
    run = sim(16_384, seed=7).run_for(30 * DAY, true_mtbf_s=true_mtbf)
    n = run.state.interruptions
    assert 300 < n < 420  # ~360 expected
    assert run.state.exposure_s == pytest.approx(30 * DAY)
    estimate = mtbf_s(run.state, POLICY)
    low, high = mtbf_interval_s(run.state, POLICY)
    assert low < true_mtbf < high
    assert estimate == pytest.approx(true_mtbf, rel=0.1)
    assert estimate == pytest.approx(30 * DAY / n, rel=0.02)  # the data dominate the prior
    assert high / low < 1.25  # ~360 events pin it down
    last = run.outputs[-1]  # published on the last interruption
    assert last.interruptions == n and last.prior_mtbf_s == pytest.approx(3.1 * HOUR)
    assert last.mtbf_s == pytest.approx(estimate, rel=0.05)


def test_a_better_run_than_the_world_size_predicts_converges_upward() -> None:
    run = sim(1_024, seed=3).run_for(30 * DAY, true_mtbf_s=120 * HOUR)
    low, high = mtbf_interval_s(run.state, POLICY)
    assert low < 120 * HOUR < high
    assert mtbf_s(run.state, POLICY) > prior_mtbf_s(1_024, POLICY)


@pytest.mark.parametrize(
    ("world_size", "true_mtbf_h", "days"),
    [(16_384, 3.1, 7), (1_024, 30.0, 30), (4_096, 8.0, 14)],
)
def test_interval_covers_the_truth_about_as_often_as_it_claims(
    world_size: int, true_mtbf_h: float, days: int
) -> None:
    seeds = range(50)
    covered = 0
    for seed in seeds:
        run = sim(world_size, seed=seed, tick_s=3600.0).run_for(days * DAY, true_mtbf_h * HOUR)
        low, high = mtbf_interval_s(run.state, POLICY)
        covered += low < true_mtbf_h * HOUR < high
    assert covered >= 0.7 * len(seeds), f"90% interval covered the truth in {covered}/50 runs"


# --------------------------------------------------------------------------- by cause


def test_counts_by_cause_add_up_and_match_what_happened() -> None:
    run = sim(16_384, seed=11).run_for(10 * DAY, true_mtbf_s=3.1 * HOUR)
    final = run.outputs[-1] if run.outputs[-1].interruptions else None
    assert final is not None or run.state.interruptions == 0
    expected: dict[str, int] = {}
    for cause in run.causes:
        expected[cause.value] = expected.get(cause.value, 0) + 1
    assert run.state.by_cause == expected
    assert sum(expected.values()) == run.state.interruptions == len(run.causes) > 50
    assert expected["crash"] > expected["hang"] > 0
    last_update = [u for u in run.outputs if u.interruptions == run.state.interruptions][0]
    assert last_update.by_cause == expected


# --------------------------------------------------------------------------- recent rate


def test_one_hour_rate_against_the_baseline() -> None:
    run = sim(16_384, seed=5).run_for(DAY, true_mtbf_s=3.1 * HOUR)
    now = run.t
    in_window = sum(1 for ts in run.times if now - HOUR < ts <= now)
    assert rate_1h(run.state, now, POLICY) == in_window
    assert baseline_rate_per_h(run.state, POLICY) == pytest.approx(HOUR / mtbf_s(run.state, POLICY))
    assert 0.15 < baseline_rate_per_h(run.state, POLICY) < 0.6  # ~1 / 3.1 h
    # An hour later with nothing new, the window is empty again.
    run.tick(now + HOUR + 1)
    assert rate_1h(run.state, run.t, POLICY) == 0 and rate_ratio(run.state, run.t, POLICY) == 0
    for update in run.outputs:
        assert update.rate_1h == sum(1 for ts in run.times if update.ts - HOUR < ts <= update.ts)


@pytest.mark.parametrize("world_size", [1_024, 16_384])
def test_burst_of_six_in_an_hour_is_a_rate_anomaly(world_size: int) -> None:
    run = sim(world_size, seed=2).run_for(2 * DAY, true_mtbf_s=prior_mtbf_s(world_size, POLICY))
    start = run.t
    for i in range(6):
        run.interrupt(start + 300 + i * 600)  # one every 10 minutes: a bad rack, a bad batch
    now = run.t
    assert rate_1h(run.state, now, POLICY) == sum(1 for ts in run.times if now - HOUR < ts <= now) >= 6
    assert rate_ratio(run.state, now, POLICY) > 5
    assert burst_p_value(run.state, now, POLICY) < 1e-4
    assert run.outputs[-1].rate_1h >= 6
    assert run.outputs[-1].rate_1h / run.outputs[-1].baseline_rate_per_h > 5


def test_normal_failures_at_scale_trip_the_bare_ratio_but_not_the_poisson_tail() -> None:
    """At 16,384 ranks two ordinary failures in one hour already exceed 5x the baseline,
    so R5's ratio needs a second condition; the Poisson tail tells chance from pattern."""
    run = sim(16_384, seed=1)
    worst_ratio, least_p = 0.0, 1.0
    end = T0 + 30 * DAY
    while run.t < end:
        run.run_for(HOUR / 6, true_mtbf_s=3.1 * HOUR)
        worst_ratio = max(worst_ratio, rate_ratio(run.state, run.t, POLICY))
        least_p = min(least_p, burst_p_value(run.state, run.t, POLICY))
    assert worst_ratio > 5  # the bare rule pages on normal hardware failures (seed C5)
    assert least_p > 1e-4


# --------------------------------------------------------------------------- determinism


def test_same_events_same_outputs_and_ids() -> None:
    a = sim(4_096, seed=9).run_for(5 * DAY, true_mtbf_s=6 * HOUR)
    b = sim(4_096, seed=9).run_for(5 * DAY, true_mtbf_s=6 * HOUR)
    assert [u.model_dump() for u in a.outputs] == [u.model_dump() for u in b.outputs]
    assert len({u.event_id for u in a.outputs}) == len(a.outputs)
    for update in a.outputs:
        assert update.rank == -1 and update.node == "" and update.reason.code == ReasonCode.MTBF
        assert len(update.caused_by) == 1


def test_redelivered_interruption_counts_once() -> None:
    run = sim(1_024).run_for(HOUR, true_mtbf_s=math.inf)
    event = run.interrupt(run.t + 10)
    before = (run.state.interruptions, dict(run.state.by_cause), len(run.outputs))
    assert on_interruption(run.state, run.run, event, POLICY) == []
    assert (run.state.interruptions, run.state.by_cause, len(run.outputs)) == before


def test_reordered_events_give_the_same_exposure() -> None:
    a, b = BaselineState(), BaselineState()
    run = RunState("r", world_size=1_024)
    ticks = [
        Tick(event_id=f"t{i}", run_id="r", attempt=0, rank=-1, node="", step=-1, ts=T0 + 60 * i)
        for i in range(100)
    ]
    for t in ticks:
        on_time(a, run, t, POLICY)
    for t in random.Random(4).sample(ticks, len(ticks)):
        on_time(b, run, t, POLICY)
    assert a.exposure_s == b.exposure_s == 99 * 60
    assert mtbf_s(a, POLICY) == mtbf_s(b, POLICY)


def test_reason_text_reads_like_a_sentence() -> None:
    run = sim(1_024).run_for(100_440 - 9, true_mtbf_s=math.inf)
    for _ in range(9):
        run.interrupt(run.t + 1)
    update = run.outputs[-1]
    assert update.exposure_s == pytest.approx(100_440)
    # (2 x 178,560 s + 100,440 s) / (2 + 9) = 41,596 s; the interval is chi-square(22)'s
    # 5% and 95% points (12.338, 33.924): 2 x 457,560 s / 33.924 = 7.5 h, / 12.338 = 20.6 h
    assert update.reason.text == (
        "MTBF 11.6 h (90% CI 7.5–20.6 h) from 9 interruptions over 100,440 s; prior 49.6 h for 1,024 ranks"
    )
    assert re.fullmatch(r"MTBF [\d.]+ h \(90% CI [\d.]+–[\d.]+ h\) from .*", update.reason.text)


# --------------------------------------------------------------------------- Gamma quantile

#: Chi-square quantiles (df, p, value) from standard tables (scipy.stats.chi2.ppf).
CHI2 = [
    (10, 0.95, 18.307038),
    (10, 0.05, 3.940299),
    (1, 0.975, 5.023886),
    (1, 0.95, 3.841459),
    (1, 0.025, 0.000982069),
    (2, 0.5, 1.386294),
    (4, 0.9, 7.779440),
    (30, 0.99, 50.892181),
    (100, 0.99, 135.806723),
    (100, 0.01, 70.064895),
]


@pytest.mark.parametrize(("df", "p", "expected"), CHI2)
def test_gamma_quantile_matches_chi_square_tables(df: int, p: float, expected: float) -> None:
    assert 2 * gamma_quantile(p, df / 2) == pytest.approx(expected, rel=2e-6)


def test_gamma_quantile_inverts_the_cdf_and_the_exponential_exactly() -> None:
    for p in (1e-9, 1e-4, 0.05, 0.3, 0.5, 0.9, 0.999, 1 - 1e-9):
        # (near p = 1 the answer is only as exact as 1 - p is: ~1e-16 / density)
        assert gamma_quantile(p, 1.0) == pytest.approx(-math.log1p(-p), rel=1e-8)
        for shape in (0.1, 0.5, 2.0, 11.0, 235.0, 5_000.0):
            assert regularized_gamma_p(shape, gamma_quantile(p, shape)) == pytest.approx(p, rel=1e-9)
    with pytest.raises(ValueError):
        gamma_quantile(1.0, 2.0)


def test_incomplete_gamma_is_the_poisson_tail() -> None:
    for k in (1, 2, 6, 40):
        for mean in (0.02, 0.32, 5.0, 40.0):
            below = sum(math.exp(-mean) * mean**j / math.factorial(j) for j in range(k))
            assert regularized_gamma_p(k, mean) == pytest.approx(1 - below, rel=1e-9, abs=1e-15)
