"""The local Kafka broker built from Maven Central jars, and the trainguard topics.

Tests marked `broker` start real JVMs (about 3 s each); they are skipped, with the reason,
when java 17+ or mvn is missing. The rest are unit tests with no broker.
"""

from __future__ import annotations

import gc
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from harness.devtools import broker_jars
from harness.devtools import local_broker as local
from harness.devtools.broker_config import port_open
from harness.devtools.broker_jars import MissingToolError, ensure_jars
from harness.devtools.local_broker import BrokerError, LocalBroker
from trainguard.kafka.topics import (
    TOPICS,
    TopicMismatchError,
    delete_topics,
    ensure_topics,
    topic_names,
)

# --------------------------------------------------------------------------- unit


def test_topic_names_and_specs() -> None:
    names = topic_names("t1.")
    assert names.telemetry == "t1.trainguard.telemetry"
    assert names.all() == tuple("t1." + spec.name for spec in TOPICS)
    assert topic_names().runs == "trainguard.runs"
    assert len({spec.name for spec in TOPICS}) == len(TOPICS) == 7


def test_cluster_id_is_kafka_uuid() -> None:
    cluster_id = local.new_cluster_id()
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")


def test_default_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINGUARD_CACHE", str(tmp_path / "cache"))
    assert local.default_data_dir() == tmp_path / "broker"
    assert broker_jars.default_cache_dir() == tmp_path / "cache" / "kafka-4.1.1"
    monkeypatch.delenv("TRAINGUARD_HOME")
    monkeypatch.chdir(tmp_path)
    assert local.default_data_dir() == tmp_path / ".trainguard" / "broker"


# --------------------------------------------------------------------------- broker


@pytest.fixture(scope="module")
def jars() -> Path:
    try:
        return ensure_jars()
    except MissingToolError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def broker(jars: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    with LocalBroker(tmp_path_factory.mktemp("broker")) as running:
        yield running
        # Clients kept alive by tracebacks (pytest.raises) would log "Disconnected" on stop.
        gc.collect()


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})  # no info-level chatter


def _create_topic(bootstrap: str, name: str, partitions: int = 1, **config: str) -> None:
    admin = _admin(bootstrap)  # must outlive the future, or it fails with _DESTROY
    admin.create_topics([NewTopic(name, partitions, 1, config=config)])[name].result(timeout=30)


def _produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    errors: list[KafkaError | None] = []
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 10_000})
    producer.produce(topic, value, key, headers={"h": b"1"}, on_delivery=lambda err, msg: errors.append(err))
    assert producer.flush(15) == 0
    assert errors == [None]


def _consume_one(bootstrap: str, topic: str) -> tuple[object, ...]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            return msg.key(), msg.value(), msg.headers() or []
        raise AssertionError(f"no record on {topic} within 30 s")
    finally:
        consumer.close()


@pytest.mark.broker
def test_broker_serves_produce_and_consume(broker: LocalBroker) -> None:
    assert broker.bootstrap is not None
    topic = f"roundtrip-{uuid.uuid4().hex[:8]}"
    _create_topic(broker.bootstrap, topic)
    _produce(broker.bootstrap, topic, b"run-1", b"hello")
    assert _consume_one(broker.bootstrap, topic) == (b"run-1", b"hello", [("h", b"1")])


@pytest.mark.broker
def test_broker_log_is_written_by_log4j(broker: LocalBroker) -> None:
    text = broker.log_path.read_text()
    assert "Kafka Server started" in text or "[BrokerServer id=1] Transition from STARTING to STARTED" in text
    out = broker.out_path.read_text() if broker.out_path.exists() else ""
    assert "SLF4J" not in out  # e.g. "No SLF4J providers were found"


@pytest.mark.broker
def test_topics_are_never_auto_created(broker: LocalBroker) -> None:
    assert broker.bootstrap is not None
    topic = f"unknown-{uuid.uuid4().hex[:8]}"
    errors: list[KafkaError | None] = []
    producer = Producer({"bootstrap.servers": broker.bootstrap, "message.timeout.ms": 3000})
    producer.produce(topic, b"x", on_delivery=lambda err, msg: errors.append(err))
    producer.flush(10)
    assert len(errors) == 1 and errors[0] is not None
    assert topic not in _admin(broker.bootstrap).list_topics(timeout=10).topics


@pytest.mark.broker
def test_state_file_lets_another_process_reattach(broker: LocalBroker) -> None:
    state = json.loads((broker.data_dir / "broker.json").read_text())
    assert state["pid"] == broker.pid and state["bootstrap"] == broker.bootstrap
    other = LocalBroker.from_state(broker.data_dir)
    status = other.status()
    assert status.running and status.pid == broker.pid and status.bootstrap == broker.bootstrap
    with pytest.raises(BrokerError, match="already runs"):
        LocalBroker(broker.data_dir).start()


@pytest.mark.broker
def test_ensure_topics_creates_every_spec_and_is_idempotent(broker: LocalBroker) -> None:
    assert broker.bootstrap is not None
    prefix = f"t{uuid.uuid4().hex[:8]}."
    names = topic_names(prefix)
    try:
        assert ensure_topics(broker.bootstrap, prefix=prefix) == sorted(names.all())
        assert ensure_topics(broker.bootstrap, prefix=prefix) == []

        admin = _admin(broker.bootstrap)
        topics = admin.list_topics(timeout=10).topics
        resources = [ConfigResource(ResourceType.TOPIC, prefix + spec.name) for spec in TOPICS]
        described = admin.describe_configs(resources)
        for spec, resource in zip(TOPICS, resources, strict=True):
            assert len(topics[prefix + spec.name].partitions) == spec.partitions
            entries = described[resource].result(timeout=10)
            for key, value in spec.config.items():
                assert entries[key].value == value, (spec.name, key)
        assert described[resources[-1]].result()["cleanup.policy"].value == "compact"
    finally:
        delete_topics(broker.bootstrap, names.all())
    assert not set(names.all()) & set(_admin(broker.bootstrap).list_topics(timeout=10).topics)


@pytest.mark.broker
def test_ensure_topics_rejects_a_mismatched_topic(broker: LocalBroker) -> None:
    assert broker.bootstrap is not None
    prefix = f"m{uuid.uuid4().hex[:8]}."
    names = topic_names(prefix)
    try:
        _create_topic(broker.bootstrap, names.telemetry, partitions=2)
        with pytest.raises(TopicMismatchError, match=r"telemetry exists with 2 partitions, expected 6"):
            ensure_topics(broker.bootstrap, prefix=prefix)
    finally:
        delete_topics(broker.bootstrap, names.all())
    prefix = f"c{uuid.uuid4().hex[:8]}."
    names = topic_names(prefix)
    try:
        _create_topic(broker.bootstrap, names.runs, partitions=3)  # cleanup.policy=delete
        with pytest.raises(TopicMismatchError, match=r"cleanup.policy=delete, expected compact"):
            ensure_topics(broker.bootstrap, prefix=prefix)
    finally:
        delete_topics(broker.bootstrap, names.all())


@pytest.mark.broker
def test_stop_is_clean_and_restart_keeps_data(jars: Path, tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "b")
    try:
        started = time.monotonic()
        bootstrap = broker.start()
        print(f"broker start took {time.monotonic() - started:.2f} s")
        pid, port = broker.pid, int(bootstrap.rsplit(":", 1)[1])
        assert pid is not None and port_open(port)
        _create_topic(bootstrap, "kept")
        _produce(bootstrap, "kept", b"k", b"survives a restart")

        assert broker.stop() is True
        assert not psutil.pid_exists(pid)
        assert not port_open(port)
        assert not broker.state_path.exists()
        assert not broker.status().running
        assert broker.stop() is False  # idempotent
        assert "shut down completely" in broker.log_path.read_text()

        assert broker.start() == bootstrap  # same ports again: clients keep their address
        assert _consume_one(bootstrap, "kept")[1] == b"survives a restart"
    finally:
        broker.stop()


@pytest.mark.broker
def test_start_fails_fast_with_the_log_when_the_jvm_exits(jars: Path, tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "bad", heap="1k")
    started = time.monotonic()
    with pytest.raises(BrokerError, match=r"exited during start-up(.|\n)*heap"):
        broker.start(timeout_s=60)
    assert time.monotonic() - started < 20
    assert not broker.state_path.exists()
