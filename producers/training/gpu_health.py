"""GPU and link health through NVML, sampled off the training thread.

NVML comes from the ``pynvml`` module of the ``nvidia-ml-py`` distribution (pinned in the
``train`` extra), used only if NVML initialises. Where there is no GPU (or no NVML
driver), the rank reports ``GpuHealth(present=False)`` once and nothing else: numbers are
never made up (seed R2's diagnosis reads these fields, and a fake "healthy" reading would
send it the wrong way). The one exception says so: the injection hook of tests and chaos
drills (``health_inject.py``, TRAINGUARD_INJECT_HEALTH) reports its counters with
``injected=True``.

What is read (GpuHealth v2): GPU and memory (HBM) temperature; SM clock against its
maximum, memory clock; power draw and the enforced limit; the active clock-event
(throttle) reasons by name, summarised as power_capped / thermal_throttle; ECC corrected
and uncorrected counts since the driver loaded (volatile) and over the device's life
(aggregate); NVLink links up against links present, replay + recovery errors and CRC
(flit + data) errors summed over links.

The failure precursors (GpuHealth v3, issue 46): memory pages retired for ECC errors
(``nvmlDeviceGetRetiredPages`` for both causes, counted; pre-Ampere) and whether a
retirement awaits a reset (``nvmlDeviceGetRetiredPagesPendingStatus``); HBM rows
remapped for correctable and uncorrectable errors, a remap pending and a remap failed
(``nvmlDeviceGetRemappedRows``; Ampere and later); the PCIe replay counter
(``nvmlDeviceGetPcieReplayCounter``); critical XID errors, from an NVML event set
registered for ``nvmlEventTypeXidCriticalError`` when the reader opens and drained
without waiting (``nvmlEventSetWait(set, 0)`` until it times out) at each sample:
``xid_errors`` counts the ones seen since the reader started, ``last_xid`` is the newest
code. A device or driver that refuses the registration leaves both None.

Which GPU: the rank's CUDA device, found in NVML by UUID (NVML ignores
CUDA_VISIBLE_DEVICES, so indices differ between the two), else by LOCAL_RANK.

Every reading is independent: a field the GPU does not support (NVLink on a PCIe card,
ECC off, row remapping before Ampere, a call older pynvml lacks) is None, not an error.
NVML calls take around a millisecond each, so sampling runs on :class:`GpuHealthSampler`'s
own thread every `interval_s` (default 30 s; TRAINGUARD_GPU_HEALTH_INTERVAL_S).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: NVML clock-event (throttle) reason bits, from nvml.h (stable across NVML versions).
_POWER_CAP = 0x0000000000000004  # SwPowerCap
_HW_POWER_BRAKE = 0x0000000000000080  # HwPowerBrakeSlowdown
_SW_THERMAL = 0x0000000000000020  # SwThermalSlowdown
_HW_THERMAL = 0x0000000000000040  # HwThermalSlowdown
#: Every reason bit by the name GpuHealth.throttle_reasons uses (nvml.h order).
THROTTLE_REASONS = (
    (0x0000000000000001, "gpu_idle"),
    (0x0000000000000002, "applications_clocks_setting"),
    (_POWER_CAP, "sw_power_cap"),
    (0x0000000000000008, "hw_slowdown"),
    (0x0000000000000010, "sync_boost"),
    (_SW_THERMAL, "sw_thermal_slowdown"),
    (_HW_THERMAL, "hw_thermal_slowdown"),
    (_HW_POWER_BRAKE, "hw_power_brake_slowdown"),
    (0x0000000000000100, "display_clock_setting"),
)
_MAX_NVLINKS = 18  # NVML_NVLINK_MAX_LINKS on Hopper
_FI_DEV_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP
#: c_nvmlValue_t's member for each NVML_VALUE_TYPE_* (double, uint, ulong, ulonglong, longlong, int, ushort).
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
#: NVML_PAGE_RETIREMENT_CAUSE_*: multiple single-bit ECC errors, a double-bit ECC error.
_RETIREMENT_CAUSES = (
    ("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
    ("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
)
_XID_CRITICAL = 0x0000000000000008  # nvmlEventTypeXidCriticalError
#: XID events drained per sample at most (a storm is counted over the next samples).
_MAX_XIDS_PER_SAMPLE = 1000


class HealthReader(Protocol):
    """Reads one GPU's health: GpuHealth fields (present included)."""

    def sample(self) -> dict[str, Any]: ...


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: the field stays unknown
        return None


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.<name>(*args)``, or None when it fails or this pynvml has no such function."""
    fn = getattr(nvml, name, None)
    return None if fn is None else _try(fn, *args)


class NvmlReader:
    """One device through pynvml. Build it with :func:`open_reader`."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        #: Critical XID events seen since the reader started, and the newest one's code.
        self.xid_errors = 0
        self.last_xid: int | None = None
        self._xid_kind = int(getattr(nvml, "nvmlEventTypeXidCriticalError", _XID_CRITICAL))
        self._events = self._register_xids()

    def sample(self) -> dict[str, Any]:
        n, h = self.nvml, self.handle
        out: dict[str, Any] = {"present": True}
        out["temperature_c"] = _float(_try(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU))
        out["memory_temperature_c"] = self._field(getattr(n, "NVML_FI_DEV_MEMORY_TEMP", _FI_DEV_MEMORY_TEMP))
        out["sm_clock_mhz"] = _float(_try(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM))
        out["sm_clock_max_mhz"] = _float(_try(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM))
        out["memory_clock_mhz"] = _float(_try(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM))
        power_mw = _try(n.nvmlDeviceGetPowerUsage, h)  # milliwatts
        limit_mw = _try(n.nvmlDeviceGetEnforcedPowerLimit, h)
        out["power_w"] = None if power_mw is None else float(power_mw) / 1000.0
        out["power_limit_w"] = None if limit_mw is None else float(limit_mw) / 1000.0
        reasons_fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            n, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = _try(reasons_fn, h) if reasons_fn is not None else None
        if reasons is not None:
            reasons = int(reasons)
            out["power_capped"] = bool(reasons & (_POWER_CAP | _HW_POWER_BRAKE))
            out["thermal_throttle"] = bool(reasons & (_SW_THERMAL | _HW_THERMAL))
            out["throttle_reasons"] = [name for bit, name in THROTTLE_REASONS if reasons & bit]
        out.update(self._nvlink())
        for key, kind in (("corrected", "CORRECTED"), ("uncorrected", "UNCORRECTED")):
            error_type = getattr(n, f"NVML_MEMORY_ERROR_TYPE_{kind}")
            volatile = _try(n.nvmlDeviceGetTotalEccErrors, h, error_type, n.NVML_VOLATILE_ECC)
            lifetime = _try(n.nvmlDeviceGetTotalEccErrors, h, error_type, n.NVML_AGGREGATE_ECC)
            out[f"ecc_{key}"] = None if volatile is None else int(volatile)
            out[f"ecc_{key}_total"] = None if lifetime is None else int(lifetime)
        out.update(self._memory())
        replays = _call(n, "nvmlDeviceGetPcieReplayCounter", h)
        out["pcie_replays"] = None if replays is None else int(replays)
        out.update(self._xids())
        return out

    def _memory(self) -> dict[str, Any]:
        """Retired pages (both causes, counted) and their pending flag; remapped rows."""
        n, h = self.nvml, self.handle
        out: dict[str, Any] = {}
        pages = [
            _call(n, "nvmlDeviceGetRetiredPages", h, getattr(n, name, cause))
            for name, cause in _RETIREMENT_CAUSES
        ]
        # One cause unread would make the sum a guess: both or nothing.
        out["retired_pages"] = None if any(p is None for p in pages) else sum(len(p) for p in pages)
        pending = _call(n, "nvmlDeviceGetRetiredPagesPendingStatus", h)
        out["retired_pages_pending"] = None if pending is None else bool(int(pending))
        rows = _call(n, "nvmlDeviceGetRemappedRows", h)  # (corrRows, uncRows, isPending, failureOccurred)
        if rows is not None and len(rows) == 4:
            correctable, uncorrectable, remap_pending, remap_failed = (int(v) for v in rows)
            out["remapped_rows_correctable"] = correctable
            out["remapped_rows_uncorrectable"] = uncorrectable
            out["remap_pending"] = bool(remap_pending)
            out["remap_failed"] = bool(remap_failed)
        return out

    def _register_xids(self) -> Any:
        """An NVML event set this device's critical XID errors go to, or None when the
        device, driver or pynvml cannot register one (xid_errors then stays None)."""
        n = self.nvml
        if not hasattr(n, "nvmlDeviceRegisterEvents"):
            return None
        events = _call(n, "nvmlEventSetCreate")
        if events is None:
            return None
        try:
            n.nvmlDeviceRegisterEvents(self.handle, self._xid_kind, events)
        except Exception as exc:  # NotSupported on some devices and in some containers
            log.info("NVML XID events unavailable (%s): xid_errors reported as unknown", exc)
            _call(n, "nvmlEventSetFree", events)
            return None
        return events

    def _xids(self) -> dict[str, Any]:
        """Drains the XID events that came since the last sample, without waiting."""
        if self._events is None:
            return {"xid_errors": None, "last_xid": None}
        for _ in range(_MAX_XIDS_PER_SAMPLE):
            try:
                data = self.nvml.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVMLError_Timeout: none left (any other error: next sample)
                break
            if int(getattr(data, "eventType", self._xid_kind)) & self._xid_kind:
                self.xid_errors += 1
                self.last_xid = int(data.eventData)
        return {"xid_errors": self.xid_errors, "last_xid": self.last_xid}

    def close(self) -> None:
        """Frees the XID event set (NVML frees it at the process's end anyway)."""
        events, self._events = self._events, None
        if events is not None:
            _call(self.nvml, "nvmlEventSetFree", events)

    def _field(self, field_id: int) -> float | None:
        """One NVML field value (nvmlDeviceGetFieldValues), or None if not supported."""
        values = _try(self.nvml.nvmlDeviceGetFieldValues, self.handle, [field_id])
        if not values or getattr(values[0], "nvmlReturn", 1) != 0:
            return None
        value = values[0]
        kind = int(getattr(value, "valueType", 1))
        member = _VALUE_MEMBERS[kind] if 0 <= kind < len(_VALUE_MEMBERS) else "uiVal"
        return _float(getattr(value.value, member, None))

    def _nvlink(self) -> dict[str, Any]:
        """Active links (width), links the device has (expected), and replay + recovery
        error counts summed over links (retries)."""
        n, h = self.nvml, self.handle
        links = active = 0
        sums: dict[str, int | None] = {"nvlink_retries": None, "nvlink_crc_errors": None}
        counters = (
            ("nvlink_retries", "NVML_NVLINK_ERROR_DL_REPLAY"),
            ("nvlink_retries", "NVML_NVLINK_ERROR_DL_RECOVERY"),
            ("nvlink_crc_errors", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
            ("nvlink_crc_errors", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
        )
        for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", _MAX_NVLINKS)):
            state = _try(n.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                continue
            links += 1
            active += int(state == getattr(n, "NVML_FEATURE_ENABLED", 1))
            for key, counter in counters:
                if hasattr(n, counter):
                    value = _try(n.nvmlDeviceGetNvLinkErrorCounter, h, link, getattr(n, counter))
                    if value is not None:
                        sums[key] = (sums[key] or 0) + int(value)
        if not links:
            return {}
        return {"nvlink_width": active, "nvlink_expected_width": links, **sums}


def _cuda_uuid() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
        return str(uuid)
    except Exception:
        return None


def open_reader(local_rank: int | None = None) -> NvmlReader | None:
    """An NVML reader for this rank's GPU, or None where there is no GPU or no NVML."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        log.info("NVML unavailable (%s): GPU health reported as absent", exc)
        return None
    if not count:
        return None
    uuid = _cuda_uuid()
    if uuid:
        for candidate in (uuid, f"GPU-{uuid}"):
            handle = _try(pynvml.nvmlDeviceGetHandleByUUID, candidate)
            if handle is not None:
                return NvmlReader(pynvml, handle)
    index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
    handle = _try(pynvml.nvmlDeviceGetHandleByIndex, index % count)
    return None if handle is None else NvmlReader(pynvml, handle)


class GpuHealthSampler:
    """Emits GpuHealth through `emit` (the agent's ``gpu_health``): every `interval_s` on
    its own daemon thread with a reader, or ``present=False`` once without one."""

    def __init__(
        self,
        emit: Callable[..., None],
        reader: HealthReader | None,
        interval_s: float = 30.0,
    ) -> None:
        self.emit = emit
        self.reader = reader
        self.interval_s = interval_s
        self.samples = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuHealthSampler:
        if self.reader is None:
            self.emit(present=False)
            self.samples += 1
            return self
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainguard-gpu-health", daemon=True)
            self._thread.start()
        return self

    def sample_once(self) -> None:
        if self.reader is None:
            return
        try:
            fields = self.reader.sample()
        except Exception:
            self.errors += 1
            log.exception("GPU health sample failed")
            return
        self.emit(**fields)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        close = getattr(self.reader, "close", None)
        if close is not None and (self._thread is None or not self._thread.is_alive()):
            _try(close)
