"""The checkpoint interval's formulas and defaults (seed §6), shared by the processor's
interval policy (processors/core/decisions/interval.py), which derives T from a run's measured MTBF,
and the rank's cadence (producers/checkpoint/cadence.py), which derives it from the prior
MTBF for its world size until the processor sends one, and offline, where none ever does.

Young's T* = sqrt(2·C·M) minimises C/T + T/(2M); Daly's higher-order estimate is used when
C is not small against M (J. T. Daly, FGCS 2006):

    T = sqrt(2·C·M) · [1 + (1/3)·sqrt(C/2M) + (1/9)·(C/2M)] − C     for C < 2M,  else T = M
"""

from __future__ import annotations

import math

_HOUR = 3600.0

#: The seed's reference point: an MTBF of 3.1 h at 16,384 GPUs. The prior MTBF of a run
#: of W ranks is REFERENCE_MTBF_S x REFERENCE_WORLD_SIZE / W (failures add up per GPU).
REFERENCE_WORLD_SIZE = 16_384
REFERENCE_MTBF_S = 3.1 * _HOUR
#: Never checkpoint more often than MIN_S, nor less often than MAX_S.
MIN_S = 60.0
MAX_S = 6 * _HOUR
#: Daly's estimate instead of Young's above this C/M.
DALY_ABOVE_C_OVER_M = 0.01


def young_s(c: float, m: float) -> float:
    return math.sqrt(2 * c * m)


def daly_s(c: float, m: float) -> float:
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def optimal_s(
    c: float, m: float, min_s: float = MIN_S, max_s: float = MAX_S, daly_above: float = DALY_ABOVE_C_OVER_M
) -> tuple[float, str]:
    """The interval that maximises goodput, clamped to [min_s, max_s], and the formula used."""
    formula = "daly" if c / m > daly_above else "young"
    t = daly_s(c, m) if formula == "daly" else young_s(c, m)
    return min(max_s, max(min_s, t)), formula


def prior_mtbf_s(
    world_size: int,
    reference_mtbf_s: float = REFERENCE_MTBF_S,
    reference_world_size: int = REFERENCE_WORLD_SIZE,
) -> float:
    """The MTBF expected of a run of `world_size` ranks before any failure is measured."""
    return reference_mtbf_s * reference_world_size / max(1, world_size)
