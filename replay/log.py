"""A recorded run, read back from the Kafka log (or from the archive, which keeps the same
log): its telemetry records in the order the processor consumed them, and the decisions
the live processor published for it.

Order is what makes a replay exact. A run's records (every shard's, and the ticks and
forwards the processor itself wrote into the log) sit on the telemetry topic's
partitions; the live processor folds each partition's records in offset order, and a
run's shard state depends on the records of its own partition only (a forward to shard
0 is a record on shard 0's partition). So reading partition after partition, each from
its first offset to the end it had when the read began, gives every shard state the
sequence it had live. Records of other runs are left out: the core keeps no state
across runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, KafkaError, TopicPartition

from ..kafka.security import KafkaCredentials, client_config
from ..kafka.topics import TopicNames
from ..schemas import Command, Derived, ReasonCode, decode
from ..schemas.codec import COMMANDS, DERIVED
from ..schemas.sharding import run_of_key

if TYPE_CHECKING:
    import duckdb

    from ..schemas.record_columns import StoredColumns
    from ..sinks.archive_store import Db

#: One telemetry record as the processor consumed it: (partition, offset, value).
Record = tuple[int, int, bytes]


@dataclass
class Recording:
    """One run as the log holds it."""

    run_id: str
    #: Telemetry records of the run, partition by partition, each in offset order.
    records: list[Record] = field(default_factory=list)
    #: What the live processor published for the run, in publication order.
    derived: list[Derived] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    #: Commands an operator issued (the run API: reason code OPERATOR), in publication order.
    #: They are the run's inputs, like its telemetry, not the core's decisions: a replay
    #: shows them and compares the core's decisions without them. The core never issues
    #: that code, so a core command under it would replay as an extra decision.
    operator_commands: list[Command] = field(default_factory=list)
    #: The columns the archive keeps of the run's common records (replay/stored.py), by
    #: the record's place in `records`; None: every record is folded from its bytes.
    stored: StoredColumns | None = None


def read_topic(
    bootstrap: str,
    topic: str,
    keep: Callable[[bytes | None], bool] = lambda _: True,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 120.0,
    credentials: KafkaCredentials | None = None,
) -> list[Record]:
    """Every record of `topic` whose key `keep`s, partition after partition in offset
    order, up to the end each partition had when the read began. `progress(done, total)`
    is called as records arrive (total: the records the partitions held)."""
    consumer = Consumer(
        client_config(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"trainguard-replay-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
            },
            credentials,  # None: from the environment
        )
    )
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends: dict[int, tuple[int, int]] = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = (low, high)
        total, done = sum(h - lo for lo, h in ends.values()), 0
        out: list[Record] = []
        deadline = time.monotonic() + timeout_s
        for p, (low, high) in ends.items():
            consumer.assign([TopicPartition(topic, p, low)])
            offset = low
            while offset < high:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{topic}[{p}]: read {offset - low} of {high - low} records in time")
                for msg in consumer.consume(5000, 0.5):
                    error = msg.error()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            raise RuntimeError(f"{topic}[{p}]: {error}")
                        continue
                    offset = (msg.offset() or 0) + 1
                    done += 1
                    if (msg.offset() or 0) < high and keep(msg.key()):
                        out.append((p, msg.offset() or 0, msg.value() or b""))
                if progress is not None:
                    progress(done, total)
        return out
    finally:
        consumer.close()


def read_recording(
    bootstrap: str,
    names: TopicNames,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
    credentials: KafkaCredentials | None = None,
) -> Recording:
    """The run's telemetry and the processor's decisions for it, from the topics."""
    of_run: Callable[[bytes | None], bool] = lambda key: run_of_key(key) == run_id  # noqa: E731
    records = read_topic(bootstrap, names.telemetry, of_run, progress, credentials=credentials)
    recording = Recording(run_id, records)
    mine: Callable[[bytes | None], bool] = lambda key: (key or b"") == run_id.encode()  # noqa: E731
    derived = [value for _, _, value in read_topic(bootstrap, names.events, mine, credentials=credentials)]
    commands = [value for _, _, value in read_topic(bootstrap, names.commands, mine, credentials=credentials)]
    _add_decisions(recording, derived, commands)
    return recording


def _add_decisions(recording: Recording, derived: Iterable[bytes], commands: Iterable[bytes]) -> None:
    """The processor's published records (its own output: a failure to decode is a bug),
    each in publication order; an operator's commands apart from the core's."""
    for value in derived:
        record = decode(value, DERIVED)
        if isinstance(record, Derived):
            recording.derived.append(record)
    for value in commands:
        command = decode(value, COMMANDS)
        if isinstance(command, Command):
            is_input = command.reason.code == ReasonCode.OPERATOR
            (recording.operator_commands if is_input else recording.commands).append(command)


_ARCHIVED_DERIVED = """
SELECT payload FROM raw_event
WHERE run_id = $run_id AND topic = $topic ORDER BY kafka_partition, kafka_offset"""
_ARCHIVED_COMMANDS = """
SELECT payload FROM command WHERE run_id = $run_id ORDER BY kafka_partition, kafka_offset"""


def read_archived_recording(db: Db, names: TopicNames, run_id: str) -> Recording:
    """The run as the archive holds it (sinks/archive_schema.py): its telemetry records
    verbatim from telemetry_log, in the order read_recording gives (partition after
    partition, offsets in order), the decisions from raw_event and command. For runs the
    archive writer has stored; a run not yet archived is read from Kafka. The archive keeps
    each decision once (the live log may hold one twice; replays compare ids once)."""
    from ..sinks.archive_schema import COMMAND, RAW_EVENT, TELEMETRY_COLUMNS, TELEMETRY_LOG
    from ..sinks.archive_store import Reader  # DuckDB and Arrow: only for archive reads
    from .stored import read_stored

    with Reader(db, tables=(TELEMETRY_LOG, TELEMETRY_COLUMNS, RAW_EVENT, COMMAND)) as con:
        params = {"run_id": run_id}
        records = _archived_records(con, run_id)
        stored = read_stored(con, run_id, records)
        derived = con.execute(_ARCHIVED_DERIVED, {**params, "topic": names.events}).fetchall()
        commands = con.execute(_ARCHIVED_COMMANDS, params).fetchall()
    recording = Recording(run_id, records, stored=stored)
    _add_decisions(recording, (p.encode() for (p,) in derived), (p.encode() for (p,) in commands))
    return recording


def _archived_records(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Record]:
    """The run's telemetry_log records in (partition, offset) order, each once."""
    from ..sinks.archive_schema import TELEMETRY_LOG
    from .stored import archived_rows

    rows = archived_rows(con, TELEMETRY_LOG, run_id, ["value"])
    if rows is None or rows.num_rows == 0:
        return []
    columns = (rows.column(name).to_pylist() for name in ("kafka_partition", "kafka_offset", "value"))
    return list(zip(*columns, strict=True))
