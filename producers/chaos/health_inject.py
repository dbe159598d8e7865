"""A chaos knob for failure prediction (issue 46): a rank whose GPU health reader reports
failure precursors that rise over time, on CPU as on a GPU.

``TRAINGUARD_INJECT_HEALTH`` holds one JSON object::

    {"ranks": [1], "after_s": 5, "ecc_corrected_per_s": 40, "growth": 1.5}

- ``ranks`` (required): the global ranks (RANK) that inject, a non-empty list of whole
  numbers >= 0. Every other rank reads its GPU as usual.
- ``after_s`` (default 0): seconds after the reader starts (the rank's start) before the
  counts begin to rise; before that they are 0.
- ``<counter>_per_s``: how many events of that counter come per second at the onset, for
  any of ``ecc_corrected``, ``ecc_uncorrected``, ``retired_pages``,
  ``remapped_rows_correctable``, ``remapped_rows_uncorrectable``, ``xid_errors``,
  ``pcie_replays``, ``nvlink_crc_errors``, ``nvlink_retries`` (a number >= 0). The ECC
  counts add to the lifetime totals (``ecc_*_total``) too, as a device's do.
- ``growth`` (default 1: steady rates): every rate is multiplied by this each second after
  the onset (a number > 0), so the count at ``u`` seconds past the onset is
  ``rate * (growth**u - 1) / ln(growth)`` (``rate * u`` at 1), whole, at most 2**62.
- ``remap_pending``, ``remap_failed``, ``retired_pages_pending`` (default false): true
  turns that flag on from the onset.
- ``last_xid``: the XID code reported once ``xid_errors`` is above 0 (needs
  ``xid_errors_per_s``).

At least one counter or flag must be named. Anything else (an unknown key, a value of the
wrong type or out of range, text that is not a JSON object) fails the rank at its start with
a :class:`HealthInjectionError` naming the field.

What an injecting rank reports: its real reading with the injected counts added and the
flags set, and ``injected=True`` on every report. Without a real reading (no GPU, no NVML:
CPU tests) the reading is ``present=True, injected=True`` with the injected counters and
flags only; every other field stays None: nothing besides the injected numbers is made
up, and those say so. Unset (production), the reader is NVML's or none.

:func:`reader_for_rank` is the one seam: the Supervisor builds each rank's reader through it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...schemas.events import PRECURSOR_COUNTERS, PRECURSOR_FLAGS
from ..training.gpu_health import HealthReader, open_reader

ENV_INJECT_HEALTH = "TRAINGUARD_INJECT_HEALTH"

#: The counters a rate may be given for (GpuHealth's fields: the precursors the core's
#: hazard model reads as counts).
COUNTERS: tuple[str, ...] = PRECURSOR_COUNTERS
FLAGS: tuple[str, ...] = PRECURSOR_FLAGS
#: An injected count never passes this (the schemas' row check takes ints below 2**63).
MAX_COUNT = 2**62
_KEYS = frozenset({"ranks", "after_s", "growth", "last_xid", *FLAGS, *(f"{c}_per_s" for c in COUNTERS)})


class HealthInjectionError(ValueError):
    """TRAINGUARD_INJECT_HEALTH is malformed; the message names the field."""


@dataclass(frozen=True)
class HealthInjection:
    """A parsed TRAINGUARD_INJECT_HEALTH (module docstring)."""

    ranks: frozenset[int]
    rates: dict[str, float] = field(default_factory=dict)
    after_s: float = 0.0
    growth: float = 1.0
    flags: frozenset[str] = frozenset()
    last_xid: int | None = None

    def injects(self, rank: int) -> bool:
        return rank in self.ranks

    def count(self, rate: float, elapsed_s: float) -> int:
        """Events of a counter with `rate` per second at the onset, `elapsed_s` after the start."""
        u = elapsed_s - self.after_s
        if u <= 0 or rate <= 0:
            return 0
        if self.growth == 1.0:
            total = rate * u
        else:
            log_growth = math.log(self.growth)
            total = rate * math.expm1(min(u * log_growth, 700.0)) / log_growth
        return int(total) if total < MAX_COUNT else MAX_COUNT  # inf included

    def fields(self, elapsed_s: float) -> dict[str, Any]:
        """The injected counters and flags, `elapsed_s` seconds after the reader started."""
        out: dict[str, Any] = {name: self.count(rate, elapsed_s) for name, rate in self.rates.items()}
        on = elapsed_s >= self.after_s
        for name in self.flags:
            out[name] = on
        if self.last_xid is not None and out.get("xid_errors", 0) > 0:
            out["last_xid"] = self.last_xid
        return out


def _number(spec: dict[str, Any], key: str, default: float, low: float, above: bool = False) -> float:
    value = spec.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value < low or (above and value == low):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise HealthInjectionError(f"{ENV_INJECT_HEALTH}: {key!r} must be a number {bound}, got {value!r}")
    return float(value)


def parse(raw: str) -> HealthInjection:
    """A TRAINGUARD_INJECT_HEALTH value, checked field by field."""
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise HealthInjectionError(f"{ENV_INJECT_HEALTH}: not JSON ({exc}): {raw!r}") from None
    if not isinstance(spec, dict):
        raise HealthInjectionError(f"{ENV_INJECT_HEALTH}: expected a JSON object, got {raw!r}")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise HealthInjectionError(
            f"{ENV_INJECT_HEALTH}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})"
        )
    ranks = spec.get("ranks")
    if (
        not isinstance(ranks, list)
        or not ranks
        or any(type(r) is not int or r < 0 for r in ranks)  # bool is not a rank
    ):
        raise HealthInjectionError(
            f"{ENV_INJECT_HEALTH}: 'ranks' must be a non-empty list of ranks >= 0, got {ranks!r}"
        )
    rates = {c: _number(spec, f"{c}_per_s", 0.0, 0.0) for c in COUNTERS if f"{c}_per_s" in spec}
    flags = set()
    for name in FLAGS:
        value = spec.get(name, False)
        if type(value) is not bool:
            raise HealthInjectionError(f"{ENV_INJECT_HEALTH}: {name!r} must be true or false, got {value!r}")
        if value:
            flags.add(name)
    last_xid = spec.get("last_xid")
    if last_xid is not None:
        if type(last_xid) is not int or last_xid < 0:
            raise HealthInjectionError(
                f"{ENV_INJECT_HEALTH}: 'last_xid' must be an XID code >= 0, got {last_xid!r}"
            )
        if "xid_errors" not in rates:
            raise HealthInjectionError(f"{ENV_INJECT_HEALTH}: 'last_xid' needs 'xid_errors_per_s'")
    if not rates and not flags:
        raise HealthInjectionError(
            f"{ENV_INJECT_HEALTH}: names no counter (<counter>_per_s) and no flag: nothing to inject"
        )
    return HealthInjection(
        ranks=frozenset(ranks),
        rates=rates,
        after_s=_number(spec, "after_s", 0.0, 0.0),
        growth=_number(spec, "growth", 1.0, 0.0, above=True),
        flags=frozenset(flags),
        last_xid=last_xid,
    )


def from_env(env: Mapping[str, str] = os.environ) -> HealthInjection | None:
    """TRAINGUARD_INJECT_HEALTH parsed, or None when unset or empty."""
    raw = env.get(ENV_INJECT_HEALTH, "").strip()
    return parse(raw) if raw else None


class InjectedReader:
    """A rank's reader with the injection's counters on top of `real` (None: no device)."""

    def __init__(
        self,
        injection: HealthInjection,
        real: HealthReader | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.injection = injection
        self.real = real
        self.clock = clock
        self.started = clock()

    def sample(self) -> dict[str, Any]:
        injected = self.injection.fields(self.clock() - self.started)
        out: dict[str, Any] = {"present": True} if self.real is None else dict(self.real.sample())
        for name, value in injected.items():
            if name in self.injection.rates:
                out[name] = (out.get(name) or 0) + value
            else:
                out[name] = value  # a flag, last_xid
        for kind in ("corrected", "uncorrected"):  # a device's lifetime total holds its volatile count
            if f"ecc_{kind}" in self.injection.rates:
                total = f"ecc_{kind}_total"
                out[total] = (out.get(total) or 0) + injected[f"ecc_{kind}"]
        out["present"] = True
        out["injected"] = True
        return out

    def close(self) -> None:
        close = getattr(self.real, "close", None)
        if close is not None:
            close()


def reader_for_rank(
    rank: int,
    local_rank: int | None = None,
    env: Mapping[str, str] = os.environ,
    *,
    clock: Callable[[], float] = time.monotonic,
    open_device: Callable[[int | None], HealthReader | None] = open_reader,
) -> HealthReader | None:
    """The GPU health reader of global rank `rank`: NVML's for its device (None without
    one), wrapped in an :class:`InjectedReader` when TRAINGUARD_INJECT_HEALTH lists the
    rank. A malformed value raises :class:`HealthInjectionError` on every rank."""
    injection = from_env(env)
    real = open_device(local_rank)
    if injection is None or not injection.injects(rank):
        return real
    return InjectedReader(injection, real, clock)
