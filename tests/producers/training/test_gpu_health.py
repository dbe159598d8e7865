"""GPU health through NVML (issue 15 item 7; the precursors of issue 46), with NVML patched
at the library's boundary: a fake ``pynvml`` module holding the functions and constants the
reader uses, shaped like nvidia-ml-py's (errors raised, milliwatts, clock-event bit masks,
field-value structs, retired page lists, the remapped rows' 4-tuple, an event set whose
wait raises a timeout when it is empty)."""

from __future__ import annotations

import sys
import types
from collections import deque
from typing import Any

import orjson
import pytest

from trainguard.producers.rank.agent import MemorySink, RankAgent
from trainguard.producers.training.gpu_health import GpuHealthSampler, NvmlReader, open_reader
from trainguard.schemas import GpuHealth, encode, event_check
from trainguard.schemas.codec import event_of

ENVELOPE: dict[str, Any] = dict(event_id="e", run_id="r", attempt=0, rank=1, node="node-0000", step=7, ts=1.0)


class NVMLError(Exception):
    """pynvml raises NVMLError subclasses (NotSupported, LibraryNotFound, ...)."""


def not_supported(*_: Any) -> Any:
    raise NVMLError("Not Supported")


class NVMLTimeout(NVMLError):
    """nvmlEventSetWait's NVMLError_Timeout: no event came within the wait."""


XID = 0x8  # nvmlEventTypeXidCriticalError


class EventSet:
    """An NVML event set: the XID codes the driver has queued for it, oldest first."""

    def __init__(self) -> None:
        self.pending: deque[int] = deque()
        self.registered: list[tuple[Any, int]] = []
        self.waits = 0
        self.freed = False
        #: Errors the next waits raise instead of answering (not a timeout).
        self.failures: deque[Exception] = deque()

    def wait(self, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # a sample never blocks on events
        self.waits += 1
        if self.failures:
            raise self.failures.popleft()
        if not self.pending:
            raise NVMLTimeout("Timeout")
        return types.SimpleNamespace(device="gpu1", eventType=XID, eventData=self.pending.popleft())


#: What the default fake device reports beyond v2: a remap pending, two single-bit page
#: retirements and one double-bit, a retirement pending, PCIe replays.
PRECURSORS = dict(
    retired_pages=3, retired_pages_pending=True, remapped_rows_correctable=5, remapped_rows_uncorrectable=1,
    remap_pending=True, remap_failed=False, pcie_replays=12, xid_errors=0, last_xid=None,
)  # fmt: skip


def fake_nvml(**overrides: Any) -> types.ModuleType:
    """An H100-like SXM device 1 of 2: hot HBM, thermal slowdown, 17 of 18 NVLinks up."""
    m = types.ModuleType("pynvml")
    consts = dict(
        NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_FI_DEV_MEMORY_TEMP=82,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1, NVML_NVLINK_MAX_LINKS=18, NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2, NVML_NVLINK_ERROR_DL_CRC_DATA=3,
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        nvmlEventTypeXidCriticalError=XID,
    )  # fmt: skip
    for name, value in consts.items():
        setattr(m, name, value)
    handles = {0: "gpu0", 1: "gpu1"}
    ecc = {(0, 0): 3, (1, 0): 0, (0, 1): 41, (1, 1): 1}  # (type, counter) -> count

    def register_events(handle: str, kinds: int, events: EventSet) -> None:
        events.registered.append((handle, kinds))

    def free_events(events: EventSet) -> None:
        events.freed = True

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
        nvmlDeviceGetRetiredPages=lambda h, cause: {0: [0x1000, 0x2000], 1: [0x9000]}[cause],
        nvmlDeviceGetRetiredPagesPendingStatus=lambda h: 1,
        nvmlDeviceGetRemappedRows=lambda h: (5, 1, 1, 0),  # corrRows, uncRows, isPending, failureOccurred
        nvmlDeviceGetPcieReplayCounter=lambda h: 12,
        nvmlEventSetCreate=EventSet,
        nvmlDeviceRegisterEvents=register_events,
        nvmlEventSetWait=lambda events, timeout_ms: events.wait(timeout_ms),
        nvmlEventSetFree=free_events,
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


# ------------------------------------------------------------------ the precursors (issue 46)
def reader_of(monkeypatch: pytest.MonkeyPatch, nvml: types.ModuleType) -> NvmlReader:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    reader = open_reader(local_rank=1)
    assert reader is not None
    return reader


def precursors(health: GpuHealth) -> dict[str, Any]:
    return {name: getattr(health, name) for name in PRECURSORS}


def test_remapped_rows_retired_pages_and_pcie_replays_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    health = sample(monkeypatch, fake_nvml())
    assert health.VERSION == 3 and health.injected is None  # a device's reading, not the hook's
    assert precursors(health) == PRECURSORS


def test_a_failed_remap_and_no_pending_retirement(monkeypatch: pytest.MonkeyPatch) -> None:
    health = sample(
        monkeypatch,
        fake_nvml(
            nvmlDeviceGetRemappedRows=lambda h: (0, 7, 0, 1),
            nvmlDeviceGetRetiredPagesPendingStatus=lambda h: 0,
            nvmlDeviceGetRetiredPages=lambda h, cause: [],
        ),
    )
    assert (health.remapped_rows_correctable, health.remapped_rows_uncorrectable) == (0, 7)
    assert (health.remap_pending, health.remap_failed) == (False, True)
    assert (health.retired_pages, health.retired_pages_pending) == (0, False)


def one_cause_unsupported(h: Any, cause: int) -> list[int]:
    if cause == 1:
        raise NVMLError("Not Supported")
    return [0x1000]


#: Each new NVML call, unsupported, and the fields it alone leaves unknown.
UNSUPPORTED = [
    ("nvmlDeviceGetRemappedRows", not_supported,
     ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failed")),
    ("nvmlDeviceGetRetiredPages", not_supported, ("retired_pages",)),
    ("nvmlDeviceGetRetiredPages", one_cause_unsupported, ("retired_pages",)),  # half a sum is a guess
    ("nvmlDeviceGetRetiredPagesPendingStatus", not_supported, ("retired_pages_pending",)),
    ("nvmlDeviceGetPcieReplayCounter", not_supported, ("pcie_replays",)),
    ("nvmlEventSetCreate", not_supported, ("xid_errors", "last_xid")),
    ("nvmlDeviceRegisterEvents", not_supported, ("xid_errors", "last_xid")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "fn", "unknown"), UNSUPPORTED, ids=[f"{u[0]}-{u[1].__name__}" for u in UNSUPPORTED]
)
def test_each_precursor_call_not_supported_leaves_its_fields_none_and_the_rest_read(
    monkeypatch: pytest.MonkeyPatch, name: str, fn: Any, unknown: tuple[str, ...]
) -> None:
    health = sample(monkeypatch, fake_nvml(**{name: fn}))
    expected = {k: (None if k in unknown else v) for k, v in PRECURSORS.items()}
    assert precursors(health) == expected
    assert (health.ecc_corrected, health.temperature_c, health.nvlink_width) == (3, 84.0, 17)  # v2 still read


#: A pynvml too old for a call (nvidia-ml-py added them over the years), and what it leaves unknown.
MISSING = [
    ("nvmlDeviceGetRemappedRows", UNSUPPORTED[0][2]),
    ("nvmlDeviceGetRetiredPages", ("retired_pages",)),
    ("nvmlDeviceGetRetiredPagesPendingStatus", ("retired_pages_pending",)),
    ("nvmlDeviceGetPcieReplayCounter", ("pcie_replays",)),
    ("nvmlEventSetCreate", ("xid_errors", "last_xid")),
    ("nvmlDeviceRegisterEvents", ("xid_errors", "last_xid")),
]


@pytest.mark.parametrize(("missing", "unknown"), MISSING, ids=[m[0] for m in MISSING])
def test_an_older_pynvml_without_a_call_reads_the_rest(
    monkeypatch: pytest.MonkeyPatch, missing: str, unknown: tuple[str, ...]
) -> None:
    nvml = fake_nvml()
    delattr(nvml, missing)
    for constant in ("nvmlEventTypeXidCriticalError", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"):
        delattr(nvml, constant)  # nvml.h's values stand in
    health = sample(monkeypatch, nvml)
    assert precursors(health) == {k: (None if k in unknown else v) for k, v in PRECURSORS.items()}


def test_a_refused_xid_registration_frees_its_event_set(monkeypatch: pytest.MonkeyPatch) -> None:
    sets: list[EventSet] = []

    def create() -> EventSet:
        sets.append(EventSet())
        return sets[-1]

    reader = reader_of(
        monkeypatch, fake_nvml(nvmlEventSetCreate=create, nvmlDeviceRegisterEvents=not_supported)
    )
    assert reader.sample()["xid_errors"] is None and sets[0].freed and sets[0].waits == 0


def test_xid_events_are_counted_across_samples_with_the_newest_code(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = reader_of(monkeypatch, fake_nvml())
    events: EventSet = reader._events
    assert events.registered == [("gpu1", XID)]  # this rank's device, critical XIDs only
    assert (reader.sample()["xid_errors"], reader.sample()["last_xid"]) == (0, None)
    events.pending.extend([79, 48])  # fell off the bus, then a double-bit ECC error
    first = reader.sample()
    assert (first["xid_errors"], first["last_xid"]) == (2, 48)
    events.pending.append(94)
    second = reader.sample()
    assert (second["xid_errors"], second["last_xid"]) == (3, 94)
    quiet = reader.sample()  # none new: the count and the last code stay
    assert (quiet["xid_errors"], quiet["last_xid"]) == (3, 94)
    GpuHealth(**ENVELOPE, **quiet)


def test_xid_polling_survives_a_failing_wait_and_drains_a_storm_over_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader = reader_of(monkeypatch, fake_nvml())
    events: EventSet = reader._events
    events.pending.extend([13, 31])
    events.failures.append(NVMLError("Unknown Error"))  # not a timeout: this sample stops draining
    assert reader.sample()["xid_errors"] == 0
    assert reader.sample()["xid_errors"] == 2  # the next one reads them
    events.pending.extend([43] * 1500)  # a storm: at most 1000 per sample, none lost
    assert reader.sample()["xid_errors"] == 1002
    assert reader.sample()["xid_errors"] == 1502 and not events.pending


def test_the_sampler_frees_the_event_set_when_it_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = reader_of(monkeypatch, fake_nvml())
    events: EventSet = reader._events
    emitted: list[dict[str, Any]] = []
    sampler = GpuHealthSampler(lambda **fields: emitted.append(fields), reader, interval_s=60)
    sampler.sample_once()
    sampler.start().stop()
    assert emitted[0]["xid_errors"] == 0 and events.freed
    assert reader.sample()["xid_errors"] is None  # closed: no longer polled


def test_a_v3_report_from_the_reader_takes_the_quiet_row_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    reader = reader_of(monkeypatch, fake_nvml())
    reader._events.pending.append(79)
    sink = MemorySink()
    RankAgent(sink, "r", attempt=0, rank=1, node="node-0000").gpu_health(**reader.sample())
    (event,) = sink.of(GpuHealth)
    item = orjson.loads(encode(event))
    assert item["schema"] == "gpu_health/3" and item["xid_errors"] == 1 and item["remap_pending"] is True
    row = event_check.common_row(item, "r", 2)
    assert row is not None, "a reader's v3 report fell off the fast path"
    assert event_of(row) == event
