"""The GPU health injection hook (issue 46): TRAINGUARD_INJECT_HEALTH's format and its errors,
which ranks inject, counts that rise on an injected clock, the injected flag, and the
reports as GpuHealth v3 through the rank agent, the codec and the quiet-row fast path."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from trainguard.producers.chaos.health_inject import (
    COUNTERS,
    ENV_INJECT_HEALTH,
    MAX_COUNT,
    HealthInjectionError,
    InjectedReader,
    parse,
    reader_for_rank,
)
from trainguard.producers.rank.agent import MemorySink, RankAgent
from trainguard.producers.training.config import SupervisorConfig
from trainguard.producers.training.supervisor import Supervisor
from trainguard.schemas import GpuHealth, encode, event_check
from trainguard.schemas.codec import event_of


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Device:
    """A real reader's reading (what NvmlReader returns on a GPU), counted."""

    def __init__(self) -> None:
        self.samples = 0
        self.closed = False

    def sample(self) -> dict[str, Any]:
        self.samples += 1
        return {"present": True, "temperature_c": 61.0, "ecc_corrected": 3, "ecc_corrected_total": 41,
                "remap_pending": False, "xid_errors": 0, "last_xid": None}  # fmt: skip

    def close(self) -> None:
        self.closed = True


def env(**spec: Any) -> dict[str, str]:
    return {ENV_INJECT_HEALTH: json.dumps(spec)}


def injected(rank: int, spec: dict[str, Any], device: Device | None = None) -> tuple[InjectedReader, Clock]:
    clock = Clock()
    reader = reader_for_rank(rank, env=env(**spec), clock=clock, open_device=lambda local_rank: device)
    assert isinstance(reader, InjectedReader)
    return reader, clock


def health(fields: dict[str, Any], rank: int = 1) -> GpuHealth:
    sink = MemorySink()
    agent = RankAgent(sink, "r", attempt=0, rank=rank, node="node-0001")
    agent.gpu_health(**fields)
    assert agent.invalid == 0, "the agent refused the report"
    (event,) = sink.of(GpuHealth)
    return event


# ------------------------------------------------------------------ the format
BAD = [
    ("{not json", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"ranks": [1], "ecc_corrected_per_s": 40, "grwoth": 1.5}', "'grwoth'"),
    ('{"ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": [], "ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": 1, "ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": [-1], "ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": [true], "ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": ["1"], "ecc_corrected_per_s": 40}', "'ranks'"),
    ('{"ranks": [1], "ecc_corrected_per_s": -1}', "'ecc_corrected_per_s'"),
    ('{"ranks": [1], "ecc_corrected_per_s": "40"}', "'ecc_corrected_per_s'"),
    ('{"ranks": [1], "xid_errors_per_s": NaN}', "'xid_errors_per_s'"),
    ('{"ranks": [1], "ecc_corrected_per_s": 40, "growth": 0}', "'growth'"),
    ('{"ranks": [1], "ecc_corrected_per_s": 40, "growth": true}', "'growth'"),
    ('{"ranks": [1], "ecc_corrected_per_s": 40, "after_s": -5}', "'after_s'"),
    ('{"ranks": [1], "remap_pending": "yes"}', "'remap_pending'"),
    ('{"ranks": [1], "ecc_corrected_per_s": 1, "last_xid": 79}', "'last_xid' needs 'xid_errors_per_s'"),
    ('{"ranks": [1], "xid_errors_per_s": 1, "last_xid": -79}', "'last_xid'"),
    ('{"ranks": [1], "after_s": 5}', "names no counter"),
]


@pytest.mark.parametrize(("raw", "named"), BAD, ids=[b[1] for b in BAD])
def test_a_malformed_value_is_refused_naming_the_field(raw: str, named: str) -> None:
    with pytest.raises(HealthInjectionError, match=ENV_INJECT_HEALTH) as caught:
        parse(raw)
    assert named in str(caught.value)
    with pytest.raises(HealthInjectionError):  # on every rank, listed or not: before any NVML
        reader_for_rank(7, env={ENV_INJECT_HEALTH: raw}, open_device=lambda lr: pytest.fail("opened NVML"))


def test_a_full_value_parses() -> None:
    spec = parse(
        '{"ranks": [1, 3], "after_s": 5, "growth": 1.5, "ecc_corrected_per_s": 40, "xid_errors_per_s": 0.5,'
        ' "last_xid": 79, "remap_pending": true, "remap_failed": false}'
    )
    assert spec.ranks == {1, 3} and (spec.after_s, spec.growth, spec.last_xid) == (5.0, 1.5, 79)
    assert spec.rates == {"ecc_corrected": 40.0, "xid_errors": 0.5} and spec.flags == {"remap_pending"}


def test_a_malformed_value_fails_the_rank_at_its_start_before_any_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_INJECT_HEALTH, '{"ranks": [1], "ecc_corrected_per_s": 40, "after": 5}')
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(HealthInjectionError, match="unknown field 'after'"):
        Supervisor("run-i", rank=0, world_size=2, sink=MemorySink(), run_dir=tmp_path)
    assert {t.ident for t in threading.enumerate()} == before  # no heartbeat ticker left behind


# ------------------------------------------------------------------ which ranks
def test_only_the_listed_ranks_inject() -> None:
    device = Device()
    spec = env(ranks=[1, 3], ecc_corrected_per_s=40)
    for rank in (0, 2, 4):
        assert reader_for_rank(rank, env=spec, open_device=lambda lr: device) is device
        assert reader_for_rank(rank, env=spec, open_device=lambda lr: None) is None  # CPU: absent
    for rank in (1, 3):
        assert isinstance(reader_for_rank(rank, env=spec, open_device=lambda lr: device), InjectedReader)
        assert isinstance(reader_for_rank(rank, env=spec, open_device=lambda lr: None), InjectedReader)
    assert reader_for_rank(1, env={}, open_device=lambda lr: device) is device  # unset: production
    assert reader_for_rank(1, env={ENV_INJECT_HEALTH: " "}, open_device=lambda lr: device) is device


def test_the_device_is_opened_for_the_given_local_rank() -> None:
    opened: list[int | None] = []
    reader_for_rank(1, 3, env=env(ranks=[1], pcie_replays_per_s=1), open_device=lambda lr: opened.append(lr))
    assert opened == [3]


# ------------------------------------------------------------------ rising counts
def test_counts_are_zero_until_the_onset_then_rise_faster_each_second() -> None:
    reader, clock = injected(1, {"ranks": [1], "after_s": 5, "ecc_corrected_per_s": 40, "growth": 1.5})
    counts = []
    for _ in range(16):
        counts.append(reader.sample()["ecc_corrected"])
        clock.now += 1.0
    assert counts[:6] == [0] * 6  # t = 0..5 s: before the onset
    steps = [b - a for a, b in zip(counts[5:], counts[6:], strict=False)]
    assert all(s > 0 for s in steps) and all(b > a for a, b in zip(steps, steps[1:], strict=False))
    assert 38 <= steps[0] <= 62  # ~40 per second at the onset ...
    for a, b in zip(steps[3:], steps[4:], strict=False):
        assert b / a == pytest.approx(1.5, rel=0.02)  # ... and the rate x1.5 each second after


def test_steady_rates_without_growth_and_several_counters() -> None:
    spec = {"ranks": [2], "after_s": 2, "ecc_corrected_per_s": 40, "pcie_replays_per_s": 2.5,
            "remapped_rows_correctable_per_s": 0.5}  # fmt: skip
    reader, clock = injected(2, spec)
    clock.now += 12.0  # 10 s past the onset
    out = reader.sample()
    assert (out["ecc_corrected"], out["pcie_replays"], out["remapped_rows_correctable"]) == (400, 25, 5)
    assert out["ecc_corrected_total"] == 400  # a device's lifetime count holds its volatile one


def test_a_count_never_passes_the_cap_however_long_it_runs() -> None:
    reader, clock = injected(1, {"ranks": [1], "ecc_corrected_per_s": 1e6, "growth": 2.0})
    clock.now += 1e7
    out = reader.sample()
    assert out["ecc_corrected"] == MAX_COUNT
    assert event_check.common_row(orjson.loads(encode(health(out))), "r", 2) is not None


def test_flags_turn_on_at_the_onset_and_the_xid_code_with_the_first_xid() -> None:
    spec = {"ranks": [1], "after_s": 3, "xid_errors_per_s": 1, "last_xid": 79, "remap_failed": True}
    reader, clock = injected(1, spec)
    before = reader.sample()
    assert (before["remap_failed"], before["xid_errors"], before.get("last_xid")) == (False, 0, None)
    clock.now += 3.5
    assert reader.sample()["remap_failed"] is True and reader.sample().get("last_xid") is None  # 0.5 XIDs
    clock.now += 1.0
    after = reader.sample()
    assert (after["xid_errors"], after["last_xid"]) == (1, 79)


# ------------------------------------------------------------------ what is reported
def test_without_a_device_only_the_injected_numbers_are_set_and_say_so() -> None:
    reader, clock = injected(1, {"ranks": [1], "ecc_corrected_per_s": 40, "remap_pending": True})
    clock.now += 2.0
    event = health(reader.sample())
    assert event.schema_name() == "gpu_health/3"
    assert (event.present, event.injected, event.ecc_corrected, event.ecc_corrected_total) == (
        True,
        True,
        80,
        80,
    )
    assert event.remap_pending is True
    reported = {"present", "injected", "ecc_corrected", "ecc_corrected_total", "remap_pending"}
    envelope = {"event_id", "run_id", "attempt", "rank", "node", "step", "ts"}
    made_up = {k: v for k, v in event.model_dump().items() if v is not None and k not in reported | envelope}
    assert made_up == {}  # no temperature, no clocks, no other counter invented


def test_on_a_device_the_injected_counts_add_to_its_reading() -> None:
    device = Device()
    reader, clock = injected(1, {"ranks": [1], "ecc_corrected_per_s": 10, "xid_errors_per_s": 1}, device)
    first = reader.sample()
    assert first["injected"] is True and (first["ecc_corrected"], first["ecc_corrected_total"]) == (3, 41)
    clock.now += 4.0
    event = health(reader.sample())
    assert (event.ecc_corrected, event.ecc_corrected_total, event.xid_errors) == (43, 81, 4)
    assert (event.temperature_c, event.remap_pending, event.injected) == (61.0, False, True)  # the device's
    assert device.samples == 2
    reader.close()
    assert device.closed


def test_an_injected_report_takes_the_quiet_row_fast_path() -> None:
    spec = {"ranks": [1], "growth": 1.2, "remap_pending": True, **{f"{c}_per_s": 3 for c in COUNTERS}}
    reader, clock = injected(1, spec, Device())
    clock.now += 30.0
    event = health(reader.sample())
    item = orjson.loads(encode(event))
    assert item["injected"] is True and item["retired_pages"] > 0
    row = event_check.common_row(item, "r", 2)
    assert row is not None and event_of(row) == event


def test_a_supervised_rank_reports_the_injection_at_its_configured_interval(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_INJECT_HEALTH, '{"ranks": [1], "ecc_corrected_per_s": 2000}')
    config = SupervisorConfig.from_env({"TRAINGUARD_GPU_HEALTH_INTERVAL_S": "0.05"})
    sinks = {rank: MemorySink() for rank in (0, 1)}
    sups = [
        Supervisor("run-i", rank=r, world_size=2, sink=s, run_dir=tmp_path, config=config)
        for r, s in sinks.items()
    ]
    try:
        deadline = time.monotonic() + 10.0
        while len(sinks[1].of(GpuHealth)) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for sup in sups:
            sup.close()
    reports = sinks[1].of(GpuHealth)
    assert len(reports) >= 4 and all(r.injected and r.present for r in reports)
    counts = [r.ecc_corrected for r in reports]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert [(r.present, r.injected) for r in sinks[0].of(GpuHealth)] == [(False, None)]  # rank 0: no GPU here
