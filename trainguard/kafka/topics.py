"""The Kafka topics of trainguard, created explicitly (the broker never auto-creates).

=====================  ====  ===========  ================================================
topic                  part  cleanup      why
=====================  ====  ===========  ================================================
trainguard.telemetry   6     delete, 7 d  Rank events batched per node, keyed by run_id: a
                                          run's events stay on one partition, in order; a
                                          run over 16,384 ranks is cut into shards, each on
                                          its own partition (schemas/sharding.py); 6
                                          partitions let up to 6 processors share the load.
                                          compression.type=producer stores batches as the
                                          producer compressed them (no recompression);
                                          max.message.bytes 8 MiB admits a large node batch
                                          (producers must raise message.max.bytes too).
                                          7 days is enough to replay a week of training.
trainguard.events      6     delete, 30 d Derived events (detections, interruptions), keyed
                                          by run_id: the audit trail, kept a month.
trainguard.commands    6     delete, 7 d  Commands to ranks, keyed by run_id, so that each
                                          run's commands stay ordered.
trainguard.acks        6     delete, 7 d  Command acknowledgements, keyed by run_id:
                                          partitioned like the commands they answer.
trainguard.deadletter  3     delete, 30 d Rejected records: original bytes plus reason
                                          headers. Low volume, so 3 partitions; 16 MiB so
                                          that an 8 MiB telemetry record with headers fits.
trainguard.runs        3     compact      Run registry keyed by run_id. Compaction keeps
                                          only the LAST record of each run_id: every record
                                          must carry the run's full state, not a delta.
trainguard.snapshots   6     compact      Processor state, one key per telemetry partition,
                                          on the partition of the same number: a worker
                                          that takes a partition over loads the newest
                                          snapshot and folds only the records after it
                                          (processors/recovery.py). 64 MiB per snapshot.
=====================  ====  ===========  ================================================

Replication factor is 1 by default (one local broker). `prefix` isolates sets of topics,
e.g. per test: prefix "t123." gives "t123.trainguard.telemetry". Other modules take names
from `topic_names(prefix)`, never from string literals.

On a secured broker (trainguard/kafka/acl.py) the processors also deliver each command
on its run's own topic, `{prefix}trainguard.commands.run.<run token>` (1 partition,
delete, 7 d), which only that run's rank principal may read: an ACL cannot restrict a
reader to one key of the shared commands topic. The shared topic stays the audit log
that the archive, the oracle and the API read. `run_commands_topic` makes the name; the
processor creates the topic when it first sends a command to the run, or `trainguard
broker grant-run` does when it provisions the run's principal.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
    TopicMetadata,
)

from .errors import BrokerError
from .security import KafkaCredentials, client_config

TELEMETRY = "trainguard.telemetry"
EVENTS = "trainguard.events"
COMMANDS = "trainguard.commands"
ACKS = "trainguard.acks"
DEADLETTER = "trainguard.deadletter"
RUNS = "trainguard.runs"
SNAPSHOTS = "trainguard.snapshots"

_DAY_MS = 24 * 60 * 60 * 1000
_MIB = 1024 * 1024


class TopicMismatchError(BrokerError):
    """A topic exists with a partition count or config other than its TopicSpec."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic: its name (without prefix), partition count, topic config and purpose."""

    name: str
    partitions: int
    config: Mapping[str, str]
    purpose: str


def _delete(days: int, **extra: str) -> dict[str, str]:
    return {"cleanup.policy": "delete", "retention.ms": str(days * _DAY_MS), **extra}


TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec(
        TELEMETRY,
        6,
        _delete(7, **{"compression.type": "producer", "max.message.bytes": str(8 * _MIB)}),
        "rank events batched per node, keyed by run_id",
    ),
    TopicSpec(EVENTS, 6, _delete(30), "derived events (detections, interruptions), keyed by run_id"),
    TopicSpec(COMMANDS, 6, _delete(7), "commands to ranks, keyed by run_id"),
    TopicSpec(ACKS, 6, _delete(7), "command acknowledgements, keyed by run_id"),
    TopicSpec(
        DEADLETTER,
        3,
        _delete(30, **{"max.message.bytes": str(16 * _MIB)}),
        "rejected records: original bytes plus reason headers",
    ),
    TopicSpec(
        RUNS,
        3,
        {"cleanup.policy": "compact"},
        "run registry keyed by run_id (compacted: last record per run wins)",
    ),
    TopicSpec(
        SNAPSHOTS,
        6,
        {
            "cleanup.policy": "compact",
            "max.message.bytes": str(64 * _MIB),
            # Roll often, so that compaction can drop superseded snapshots soon.
            "segment.ms": str(10 * 60 * 1000),
        },
        "processor state per telemetry partition (compacted: the newest snapshot wins)",
    ),
)


@dataclass(frozen=True)
class TopicNames:
    """Full topic names for one prefix."""

    telemetry: str
    events: str
    commands: str
    acks: str
    deadletter: str
    runs: str
    snapshots: str

    def all(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def run_commands(self, run_id: str) -> str:
        """The per-run command delivery topic of `run_id` (secured brokers only)."""
        return run_commands_topic(self.commands, run_id)


#: Run ids that are used verbatim in topic and principal names: no "." or "_" (Kafka
#: refuses topics whose names differ only in those) and nothing else a name cannot hold.
_VERBATIM_RUN = re.compile(r"[A-Za-z0-9-]{1,128}")
RUN_COMMANDS_SPEC = TopicSpec(
    "trainguard.commands.run.<run>", 1, _delete(7), "one run's commands, readable by its ranks only"
)


def run_token(run_id: str) -> str:
    """`run_id` as it appears in topic and principal names: itself when it is made of
    letters, digits and "-"; else those characters (others as "-") and "_" plus a digest,
    so that distinct run ids never share a name ("_" never appears in a verbatim one)."""
    if _VERBATIM_RUN.fullmatch(run_id):
        return run_id
    cleaned = re.sub(r"[^A-Za-z0-9-]", "-", run_id)[:64]
    return f"{cleaned}_{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


def actuator_group_prefix(run_id: str) -> str:
    """Prefix of the consumer groups of a run's actuators on a secured broker, which its
    rank principal's ACL names. The run token holds no ".", so no other run's groups share
    it (with the plain `trainguard-actuator-{run_id}-`, run "a" would own run "a-b"'s)."""
    return f"trainguard-actuator.{run_token(run_id)}."


def run_commands_topic(commands_topic: str, run_id: str) -> str:
    """`{commands_topic}.run.{run_token(run_id)}`: derived from the shared topic's name, so
    a client that knows the shared topic and its run needs nothing else."""
    return f"{commands_topic}.run.{run_token(run_id)}"


def ensure_run_commands_topic(
    bootstrap: str,
    topic: str,
    timeout_s: float = 30,
    replication_factor: int = 1,
    credentials: KafkaCredentials | None = None,
) -> bool:
    """Create a per-run commands topic unless it exists; True if this call created it."""
    admin = _admin(bootstrap, credentials)
    new = NewTopic(
        topic, RUN_COMMANDS_SPEC.partitions, replication_factor, config=dict(RUN_COMMANDS_SPEC.config)
    )
    future = admin.create_topics([new], operation_timeout=timeout_s, request_timeout=timeout_s)[topic]
    try:
        future.result()
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise BrokerError(f"cannot create topic {topic}: {exc}") from exc
    _wait_for_leaders(admin, [topic], timeout_s)
    return True


def topic_names(prefix: str = "") -> TopicNames:
    """Topic names with `prefix` prepended (e.g. "t123." for an isolated test)."""
    return TopicNames(
        *(prefix + name for name in (TELEMETRY, EVENTS, COMMANDS, ACKS, DEADLETTER, RUNS, SNAPSHOTS))
    )


def _admin(bootstrap: str, credentials: KafkaCredentials | None = None) -> AdminClient:
    # log_level 4 (warning): librdkafka otherwise prints, at info level and at random, "Purging 1
    # unserved events from background queue" when a short-lived admin client is destroyed.
    return AdminClient(client_config({"bootstrap.servers": bootstrap, "log_level": 4}, credentials))


def _check(admin: AdminClient, spec: TopicSpec, name: str, partitions: int, timeout_s: float) -> None:
    """Raise TopicMismatchError if topic `name` differs from `spec`."""
    problems = []
    if partitions != spec.partitions:
        problems.append(f"{partitions} partitions, expected {spec.partitions}")
    resource = ConfigResource(ResourceType.TOPIC, name)
    entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result()
    for key, want in spec.config.items():
        have = entries[key].value if key in entries else None
        if have != want:
            problems.append(f"{key}={have}, expected {want}")
    if problems:
        raise TopicMismatchError(
            f"topic {name} exists with " + "; ".join(problems) + ". Delete it (its data is "
            "lost) or use another prefix; trainguard does not repartition or reconfigure "
            "topics by itself, since changing partitions remaps keys to partitions."
        )


def ensure_topics(
    bootstrap: str,
    prefix: str = "",
    timeout_s: float = 30,
    replication_factor: int = 1,
    credentials: KafkaCredentials | None = None,
) -> list[str]:
    """Create every topic of TOPICS that is missing; return the names created this call.

    Idempotent: topics that exist with their spec's partitions and config are left alone;
    a different partition count or config raises TopicMismatchError. Returns once every
    partition of every topic has a leader, so producers can start at once.
    """
    specs = {prefix + spec.name: spec for spec in TOPICS}
    created: list[str] = []
    admin = _admin(bootstrap, credentials)
    try:
        existing = admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise BrokerError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    missing = [name for name in specs if name not in existing]
    if missing:
        new = [
            NewTopic(name, specs[name].partitions, replication_factor, config=dict(specs[name].config))
            for name in missing
        ]
        futures = admin.create_topics(new, operation_timeout=timeout_s, request_timeout=timeout_s)
        for name, future in futures.items():
            try:
                future.result()
                created.append(name)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # lost a race: fine
                    raise BrokerError(f"cannot create topic {name}: {exc}") from exc
    metadata = _wait_for_leaders(admin, list(specs), timeout_s)
    for name, spec in specs.items():
        if name not in created:
            _check(admin, spec, name, len(metadata[name].partitions), timeout_s)
    return sorted(created)


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout_s: float) -> dict[str, TopicMetadata]:
    """Topic metadata once every partition of `names` has a leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        topics = admin.list_topics(timeout=timeout_s).topics
        ready = all(
            name in topics
            and topics[name].error is None
            and topics[name].partitions
            and all(p.leader >= 0 for p in topics[name].partitions.values())
            for name in names
        )
        if ready:
            return {name: topics[name] for name in names}
        if time.monotonic() >= deadline:
            raise BrokerError(f"topics without leaders after {timeout_s:g} s: {names}")
        time.sleep(0.1)


def delete_topics(
    bootstrap: str, names: Iterable[str], timeout_s: float = 30, credentials: KafkaCredentials | None = None
) -> None:
    """Delete topics (test cleanup); topics that do not exist are ignored.

    Returns once the broker's metadata no longer lists them: the deletion is committed before
    that, and a metadata request right after it may still see the topics.
    """
    names = list(names)
    if not names:
        return
    deadline = time.monotonic() + timeout_s
    admin = _admin(bootstrap, credentials)
    futures = admin.delete_topics(names, operation_timeout=timeout_s, request_timeout=timeout_s)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise BrokerError(f"cannot delete topic {name}: {exc}") from exc
    while set(names) & set(admin.list_topics(timeout=timeout_s).topics):
        if time.monotonic() >= deadline:
            raise BrokerError(f"topics still listed {timeout_s:g} s after their deletion: {names}")
        time.sleep(0.1)


def partition_count(
    bootstrap: str, topic: str, timeout_s: float = 30, credentials: KafkaCredentials | None = None
) -> int:
    """How many partitions `topic` has (producers that place records explicitly need it)."""
    meta = _admin(bootstrap, credentials).list_topics(topic, timeout=timeout_s).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise RuntimeError(f"topic {topic} is not available on {bootstrap}: {meta and meta.error}")
    return len(meta.partitions)
