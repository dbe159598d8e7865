"""Finding Java 17+ and Maven, and fetching the broker's jars once (broker_jars.py).

The test marked `broker` runs mvn and java for real; it is skipped, with the reason, when
java 17+ or mvn is missing. The rest are unit tests with no tools.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.devtools import broker_jars as jars
from harness.devtools.broker_jars import MissingToolError, ensure_jars, parse_java_major


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "21" 2023-09-19', 21),
    ],
)
def test_parse_java_major(output: str, major: int) -> None:
    assert parse_java_major(output) == major


def _which(present: set[str]) -> Callable[[str], str | None]:
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_missing_java_names_it_and_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(jars.shutil, "which", _which({"mvn"}))
    with pytest.raises(MissingToolError, match=r"`java` not found.*apt-get install openjdk-17-jre-headless"):
        ensure_jars(tmp_path)


def test_old_java_is_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(jars.shutil, "which", _which({"java", "mvn"}))
    monkeypatch.setattr(jars, "java_major_version", lambda java: 11)
    with pytest.raises(MissingToolError, match=r"Java 11; Kafka 4\.1\.1 needs Java 17\+"):
        ensure_jars(tmp_path)


def test_missing_mvn_names_it_and_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(jars.shutil, "which", _which({"java"}))
    monkeypatch.setattr(jars, "java_major_version", lambda java: 17)
    with pytest.raises(MissingToolError, match=r"`mvn` \(Apache Maven\) not found.*apt-get install"):
        ensure_jars(tmp_path)


@pytest.mark.broker
def test_second_ensure_jars_does_not_run_mvn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    try:
        jars.find_java()
        jars.find_mvn()
    except MissingToolError as exc:
        pytest.skip(str(exc))
    calls: list[list[str]] = []
    real_run = jars.subprocess.run

    def counting_run(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        calls.append([str(c) for c in cmd])
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(jars.subprocess, "run", counting_run)
    first = ensure_jars(tmp_path)
    mvn_calls = [c for c in calls if Path(c[0]).name == "mvn"]
    assert len(mvn_calls) == 1
    assert (first / "kafka_2.13-4.1.1.jar").is_file()
    assert (first / "slf4j-api-2.0.17.jar").is_file()
    assert not list(first.glob("slf4j-api-1.*.jar"))  # would silence log4j-slf4j2-impl
    stamp = json.loads((first.parent / "jars.ok").read_text())
    assert "log4j-core-2.25.3.jar" in stamp["jars"]

    calls.clear()
    monkeypatch.setattr(jars, "find_mvn", lambda: pytest.fail("mvn looked up although cached"))
    started = time.monotonic()
    assert ensure_jars(tmp_path) == first
    assert time.monotonic() - started < 5
    assert [Path(c[0]).name for c in calls] == ["java"]  # java -version only
