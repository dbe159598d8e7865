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

from .variants import LONGEST, SLOW_MARK, SLOW_MODULES, slow_variants

#: Not collected (not skipped) unless the slow variants are asked for (tests/variants.py).
collect_ignore = [] if slow_variants() else SLOW_MODULES


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for parallel workers (scripts/test: pytest-xdist ``--dist loadgroup``): a
    module's tests run on one worker (its module-scoped processors and launches made once),
    except each slow variant's case, a group of its own; the slow variants first (whole
    cases, then whole modules; LONGEST's cases before all), so that the longest groups
    start first rather than last."""
    here = Path(__file__).parent
    longest = {str(here / m) for m in LONGEST}
    slow_modules = {str(here / m) for m in SLOW_MODULES}

    def order(item: pytest.Item) -> int:
        if item.get_closest_marker(SLOW_MARK) is not None:
            return 0 if str(item.path) in longest else 1
        return 2 if str(item.path) in slow_modules else 3

    for item in items:
        alone = item.get_closest_marker(SLOW_MARK) is not None
        item.add_marker(pytest.mark.xdist_group(item.nodeid if alone else str(item.path)))
    items.sort(key=order)


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
