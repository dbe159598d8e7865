"""The numbers a simulated training run reports: step timings and their noise, loss,
grad norm, GPU health, self-check digests and cross-rank check values. Pure functions of
the scenario, the step and a seeded generator, so that the cluster state machine stays
about state, not numbers.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from .scenario import Noise, Scenario, SlowCause

#: Nominal clock of the simulated GPUs (an H100's boost clock, MHz).
SM_CLOCK_MHZ = 1980.0
NVLINK_WIDTH = 18
#: A thermally throttled GPU reads about this hot (NVML's slowdown threshold is ~87 °C).
THROTTLE_TEMP_C = 91.0
#: NVLink replay/recovery errors a degraded link adds per training step (a climbing counter).
LINK_RETRIES_PER_STEP = 12


def compute_median_s(scenario: Scenario) -> float:
    """Per-rank median compute time such that the SLOWEST of world_size ranks (the one
    every rank waits for) has a median of compute_fraction * step_time_s; the collective
    adds the rest, so the healthy median total step is step_time_s at any world size.

    The median of the max of N iid lognormals is exp(sigma * z) with z the
    0.5**(1/N) quantile of the standard normal. A persistent per-rank spread adds to
    the per-step jitter (a product of lognormals is lognormal); the noise's tail and
    GC pauses are not calibrated for."""
    n = scenario.world_size
    z = 0.0 if n == 1 else NormalDist().inv_cdf(0.5 ** (1.0 / n))
    sigma = math.hypot(scenario.jitter, scenario.noise.rank_spread)
    return scenario.compute_fraction * scenario.step_time_s / math.exp(sigma * z)


def rank_medians(scenario: Scenario) -> list[float] | None:
    """Each rank's persistent median compute (None without a rank spread): the healthy
    median times a lognormal factor drawn once per rank from the scenario's seed."""
    spread = scenario.noise.rank_spread
    if spread <= 0:
        return None
    median = compute_median_s(scenario)
    rng = random.Random(f"trainguard-sim-ranks:{scenario.seed}")
    return [median * math.exp(spread * rng.gauss(0.0, 1.0)) for _ in range(scenario.world_size)]


def collective_s(scenario: Scenario) -> float:
    return (1.0 - scenario.compute_fraction) * scenario.step_time_s


def step_rng(seed: int, step: int) -> random.Random:
    """A generator for one step's training statistics. Keyed by step, so a step that is
    re-run after a restart reports the same loss (a bitwise-deterministic resume)."""
    return random.Random(f"trainguard-sim:{seed}:{step}")


def loss_curve(step: int, steps: int) -> float:
    """A language-model-like loss: ~10.8 at step 0 decaying toward ~2.2."""
    return 2.2 + 8.6 * math.exp(-step / max(1.0, steps / 6.0))


def grad_norm_curve(step: int, steps: int) -> float:
    return 0.4 + 1.6 * math.exp(-step / max(1.0, steps / 10.0))


def digest(seed: int, step: int, rank: int, corrupt: bool = False) -> str:
    text = f"{seed}:{step}:{rank}" + (":bitflip" if corrupt else "")
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def apply_noise(compute: list[float], noise: Noise, rng: random.Random) -> None:
    """Add one step's heavy-tail events and GC pause to `compute` (per-rank seconds), in
    place. Tail events are Bernoulli(tail_prob) per rank, drawn by geometric skipping, so
    the cost is O(events), not O(world size)."""
    n = len(compute)
    p = noise.tail_prob
    if p > 0:
        log_q = math.log1p(-p) if p < 1 else -math.inf
        inv_alpha, low, cap = 1.0 / noise.tail_alpha, noise.tail_min, noise.tail_max
        rank = -1
        while True:
            u = rng.random()
            rank += 1 if log_q == -math.inf else 1 + int(math.log(1.0 - u) / log_q)
            if rank >= n:
                break
            extra = low * (1.0 - rng.random()) ** -inv_alpha
            compute[rank] *= 1.0 + min(cap, extra)
    if noise.gc_pause_prob > 0 and rng.random() < noise.gc_pause_prob:
        low_s, high_s = noise.gc_pause_s
        compute[rng.randrange(n)] += rng.uniform(low_s, high_s)


def cross_rank_value(seed: int, step: int, microbatch_id: str, rank: int, noise: float, bias: float) -> float:
    """A rank's checksum of the gradient of one microbatch, as compared across ranks (R3).

    Every rank computes the same exact value for the same microbatch and step, then
    differs from it by relative float noise of sigma `noise` (reduction order, kernel
    choice; deterministic per rank and microbatch). `bias` is a wrong GPU's relative
    error."""
    exact = random.Random(f"trainguard-sim-xrank:{seed}:{step}:{microbatch_id}").uniform(100.0, 1000.0)
    wobble = random.Random(f"trainguard-sim-xrank:{seed}:{step}:{microbatch_id}:{rank}").gauss(0.0, 1.0)
    return exact * (1.0 + noise * wobble) * (1.0 + bias)


@dataclass(frozen=True, slots=True)
class GpuReading:
    temperature_c: float
    sm_clock_mhz: float
    power_capped: bool
    thermal_throttle: bool
    nvlink_width: int
    nvlink_retries: int
    nic_utilization: float

    def fields(self) -> dict[str, object]:
        return {
            "present": True,
            "temperature_c": self.temperature_c,
            "sm_clock_mhz": self.sm_clock_mhz,
            "power_capped": self.power_capped,
            "thermal_throttle": self.thermal_throttle,
            "nvlink_width": self.nvlink_width,
            "nvlink_expected_width": NVLINK_WIDTH,
            "nvlink_retries": self.nvlink_retries,
            "ecc_corrected": 0,
            "ecc_uncorrected": 0,
            "nic_utilization": self.nic_utilization,
        }


#: What a slow fault does to a rank: (cause, slowdown factor, first step of the fault).
Slowdown = tuple[SlowCause, float, int]


def gpu_reading(rng: random.Random, base_temp_c: float, slow: Slowdown | None, step: int) -> GpuReading:
    """What NVML would show for a GPU at `step`; a slow fault's cause leaves its
    fingerprint (seed R2): thermal: hot and throttled; power: power-capped at a normal
    temperature; link: NVLink at half width with a retry counter that climbs from the
    fault's onset; network: a saturated NIC; unknown: nothing."""
    temp = base_temp_c + rng.gauss(0.0, 0.8)
    nic = min(1.0, max(0.0, 0.35 + rng.gauss(0.0, 0.03)))
    clock, capped, throttled, width, retries = SM_CLOCK_MHZ, False, False, NVLINK_WIDTH, 0
    if slow is not None:
        cause, factor, onset = slow
        if cause == "thermal":
            temp, clock, throttled = THROTTLE_TEMP_C + rng.gauss(0.0, 0.8), SM_CLOCK_MHZ / factor, True
        elif cause == "power":
            temp, clock, capped = base_temp_c + 6.0 + rng.gauss(0.0, 0.8), SM_CLOCK_MHZ / factor, True
        elif cause == "link":
            width = NVLINK_WIDTH // 2
            retries = 40 + LINK_RETRIES_PER_STEP * max(0, step - onset)  # a counter: never decreases
        elif cause == "network":
            nic = min(1.0, 0.97 + rng.gauss(0.0, 0.01))
    return GpuReading(round(temp, 1), round(clock, 1), capped, throttled, width, retries, round(nic, 3))
