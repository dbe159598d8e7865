"""A telemetry batch's common parts read without their models (issue 20): its header, and
its heartbeats, step stats and GPU health.

After the step timings (a columnar block), a training run's events are mostly heartbeats,
step stats and GPU health, one JSON object each inside a batch. Validating each into its
pydantic model costs ~1.3-2.5 us (the batch header ~1 us), and nearly every one then
changes a few fields of the core and decides nothing (processors/core/folds/quiet.py). So a
*common* one (exactly the fields its model declares, each of the JSON type the model
reads without converting it, inside the model's bounds) is read into a row, a plain tuple
of its fields (the header into a BatchHeader); the model is built from the row's object
only where the core needs it (schemas/codec.py ``event_of``). Anything else (another
type, a missing or unknown field, a bound crossed) is not common: the decoder validates
it with its model, which accepts or words the reason as before. A common row is a
subset of what the model accepts, with the same values (tests/schemas/test_event_check.py).

Compiled by mypyc where a build is there (schemas/compiled.py), like block_check.py:
plain Python over dicts, no pydantic.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from typing_extensions import TypeIs

from .base import MAX_EVENT_ID, MAX_NAME, NO_STEP, RUN_LEVEL_RANK

#: The object a row was read from (an archive's row holds its JSON instead, with its
#: schema key: replay/stored.py; codec.event_of reads either).
Source = dict[str, Any] | str
#: (event_id, attempt, rank, node, step, ts, phase, the object it was read from)
HeartbeatRow = tuple[str, int, int, str, int, float, str, Source]
#: (event_id, attempt, rank, node, step, ts, loss, grad_norm, finite, the object)
StatsRow = tuple[str, int, int, str, int, float, float, float | None, bool, Source]
#: (event_id, attempt, rank, node, step, ts, present, temperature_c, power_capped,
#: thermal_throttle, nvlink_width, nvlink_expected_width, nvlink_retries, nic_utilization,
#: the object): what the straggler diagnosis keeps of a report (processors/core/detectors/diagnosis.py)
GpuRow = tuple[
    str, int, int, str, int, float, bool, float | None, bool | None, bool | None,
    int | None, int | None, int | None, float | None, Source,
]  # fmt: skip
#: A common heartbeat, step stats or GPU health, read without its model.
Row = HeartbeatRow | StatsRow | GpuRow

#: Where a row holds its event's ts (either kind).
ROW_TS: Final = 5
#: A heartbeat's row has this many fields, a step stats' STATS_LEN (a GPU health's 15).
HEARTBEAT_LEN: Final = 8
STATS_LEN: Final = 10

#: The fields each model declares, without the schema key (the decoder has removed it).
HEARTBEAT_FIELDS: Final = frozenset({"event_id", "run_id", "attempt", "rank", "node", "step", "ts", "phase"})
STATS_FIELDS: Final = frozenset(
    {"event_id", "run_id", "attempt", "rank", "node", "step", "ts", "loss", "grad_norm", "finite"}
)
#: GpuHealth's optional fields by type (schemas/events.py; each may be None), and the
#: float fields with bounds: [0, 1], >= 0.
GPU_FLOATS: Final = (
    "temperature_c", "sm_clock_mhz", "memory_temperature_c", "sm_clock_max_mhz", "memory_clock_mhz",
)  # fmt: skip
GPU_FRACTIONS: Final = ("nic_utilization",)
GPU_NON_NEGATIVE: Final = ("power_w", "power_limit_w")
GPU_BOOLS: Final = (
    "power_capped", "thermal_throttle", "retired_pages_pending", "remap_pending", "remap_failed", "injected",
)  # fmt: skip
GPU_INTS: Final = (
    "nvlink_width", "nvlink_expected_width", "nvlink_retries", "ecc_corrected", "ecc_uncorrected",
    "ecc_corrected_total", "ecc_uncorrected_total", "nvlink_crc_errors",
)  # fmt: skip
#: GpuHealth v3's counters, never negative (the model's ge=0).
GPU_COUNTS: Final = (
    "retired_pages", "remapped_rows_correctable", "remapped_rows_uncorrectable", "xid_errors", "last_xid",
    "pcie_replays",
)  # fmt: skip
GPU_FIELDS: Final = frozenset(
    {
        "event_id", "run_id", "attempt", "rank", "node", "step", "ts", "present", "throttle_reasons",
        *GPU_FLOATS, *GPU_FRACTIONS, *GPU_NON_NEGATIVE, *GPU_BOOLS, *GPU_INTS, *GPU_COUNTS,
    }
)  # fmt: skip
#: GpuHealth.throttle_reasons
MAX_REASONS: Final = 32
#: schemas/events.py Heartbeat.phase
MAX_PHASE: Final = 32
#: Ints past 64 bits (the model reads them too) take the model: as in block_check.py.
INT_LIMIT: Final = 2**63
_INF: Final = float("inf")


def _envelope(item: dict[str, Any], run_id: str, size: int) -> bool:
    """The envelope's fields are common, of the batch's run and inside its world."""
    event_id, run, node = item.get("event_id"), item.get("run_id"), item.get("node")
    if type(event_id) is not str or not 0 < len(event_id) <= MAX_EVENT_ID:
        return False
    if type(run) is not str or run != run_id or type(node) is not str or len(node) > MAX_NAME:
        return False
    attempt, rank, step, ts = item.get("attempt"), item.get("rank"), item.get("step"), item.get("ts")
    if type(attempt) is not int or type(rank) is not int or type(step) is not int or type(ts) is not float:
        return False
    return (
        0 <= attempt < INT_LIMIT
        and RUN_LEVEL_RANK <= rank < size
        and NO_STEP <= step < INT_LIMIT
        and 0.0 <= ts < _INF
    )


#: The versions read as rows (schemas/events.py: Heartbeat, StepStats, GpuHealth).
HEARTBEAT_SCHEMA: Final = "heartbeat/2"
STATS_SCHEMA: Final = "step_stats/1"
GPU_SCHEMA: Final = "gpu_health/3"


def common_row(item: Any, run_id: str, size: int) -> Row | None:
    """A batch's record as parsed, as a row if it is a common heartbeat, step stats or GPU
    health of run `run_id` with a rank below `size`: its schema key is then removed (the
    row's object is what its model validates). None: `item` is left as it was, but for
    the order of its keys."""
    if type(item) is not dict:
        return None
    schema = item.get("schema")
    if schema != HEARTBEAT_SCHEMA and schema != STATS_SCHEMA and schema != GPU_SCHEMA:
        return None
    del item["schema"]
    row: Row | None
    if schema == HEARTBEAT_SCHEMA:
        row = heartbeat_row(item, run_id, size)
    elif schema == STATS_SCHEMA:
        row = stats_row(item, run_id, size)
    else:
        row = gpu_row(item, run_id, size)
    if row is None:
        item["schema"] = schema
    return row


def heartbeat_row(item: dict[str, Any], run_id: str, size: int) -> HeartbeatRow | None:
    """A common heartbeat/2 of run `run_id` with a rank below `size`, as a row; None:
    validate it with its model."""
    for key in item:
        if key not in HEARTBEAT_FIELDS:
            return None
    if not _envelope(item, run_id, size):
        return None
    phase = item.get("phase", "")
    if type(phase) is not str or len(phase) > MAX_PHASE:
        return None
    return (
        item["event_id"], item["attempt"], item["rank"], item["node"], item["step"], item["ts"], phase, item,
    )  # fmt: skip


def stats_row(item: dict[str, Any], run_id: str, size: int) -> StatsRow | None:
    """A common step_stats/1 (finite loss and gradient norm: JSON has no other floats) of
    run `run_id` with a rank below `size`, as a row; None: validate it with its model."""
    for key in item:
        if key not in STATS_FIELDS:
            return None
    if not _envelope(item, run_id, size):
        return None
    loss, grad, finite = item.get("loss"), item.get("grad_norm"), item.get("finite")
    if type(loss) is not float or type(finite) is not bool or not (grad is None or type(grad) is float):
        return None
    return (
        item["event_id"], item["attempt"], item["rank"], item["node"], item["step"], item["ts"],
        loss, grad, finite, item,
    )  # fmt: skip


def gpu_row(item: dict[str, Any], run_id: str, size: int) -> GpuRow | None:
    """A common gpu_health/3 of run `run_id` with a rank below `size`, as a row; None:
    validate it with its model."""
    for key in item:
        if key not in GPU_FIELDS:
            return None
    if not _envelope(item, run_id, size) or type(item.get("present")) is not bool:
        return None
    for name in GPU_FLOATS:
        value = item.get(name)
        if value is not None and (type(value) is not float or not -_INF < value < _INF):
            return None
    for name in GPU_FRACTIONS:
        value = item.get(name)
        if value is not None and (type(value) is not float or not 0.0 <= value <= 1.0):
            return None
    for name in GPU_NON_NEGATIVE:
        value = item.get(name)
        if value is not None and (type(value) is not float or not 0.0 <= value < _INF):
            return None
    for name in GPU_BOOLS:
        value = item.get(name)
        if value is not None and type(value) is not bool:
            return None
    for name in GPU_INTS:
        value = item.get(name)
        if value is not None and (type(value) is not int or not -INT_LIMIT <= value < INT_LIMIT):
            return None
    for name in GPU_COUNTS:
        value = item.get(name)
        if value is not None and (type(value) is not int or not 0 <= value < INT_LIMIT):
            return None
    reasons = item.get("throttle_reasons")
    if reasons is not None:
        if type(reasons) is not list or len(reasons) > MAX_REASONS:
            return None
        for reason in reasons:
            if type(reason) is not str:
                return None
    get = item.get
    return (
        item["event_id"], item["attempt"], item["rank"], item["node"], item["step"], item["ts"],
        item["present"], get("temperature_c"), get("power_capped"), get("thermal_throttle"),
        get("nvlink_width"), get("nvlink_expected_width"), get("nvlink_retries"), get("nic_utilization"),
        item,
    )  # fmt: skip


def is_heartbeat(row: Row) -> TypeIs[HeartbeatRow]:
    return len(row) == HEARTBEAT_LEN


def is_stats(row: Row) -> TypeIs[StatsRow]:
    return len(row) == STATS_LEN


class BatchHeader(NamedTuple):
    """A telemetry batch's header as the decoder keeps it (schemas/codec.py Batch's fields)."""

    run_id: str
    node: str
    world_size: int
    producer_id: str
    seq: int
    records: list[Any]
    shard: int = 0
    shard_ranks: int = 0


#: schemas/codec.py Batch: its fields (without the schema key) and bounds.
BATCH_FIELDS: Final = frozenset(
    {"run_id", "node", "world_size", "producer_id", "seq", "records", "shard", "shard_ranks"}
)
MAX_WORLD: Final = 1_048_576
MAX_RECORDS: Final = 1_000_000


def batch_header(obj: dict[str, Any]) -> BatchHeader | None:
    """A common batch header (the schema key removed), or None: validate it with Batch."""
    for key in obj:
        if key not in BATCH_FIELDS:
            return None
    run_id, node, producer = obj.get("run_id"), obj.get("node"), obj.get("producer_id")
    if type(run_id) is not str or not 0 < len(run_id) <= MAX_NAME:
        return None
    if type(node) is not str or len(node) > MAX_NAME:
        return None
    if type(producer) is not str or not 0 < len(producer) <= MAX_NAME:
        return None
    world, seq, records = obj.get("world_size"), obj.get("seq"), obj.get("records")
    shard, shard_ranks = obj.get("shard", 0), obj.get("shard_ranks", 0)
    if (
        type(world) is not int
        or type(seq) is not int
        or type(shard) is not int
        or type(shard_ranks) is not int
    ):
        return None
    if not (1 <= world <= MAX_WORLD and 0 <= seq < INT_LIMIT and 0 <= shard < INT_LIMIT):
        return None
    if not 0 <= shard_ranks < INT_LIMIT or type(records) is not list or len(records) > MAX_RECORDS:
        return None
    return BatchHeader(run_id, node, world, producer, seq, records, shard, shard_ranks)
