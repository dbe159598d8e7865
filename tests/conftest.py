"""Shared fixtures. Broker tests talk to a real Kafka broker: the one named by
TRAINGUARD_BOOTSTRAP (scripts/test starts one), else one this session starts."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names

from .variants import SLOW_MODULES, slow_variants

#: Not collected (not skipped) unless the slow variants are asked for (tests/variants.py).
collect_ignore = [] if slow_variants() else SLOW_MODULES


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if address := os.environ.get("TRAINGUARD_BOOTSTRAP"):
        yield address
        return
    from harness.devtools.broker_jars import ensure_jars
    from harness.devtools.local_broker import LocalBroker

    ensure_jars()
    broker = LocalBroker(Path(tmp_path_factory.mktemp("kafka")))
    try:
        yield broker.start()
    finally:
        broker.stop()


@pytest.fixture
def topics(bootstrap: str) -> Iterator[TopicNames]:
    """A fresh, isolated set of trainguard topics for one test."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    try:
        yield names
    finally:
        delete_topics(bootstrap, list(dataclasses.astuple(names)))
