"""The numbers a healthy simulated training run reports: step timings, loss, grad
norm, GPU health and self-check digests. Pure functions of the scenario, the step and
a seeded generator, so that the cluster state machine stays about state, not numbers.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from .scenario import Scenario, SlowCause

#: Nominal clock of the simulated GPUs (an H100's boost clock, MHz).
SM_CLOCK_MHZ = 1980.0
NVLINK_WIDTH = 18


def compute_median_s(scenario: Scenario) -> float:
    """Per-rank median compute time such that the SLOWEST of world_size ranks (the one
    every rank waits for) has a median of compute_fraction * step_time_s; the collective
    adds the rest, so the healthy median total step is step_time_s at any world size.

    The median of the max of N iid lognormals is exp(sigma * z) with z the
    0.5**(1/N) quantile of the standard normal."""
    n = scenario.world_size
    z = 0.0 if n == 1 else NormalDist().inv_cdf(0.5 ** (1.0 / n))
    return scenario.compute_fraction * scenario.step_time_s / math.exp(scenario.jitter * z)


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


def gpu_reading(rng: random.Random, base_temp_c: float, slow: tuple[SlowCause, float] | None) -> GpuReading:
    """What NVML would show for a GPU; a slow fault's cause leaves its fingerprint (seed R2)."""
    temp = base_temp_c + rng.gauss(0.0, 0.8)
    nic = min(1.0, max(0.0, 0.35 + rng.gauss(0.0, 0.03)))
    clock, capped, throttled, width, retries = SM_CLOCK_MHZ, False, False, NVLINK_WIDTH, 0
    if slow is not None:
        cause, factor = slow
        if cause == "thermal":
            temp, clock, throttled = 91.0 + rng.gauss(0.0, 0.8), SM_CLOCK_MHZ / factor, True
        elif cause == "link":
            width, retries = NVLINK_WIDTH // 2, 250 + int(rng.random() * 50)
        elif cause == "network":
            nic = 0.97
    return GpuReading(round(temp, 1), round(clock, 1), capped, throttled, width, retries, round(nic, 3))
