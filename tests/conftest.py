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

from .variants import SLOW_MARK


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for parallel workers (scripts/test: pytest-xdist ``--dist loadgroup
    --no-loadscope-reorder``): a module's tests run on one worker (its module-scoped
    processors and launches made once), except each slow variant's case, a group of its
    own. The groups are handed out longest first, by their last measured length
    (tests/durations.json, harness/devtools/suite_durations.py), so that the last to end
    is a short one."""
    here = Path(__file__).parent
    known = _durations(here / "durations.json")

    def group(item: pytest.Item) -> str:
        if item.get_closest_marker(SLOW_MARK) is not None:
            return item.nodeid
        return str(item.path.relative_to(here))

    # A module's measured total, less its long cases that are not in its group this time
    # (each slow variant is a group of its own, or not collected).
    seconds: dict[str, float] = {}
    for module, total in known.items():
        if "::" not in module:
            cases = [v for k, v in known.items() if k.startswith(f"tests/{module}::")]
            seconds[module] = total - sum(cases)
    for item in items:
        name = group(item)
        if name == item.nodeid:
            seconds[name] = known.get(name, UNKNOWN_S)
        else:
            seconds[name] = seconds.get(name, 0.0) + known.get(
                item.nodeid, 0.0 if name in known else UNKNOWN_S
            )
        item.add_marker(pytest.mark.xdist_group(name))
    position = {name: i for i, name in enumerate(dict.fromkeys(group(item) for item in items))}
    items.sort(key=lambda item: (-seconds[group(item)], position[group(item)]))


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
