"""Shared fixtures. Broker tests talk to a real Kafka broker: the one named by
TRAINGUARD_BOOTSTRAP (scripts/test starts one), else one this session starts."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.devtools.suite_durations import UNKNOWN_S
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order parallel workers take modules in (scripts/test: pytest-xdist ``--dist
    loadfile --no-loadscope-reorder``, a module's tests on one worker, its module-scoped
    processors and launches made once): longest first, by their last measured length
    (tests/durations.json, harness/devtools/suite_durations.py), so that the last to end is
    a short one. (xdist's ``loadgroup`` would group by marks, but with pytest 9 its marks
    never reach the node ids: every test was its own group, each worker making the
    module fixtures again.)"""
    here = Path(__file__).parent
    known = _durations(here / "durations.json")
    # A module's measured total, less its long cases not collected this time (the slow variants).
    seconds: dict[str, float] = {}
    for module, total in known.items():
        if "::" not in module:
            cases = [v for k, v in known.items() if k.startswith(f"tests/{module}::")]
            seconds[module] = total - sum(cases)
    modules = {item.nodeid: str(item.path.relative_to(here)) for item in items}
    for item in items:
        module = modules[item.nodeid]
        missing = 0.0 if module in known else UNKNOWN_S
        seconds[module] = seconds.get(module, 0.0) + known.get(item.nodeid, missing)
    position = {m: i for i, m in enumerate(dict.fromkeys(modules.values()))}
    items.sort(key=lambda item: (-seconds[modules[item.nodeid]], position[modules[item.nodeid]]))


def _durations(path: Path) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: collection order
        return {}


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
