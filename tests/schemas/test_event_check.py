"""Common heartbeats, step stats and GPU health read as rows (schemas/event_check.py): a row is only
ever made of what the event's model accepts as it is, with the model's values; anything
else is decoded by the model as before (accepted, or rejected with its reason). Checked
compiled and as Python, on events with one value replaced, a field added or dropped."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from trainguard.compiled_build import pure_requested
from trainguard.schemas import GpuHealth, Heartbeat, StepStats, decode_batch, event_check
from trainguard.schemas.codec import Batch, decode_parts, event_of
from trainguard.schemas.compiled import BUILD

from .test_block_check import CASES, python_source

RUN, WORLD = "r", 64
EXTRA = ["x" * 32, "x" * 33, "NaN", "Infinity", -1e-300, 2.5e9]


Kind = type[Heartbeat] | type[StepStats] | type[GpuHealth]


def common(kind: Kind, rng: random.Random) -> dict[str, Any]:
    event: dict[str, Any] = {
        "schema": kind.schema_name(), "event_id": f"e{rng.randrange(10**9)}", "run_id": RUN,
        "attempt": rng.randrange(3), "rank": rng.randrange(-1, WORLD), "node": "node-1",
        "step": rng.randrange(-1, 10**6), "ts": rng.uniform(0, 2e9),
    }  # fmt: skip
    if kind is Heartbeat:
        event["phase"] = rng.choice(["", "forward", "allreduce"])
    elif kind is StepStats:
        event.update(loss=rng.uniform(0, 12), grad_norm=rng.choice([None, rng.uniform(0, 5)]), finite=True)
    else:  # what producers/training/gpu_health.py reads of a GPU (NVML), some of it unsupported
        event.update(
            present=True, temperature_c=rng.uniform(30, 95), power_capped=rng.random() < 0.1,
            thermal_throttle=False, nvlink_width=rng.choice([None, 12, 18]), nvlink_retries=0,
            nic_utilization=rng.random(), power_w=rng.uniform(0, 700), throttle_reasons=["sw_power_cap"],
            ecc_corrected_total=rng.choice([None, 3]),
        )  # fmt: skip
    return event


def variants(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Common events of both kinds, most with one value replaced, a field added or dropped."""
    out = []
    for _ in range(n):
        event = common(rng.choice([Heartbeat, StepStats, GpuHealth]), rng)
        change = rng.random()
        keys = [k for k in event if k != "schema"]
        if change < 0.75:
            event[rng.choice(keys)] = rng.choice([*CASES, *EXTRA])
        elif change < 0.8:
            event["colour"] = 1
        elif change < 0.9:
            del event[rng.choice(keys)]
        out.append(event)
    return out


def test_a_row_is_what_the_model_accepts_with_its_values_and_anything_else_is_decoded_as_before() -> None:
    rng, rows = random.Random(43), 0
    for written in variants(rng, 4000):
        try:
            value = encode_batch_of([written])
        except TypeError:  # an int past 64 bits: no JSON writer of ours makes one
            continue
        event = orjson.loads(value)["records"][0]  # as the decoder reads it (NaN is written null)
        parts = decode_parts(value).parts
        reference = decode_batch(value)  # (events_of builds every row's model)
        model = type_of(event)
        try:
            expected = model.model_validate({k: v for k, v in event.items() if k != "schema"})
        except Exception:  # noqa: BLE001 - any refusal: the decoder must not make a row of it
            expected = None
        if parts and type(parts[0]) is tuple:
            rows += 1
            assert expected is not None, event
            built = event_of(parts[0])
            assert type(built) is model and built == expected, event
            assert parts[0][:-1] == row_of(built), event  # the row's values are the model's
        elif expected is not None and expected.rank < WORLD and expected.run_id == RUN:
            assert [e.model_dump_json() for e in reference.events] == [expected.model_dump_json()], event
        else:
            assert reference.events == [] and len(reference.rejections) == 1, event
    assert rows > 700  # a good share of the variants stayed common


def test_compiled_and_python_checks_agree() -> None:
    python = python_source("event_check")
    assert event_check.__file__.endswith(".py") == (pure_requested() or not BUILD.is_current())
    for event in variants(random.Random(7), 3000):
        item = {k: v for k, v in event.items() if k != "schema"}
        for name in ("heartbeat_row", "stats_row", "gpu_row"):
            compiled = getattr(event_check, name)(dict(item), RUN, WORLD)
            assert repr(compiled) == repr(getattr(python, name)(dict(item), RUN, WORLD)), (name, event)


@pytest.mark.parametrize("kind", [Heartbeat, StepStats, GpuHealth])
def test_an_event_of_another_run_or_outside_the_world_is_not_a_row(kind: Kind) -> None:
    event = common(kind, random.Random(1))
    for change in ({"run_id": "other"}, {"rank": WORLD}):
        decoded = decode_parts(encode_batch_of([{**event, **change}]))
        assert decoded.parts == [] and len(decoded.rejections) == 1


def encode_batch_of(events: list[dict[str, Any]]) -> bytes:
    """A current batch of these events as they are (encode_batch would validate them)."""
    header = {"schema": "batch/2", "run_id": RUN, "node": "node-1", "world_size": WORLD, "producer_id": "p"}
    return orjson.dumps({**header, "seq": 0, "shard": 0, "shard_ranks": 0, "records": events})


def type_of(event: dict[str, Any]) -> Kind:
    return next(k for k in (Heartbeat, StepStats, GpuHealth) if event["schema"] == k.schema_name())


def row_of(event: Heartbeat | StepStats | GpuHealth) -> tuple[Any, ...]:
    head = (event.event_id, event.attempt, event.rank, event.node, event.step, event.ts)
    if isinstance(event, Heartbeat):
        return (*head, event.phase)
    if isinstance(event, StepStats):
        return (*head, event.loss, event.grad_norm, event.finite)
    return (
        *head, event.present, event.temperature_c, event.power_capped, event.thermal_throttle,
        event.nvlink_width, event.nvlink_expected_width, event.nvlink_retries, event.nic_utilization,
    )  # fmt: skip


def headers(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Batch headers (without their schema key), most with one value replaced, a field
    added or dropped."""
    out = []
    for _ in range(n):
        header: dict[str, Any] = {
            "run_id": RUN, "node": "node-1", "world_size": rng.randrange(1, 20_000), "producer_id": "p",
            "seq": rng.randrange(10**6), "records": [], "shard": rng.randrange(4), "shard_ranks": 4096,
        }  # fmt: skip
        change = rng.random()
        if change < 0.75:
            header[rng.choice(list(header))] = rng.choice([*CASES, *EXTRA, 1_048_577, 1_048_576])
        elif change < 0.8:
            header["colour"] = 1
        elif change < 0.9:
            del header[rng.choice(list(header))]
        out.append(header)
    return out


def test_a_common_batch_header_is_what_the_batch_model_reads_and_compiled_agrees() -> None:
    python, common = python_source("event_check"), 0
    for header in headers(random.Random(11), 3000):
        read = event_check.batch_header(dict(header))
        assert repr(read) == repr(python.batch_header(dict(header))), header
        try:
            expected = Batch.model_validate(header)
        except ValidationError:
            assert read is None, header
            continue
        if read is not None:
            common += 1
            assert read._asdict() == expected.model_dump(), header
    assert common > 500


def test_the_rows_schemas_are_the_models_current_versions() -> None:
    """event_check names the versions it reads (it cannot import the models: compiled)."""
    kinds = (event_check.HEARTBEAT_SCHEMA, event_check.STATS_SCHEMA, event_check.GPU_SCHEMA)
    assert kinds == (Heartbeat.schema_name(), StepStats.schema_name(), GpuHealth.schema_name())
