"""GPU health through NVML (issue 15 item 7), with NVML patched at the library's boundary:
a fake ``pynvml`` module holding the functions and constants the reader uses, shaped like
nvidia-ml-py's (errors raised, milliwatts, clock-event bit masks, field-value structs)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from trainguard.producers.training.gpu_health import GpuHealthSampler, open_reader
from trainguard.schemas import GpuHealth

ENVELOPE: dict[str, Any] = dict(event_id="e", run_id="r", attempt=0, rank=1, node="node-0000", step=7, ts=1.0)


class NVMLError(Exception):
    """pynvml raises NVMLError subclasses (NotSupported, LibraryNotFound, ...)."""


def not_supported(*_: Any) -> Any:
    raise NVMLError("Not Supported")


def fake_nvml(**overrides: Any) -> types.ModuleType:
    """An H100-like SXM device 1 of 2: hot HBM, thermal slowdown, 17 of 18 NVLinks up."""
    m = types.ModuleType("pynvml")
    consts = dict(
        NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_FI_DEV_MEMORY_TEMP=82,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1, NVML_NVLINK_MAX_LINKS=18, NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2, NVML_NVLINK_ERROR_DL_CRC_DATA=3,
    )  # fmt: skip
    for name, value in consts.items():
        setattr(m, name, value)
    handles = {0: "gpu0", 1: "gpu1"}
    ecc = {(0, 0): 3, (1, 0): 0, (0, 1): 41, (1, 1): 1}  # (type, counter) -> count

    def field_values(handle: str, ids: list[int]) -> list[Any]:
        assert ids == [82]
        value = types.SimpleNamespace(uiVal=88, dVal=0.0)
        return [types.SimpleNamespace(fieldId=82, nvmlReturn=0, valueType=1, value=value)]

    functions = dict(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByUUID=not_supported,  # no CUDA here: found by LOCAL_RANK
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetTemperature=lambda h, sensor: 84,
        nvmlDeviceGetFieldValues=field_values,
        nvmlDeviceGetClockInfo=lambda h, clock: {1: 1410, 2: 2619}[clock],
        nvmlDeviceGetMaxClockInfo=lambda h, clock: 1980,
        nvmlDeviceGetPowerUsage=lambda h: 612_500,  # milliwatts
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x20 | 0x40 | 0x8,  # sw + hw thermal, hw slowdown
        nvmlDeviceGetNvLinkState=lambda h, link: 0 if link == 5 else 1,
        nvmlDeviceGetNvLinkErrorCounter=lambda h, link, counter: (
            {0: 2, 1: 0, 2: 1, 3: 0}[counter] * (link == 5)
        ),
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: ecc[(kind, counter)],
    )
    functions.update(overrides)
    for name, fn in functions.items():
        setattr(m, name, fn)
    return m


def sample(monkeypatch: pytest.MonkeyPatch, nvml: types.ModuleType) -> GpuHealth:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    reader = open_reader(local_rank=1)
    assert reader is not None and reader.handle == "gpu1"
    return GpuHealth(**ENVELOPE, **reader.sample())


def test_a_hot_throttled_gpu_reports_temperatures_clocks_reasons_ecc_and_nvlink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    health = sample(monkeypatch, fake_nvml())
    assert health.present and (health.temperature_c, health.memory_temperature_c) == (84.0, 88.0)
    assert (health.sm_clock_mhz, health.sm_clock_max_mhz, health.memory_clock_mhz) == (1410.0, 1980.0, 2619.0)
    assert (health.power_w, health.power_limit_w) == (612.5, 700.0)
    assert health.throttle_reasons == ["hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert health.thermal_throttle is True and health.power_capped is False
    assert (health.ecc_corrected, health.ecc_uncorrected) == (3, 0)
    assert (health.ecc_corrected_total, health.ecc_uncorrected_total) == (41, 1)
    assert (health.nvlink_width, health.nvlink_expected_width) == (17, 18)
    assert (health.nvlink_retries, health.nvlink_crc_errors) == (2, 1)  # link 5: replays, a CRC flit


def test_what_a_pcie_card_without_ecc_does_not_support_is_absent_not_guessed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_field = lambda h, ids: [types.SimpleNamespace(nvmlReturn=3, valueType=1, value=None)]  # noqa: E731
    health = sample(
        monkeypatch,
        fake_nvml(
            nvmlDeviceGetNvLinkState=not_supported,
            nvmlDeviceGetTotalEccErrors=not_supported,
            nvmlDeviceGetFieldValues=no_field,
            nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0,
            nvmlDeviceGetPowerUsage=not_supported,
        ),
    )
    assert health.present and health.temperature_c == 84.0 and health.memory_temperature_c is None
    assert health.throttle_reasons == [] and health.thermal_throttle is False
    for name in (
        "nvlink_width",
        "nvlink_expected_width",
        "nvlink_retries",
        "nvlink_crc_errors",
        "ecc_corrected",
    ):
        assert getattr(health, name) is None, name
    assert health.ecc_uncorrected_total is None and health.power_w is None and health.power_limit_w == 700.0


def test_no_driver_means_present_false_once_and_no_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise NVMLError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(nvmlInit=no_library))
    assert open_reader(local_rank=0) is None
    emitted: list[dict[str, Any]] = []
    sampler = GpuHealthSampler(lambda **fields: emitted.append(fields), open_reader()).start()
    sampler.sample_once()
    sampler.stop()
    assert emitted == [{"present": False}]


def test_the_real_library_on_this_gpu_less_host_is_honestly_absent() -> None:
    pytest.importorskip("pynvml")  # nvidia-ml-py, pinned in the train extra
    assert open_reader(local_rank=0) is None  # no NVIDIA driver here: no reader, no exception
