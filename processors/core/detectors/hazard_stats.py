"""Failure prediction's statistics (hazard.py): the tails its tests bound, pure functions
of numbers. Apart so that hazard.py stays a module of its rules."""

from __future__ import annotations

import functools
import math

LN10 = math.log(10.0)
#: A bucket is active when its count is this unlikely under Poisson noise at the fleet's rate.
ACTIVE_P = 1e-3


def active_level(expected: float) -> float | int:
    """The smallest count a bucket needs to be active: P(Poisson(expected) >= it) <= ACTIVE_P
    (the expectation rounded to 3 significant digits: the fleet's nodes share a few)."""
    return _level_of(float(f"{expected:.3g}"))


@functools.lru_cache(maxsize=4096)
def _level_of(expected: float) -> float | int:
    if expected > 100.0:  # the normal approximation: z 3.1 for 1e-3
        return math.ceil(expected + 3.1 * math.sqrt(expected) + 0.5)
    below, count = 0.0, 0  # P(X < count)
    limit = expected + 40.0 * math.sqrt(expected) + 40.0
    while 1.0 - below > ACTIVE_P and count < limit:
        below += (
            math.exp(count * math.log(expected) - expected - math.lgamma(count + 1)) if expected > 0 else 1.0
        )
        count += 1
    return float(max(count, 1))


#: A signal is still going while the silence since its last count is at least this likely
#: at the rate its window shows: a failing part that logs an XID every few buckets is still
#: failing between them; a burst, or a part that stopped, falls silent for longer.
GOING_P = 0.05


def still_going(per_bucket: float, silent_buckets: int) -> bool:
    """Whether `silent_buckets` empty buckets since the last count are plausible for a
    Poisson signal at `per_bucket` counts a bucket (none: it counted just now)."""
    return silent_buckets <= 0 or math.exp(-per_bucket * silent_buckets) >= GOING_P


def decayed_add(
    total: float, seconds: float, value: float, every: float, history: float
) -> tuple[float, float]:
    """An accumulator of `value` per `every` seconds whose past fades once it spans
    `history`: (total, seconds) after one more evaluation (a usual rate, or a usual level)."""
    if seconds + every > history:
        keep = 1.0 - every / history
        total, seconds = total * keep, seconds * keep
    return total + value, seconds + every


def tail_surprise(count: float, expected: float, dispersion: float = 1.0) -> float:
    """-log10 P(X >= count), X quasi-Poisson with mean `expected` and variance dispersion
    x expected: Poisson's tail at count/dispersion and expected/dispersion, exact (the
    regularized lower incomplete gamma, which takes a count that is not whole) where its
    series converges, else the Chernoff bound; the larger of the two, since the bound never
    overstates the surprise. The exact tail matters for sparse signals: three failed-row
    XIDs in an hour against 0.003 expected are p 6e-9, where the bound says 3e-8."""
    k, mu = count / dispersion, max(expected, 1e-12) / dispersion
    if k <= mu:
        return 0.0
    bound = (k * math.log(k / mu) - k + mu) / LN10
    return max(bound, _gamma_surprise(k, mu))


def _gamma_surprise(s: float, x: float) -> float:
    """-log10 of P(Gamma(s) <= x) = P(Poisson(x) >= s) for whole s (x < s), by its series
    x^s e^-x / Gamma(s + 1) x sum_n x^n / ((s + 1)...(s + n)); 0 when it does not converge
    in a few hundred terms (the caller's bound stands)."""
    term, total = 1.0, 1.0
    for n in range(1, 400):
        term *= x / (s + n)
        total += term
        if term < 1e-12 * total:
            log_tail = s * math.log(x) - x - math.lgamma(s + 1) + math.log(total)
            return max(0.0, -log_tail / LN10)
    return 0.0


def binomial_surprise(active: int, buckets: int, share: float) -> float:
    """-log10 P(at least `active` of `buckets` buckets active), each with chance `share`."""
    if active <= 0:
        return 0.0
    tail = sum(
        math.comb(buckets, j) * share**j * (1 - share) ** (buckets - j) for j in range(active, buckets + 1)
    )
    return -math.log10(max(tail, 1e-300))


def robust(values: list[float], floor: float) -> tuple[float, float]:
    values = sorted(values)
    median = values[len(values) // 2]
    mad = sorted(abs(v - median) for v in values)[len(values) // 2]
    return median, max(1.4826 * mad, floor)


def normal_surprise(z: float) -> float:
    """-log10 of an upper bound on the normal tail P(Z >= z) (Mills: phi(z)/z)."""
    if z <= 1.0:
        return 0.0
    return (z * z / 2 + math.log(z * math.sqrt(2 * math.pi))) / LN10
