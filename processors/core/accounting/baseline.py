"""The failure-rate baseline (issue 3, detector 5): a run's MTBF from its own interruptions.

A synchronous job stops when any rank fails, so its failure rate grows with the world
size: the seed's reference point is MTBF 3.1 h at 16,384 GPUs, and "MTBF halves every
time the cluster doubles" (49.6 h at 1,024). That scaling is the *prior*; the run's own
interruptions over its observed time are the *evidence*:

    rate ~ Gamma(shape = alpha0 + n, rate = beta0 + exposure_s)     (Gamma-Poisson)
    alpha0 = prior_weight_interruptions, beta0 = alpha0 x prior_mtbf_s

so the prior is worth `alpha0` interruptions seen over `alpha0` prior MTBFs. A young run
reports the world-size prior; an old one converges to n / exposure. The MTBF reported is
1 / (posterior mean rate) = (beta0 + exposure) / (alpha0 + n): exactly the prior with no
data, always finite (the posterior mean of 1/rate is not, for shape <= 1), and the
quantity Young/Daly's M stands for. The interval is the equal-tailed credible interval of
the rate, inverted.

Exposure is the run's observed event time (latest ts minus earliest ts seen), excluding
nothing for now: restart downtime counts, as it does in the seed's "419 interruptions in
54 days"; a world-size change re-scales the prior only (no rank-hour weighting).

Pure and cheap: time only from event ts, no clock, no I/O. `on_time` runs on every event
(a couple of min/max and a division); quantiles are computed only when publishing.
"""

from __future__ import annotations

import bisect
import math
from statistics import NormalDist
from typing import TYPE_CHECKING

from ....schemas import Envelope, Interruption, MtbfUpdate, Reason, ReasonCode
from ..ids import derived_id
from .baseline_policy import _HOUR, BaselinePolicy
from .baseline_state import BaselineState

if TYPE_CHECKING:  # state.py holds a BaselineState per run
    from ..state import RunState


def prior_mtbf_s(world_size: int, policy: BaselinePolicy) -> float:
    """The expected MTBF at a world size: halves every time the cluster doubles."""
    return policy.reference_mtbf_s * policy.reference_world_size / world_size


# --------------------------------------------------------------------------- estimate


def _prior_s(state: BaselineState, policy: BaselinePolicy) -> float:
    return prior_mtbf_s(state.world_size or policy.reference_world_size, policy)


def posterior(state: BaselineState, policy: BaselinePolicy) -> tuple[float, float]:
    """(shape, rate per second) of the Gamma posterior of the failure rate."""
    alpha0 = policy.prior_weight_interruptions
    return alpha0 + state.interruptions, alpha0 * _prior_s(state, policy) + state.exposure_s


def mtbf_s(state: BaselineState, policy: BaselinePolicy) -> float:
    """1 / posterior mean rate = (beta0 + exposure) / (alpha0 + n)."""
    shape, rate = posterior(state, policy)
    return rate / shape


def mtbf_interval_s(state: BaselineState, policy: BaselinePolicy) -> tuple[float, float]:
    """Equal-tailed `confidence` interval of the MTBF (the rate's quantiles, inverted)."""
    shape, rate = posterior(state, policy)
    tail = (1 - policy.confidence) / 2
    return rate / gamma_quantile(1 - tail, shape), rate / gamma_quantile(tail, shape)


def baseline_rate_per_h(state: BaselineState, policy: BaselinePolicy) -> float:
    """Posterior mean failure rate, interruptions per hour."""
    return _HOUR / mtbf_s(state, policy)


def window_count(state: BaselineState, now: float, policy: BaselinePolicy) -> int:
    """Interruptions with ts in (now - window_s, now]. `now` should be at or after the
    latest event ts: older interruptions are forgotten as time advances."""
    return bisect.bisect_right(state.recent, now) - bisect.bisect_right(state.recent, now - policy.window_s)


def rate_1h(state: BaselineState, now: float, policy: BaselinePolicy) -> float:
    """Interruptions per hour over the trailing window ending at `now` (with the default
    one-hour window: the count of interruptions in the last hour of event time)."""
    return window_count(state, now, policy) * _HOUR / policy.window_s


def rate_ratio(state: BaselineState, now: float, policy: BaselinePolicy) -> float:
    """Recent rate over the baseline rate; R5 pages when this exceeds 5.

    Alone it is a weak rule: at 1,024 ranks (baseline ~0.02/h) a single interruption is
    ~50x, and at 16,384 (~0.32/h) any two in one hour are ~6x. Pair it with a minimum
    count or with `burst_p_value`."""
    return rate_1h(state, now, policy) / baseline_rate_per_h(state, policy)


def background_rate_per_h(state: BaselineState, now: float, policy: BaselinePolicy) -> float:
    """The posterior mean rate from everything BEFORE the trailing window (its interruptions
    and its exposure left out): what a burst is judged against, so that it does not raise
    its own baseline (four failures in a young run's first hours would otherwise double it)."""
    alpha0 = policy.prior_weight_interruptions
    shape = alpha0 + state.interruptions - window_count(state, now, policy)
    rate = alpha0 * _prior_s(state, policy) + max(0.0, state.exposure_s - policy.window_s)
    return _HOUR * shape / rate


def burst_p_value(state: BaselineState, now: float, policy: BaselinePolicy, given_one: bool = False) -> float:
    """P(at least this many interruptions in the window | the background rate): the Poisson
    tail, P(N >= k | m) = P(k, m) with m = background rate x window. 1.0 when k = 0.
    `given_one`: the check is made at an interruption, which is given; the p-value is that
    of the k - 1 others in the window (checking at every interruption scans the timeline)."""
    k = window_count(state, now, policy) - (1 if given_one else 0)
    if k <= 0:
        return 1.0
    return regularized_gamma_p(k, background_rate_per_h(state, now, policy) * policy.window_s / _HOUR)


# --------------------------------------------------------------------------- driving


def observe(state: BaselineState, run: RunState, ts: float) -> None:
    """Exposure up to `ts` (every event of the run; also the block fold's)."""
    if state.start_ts is None or ts < state.start_ts:
        state.start_ts = ts
    if ts > state.end_ts:
        state.end_ts = ts
    state.world_size = run.world_size


def on_time(state: BaselineState, run: RunState, event: Envelope, policy: BaselinePolicy) -> list[MtbfUpdate]:
    """Advance exposure to `event.ts` (call on every event of the run). Publishes only when
    the estimate moved by more than `publish_change_fraction` since the last publication."""
    world_size = state.world_size
    observe(state, run, event.ts)
    if state.end_ts < state.checked_end_ts + policy.check_every_s and run.world_size == world_size:
        return []  # the estimate moves with exposure only: checking every event is waste
    state.checked_end_ts = state.end_ts
    reference = state.published_mtbf_s or _prior_s(state, policy)
    if abs(mtbf_s(state, policy) / reference - 1) <= policy.publish_change_fraction:
        return []
    return [_update(state, run, event, policy)]


def on_interruption(
    state: BaselineState, run: RunState, interruption: Interruption, policy: BaselinePolicy
) -> list[MtbfUpdate]:
    """Count an interruption (once per interruption_id) and publish the new estimate."""
    observe(state, run, interruption.ts)
    if interruption.interruption_id in state.counted:
        return []
    state.counted.add(interruption.interruption_id)
    state.interruptions += 1
    state.by_cause[interruption.cause.value] = state.by_cause.get(interruption.cause.value, 0) + 1
    bisect.insort(state.recent, interruption.ts)
    return [_update(state, run, interruption, policy)]


def _update(state: BaselineState, run: RunState, cause: Envelope, policy: BaselinePolicy) -> MtbfUpdate:
    # Forget interruptions that can no longer fall in any window ending at or after end_ts.
    del state.recent[: bisect.bisect_right(state.recent, state.end_ts - policy.window_s)]
    mtbf = mtbf_s(state, policy)
    low, high = mtbf_interval_s(state, policy)
    prior = _prior_s(state, policy)
    state.published_mtbf_s = mtbf
    n = state.interruptions
    if state.world_size:
        ranks = f"{state.world_size:,} ranks"
    else:
        ranks = f"{policy.reference_world_size:,} ranks (world size unknown)"
    text = (
        f"MTBF {mtbf / _HOUR:.1f} h ({policy.confidence * 100:g}% CI {low / _HOUR:.1f}–"
        f"{high / _HOUR:.1f} h) from {n} interruption{'s' if n != 1 else ''} over "
        f"{state.exposure_s:,.0f} s; prior {prior / _HOUR:.1f} h for {ranks}"
    )
    return MtbfUpdate(
        event_id=derived_id("mtbf_update", cause.event_id),
        run_id=run.run_id,
        attempt=cause.attempt,
        rank=-1,
        node="",
        step=max(-1, run.job_step),
        ts=state.end_ts,
        reason=Reason(code=ReasonCode.MTBF, text=text),
        caused_by=[cause.event_id],
        mtbf_s=mtbf,
        ci_low_s=low,
        ci_high_s=high,
        prior_mtbf_s=prior,
        interruptions=n,
        exposure_s=state.exposure_s,
        by_cause=dict(sorted(state.by_cause.items())),
        rate_1h=rate_1h(state, state.end_ts, policy),
        baseline_rate_per_h=_HOUR / mtbf,
    )


# --------------------------------------------------------------------------- Gamma quantile


def regularized_gamma_p(a: float, x: float) -> float:
    """P(a, x), the regularized lower incomplete gamma function (Gamma(a, 1) CDF at x).

    Series for x < a + 1, Lentz's continued fraction for Q otherwise (Numerical Recipes
    6.2); relative accuracy ~1e-14."""
    if a <= 0:
        raise ValueError(f"shape must be positive, got {a}")
    if x <= 0:
        return 0.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return min(1.0, total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return max(0.0, 1.0 - math.exp(log_prefix) * h)


def gamma_quantile(p: float, shape: float) -> float:
    """x with P(shape, x) = p: the p-quantile of Gamma(shape, rate 1). The chi-square
    quantile with k degrees of freedom is 2 x gamma_quantile(p, k / 2).

    Wilson-Hilferty start, then Newton steps kept inside a bisection bracket."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    z = NormalDist().inv_cdf(p)
    wh = 1 - 1 / (9 * shape) + z / (3 * math.sqrt(shape))
    x = shape * wh**3 if wh > 0 else 0.0
    if x <= 0:  # lower tail of a small shape: P(a, x) ~ x^a / Gamma(a + 1)
        x = math.exp((math.log(p) + math.lgamma(shape + 1)) / shape)
    lo, hi = 0.0, math.inf
    for _ in range(200):
        f = regularized_gamma_p(shape, x) - p
        if f == 0:
            return x
        if f < 0:
            lo = x
        else:
            hi = x
        density = math.exp((shape - 1) * math.log(x) - x - math.lgamma(shape))
        step = f / density if density > 0 else math.inf
        nxt = x - step
        if not lo < nxt < hi:  # Newton left the bracket: bisect (or expand an open one)
            nxt = 2 * x if math.isinf(hi) else (lo + hi) / 2
        if abs(nxt - x) <= 1e-13 * x:
            return nxt
        x = nxt
    return x
