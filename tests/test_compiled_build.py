"""A compiled build (trainguard/compiled_build.py) is used only while it is valid: built
for this interpreter from the current sources, and not refused by PURE_ENV."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest

from trainguard.compiled_build import PURE_ENV, CompiledBuild
from trainguard.processors.core import compiled as core_compiled
from trainguard.schemas import compiled as schemas_compiled


@pytest.fixture
def build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CompiledBuild:
    """A package of our own (the real builds are left alone): two modules, no build yet."""
    for name in ("engine", "state"):
        (tmp_path / f"{name}.py").write_text(f"NAME = {name!r}\n")
    monkeypatch.delenv(PURE_ENV, raising=False)
    target = CompiledBuild("pkg.core", tmp_path, ("engine", "state"))
    target.folder.mkdir()
    return target


def test_a_build_for_these_sources_goes_first_on_the_path(build: CompiledBuild) -> None:
    build.stamp_file.write_text(json.dumps(build.stamp()))
    path = ["/the/sources"]
    assert build.use(path)
    assert path == [str(build.folder), "/the/sources"]
    assert build.group == "pkg.core.native"


def test_no_build_or_a_stale_one_leaves_the_python(
    build: CompiledBuild, caplog: pytest.LogCaptureFixture
) -> None:
    path = ["/the/sources"]
    assert not build.use(path)  # nothing built
    build.stamp_file.write_text(json.dumps(build.stamp()))
    (build.source / "engine.py").write_text("NAME = 'the engine, edited since'\n")
    with caplog.at_level(logging.WARNING):
        assert not build.use(path)
    assert path == ["/the/sources"] and "stale" in caplog.text
    build.stamp_file.write_text(json.dumps({**build.stamp(), "python": "cpython-27"}))
    assert not build.use(path)  # another interpreter's build
    build.stamp_file.write_text("{not json")
    assert not build.use(path)
    sources = dict(build.stamp()["sources"])  # type: ignore[call-overload]
    assert sources["engine"] == hashlib.sha256(b"NAME = 'the engine, edited since'\n").hexdigest()


def test_pure_python_on_request(build: CompiledBuild, monkeypatch: pytest.MonkeyPatch) -> None:
    build.stamp_file.write_text(json.dumps(build.stamp()))
    monkeypatch.setenv(PURE_ENV, "1")
    assert not build.use(path := ["/the/sources"]) and path == ["/the/sources"]


def test_a_sub_package_takes_its_folder_of_the_build_when_the_package_uses_it(
    build: CompiledBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The core's concerns are sub-packages (detectors/, ...): their modules are built in
    # _compiled/<sub-package>/, used exactly when the package's build is.
    (build.source / "detectors").mkdir()
    (build.source / "detectors" / "watchdog.py").write_text("NAME = 'watchdog'\n")
    nested = CompiledBuild("pkg.core", build.source, ("engine", "detectors.watchdog"))
    assert nested.module_path("detectors.watchdog") == build.source / "detectors" / "watchdog.py"
    assert "detectors.watchdog" in nested.stamp()["sources"]  # type: ignore[operator]
    package = type(pytest)("pkg.core")
    package.__path__ = [str(build.source)]
    monkeypatch.setitem(sys.modules, "pkg.core", package)
    sub_path = [str(build.source / "detectors")]
    assert not nested.use_in(sub_path, "pkg.core.detectors")  # the package runs its Python
    assert sub_path == [str(build.source / "detectors")]
    nested.stamp_file.write_text(json.dumps(nested.stamp()))
    assert nested.use(package.__path__)
    assert nested.use_in(sub_path, "pkg.core.detectors")
    assert sub_path == [str(build.folder / "detectors"), str(build.source / "detectors")]


def test_each_compiled_package_declares_modules_of_its_own_folder() -> None:
    for target in (core_compiled.BUILD, schemas_compiled.BUILD):
        assert target.modules and all(target.module_path(m).is_file() for m in target.modules)
        assert target.source.name == target.package.rsplit(".", 1)[1]
    assert "compiled" not in core_compiled.MODULES + schemas_compiled.MODULES  # the loaders stay Python


def test_a_change_to_a_source_the_build_depends_on_leaves_it_stale(
    build: CompiledBuild, tmp_path: Path
) -> None:
    """mypyc checks a value's type where it enters compiled code: the core's build, made
    against the schemas' row types (schemas/event_check.py), refused the rows of a changed
    Row type. A change to a source it depends on leaves it stale, one elsewhere does not."""
    other = tmp_path / "schemas"
    other.mkdir()
    (other / "rows.py").write_text("Row = tuple[str, dict]\n")
    (other / "checks.py").write_text("LIMIT = 1\n")
    dependent = CompiledBuild("pkg.core", build.source, build.modules, (other / "rows.py",))
    dependent.stamp_file.write_text(json.dumps(dependent.stamp()))
    assert dependent.use(["/the/sources"])
    (other / "checks.py").write_text("LIMIT = 2\n")
    assert dependent.use(["/the/sources"])
    (other / "rows.py").write_text("Row = tuple[str, dict | str]\n")
    assert not dependent.use(["/the/sources"])


def test_the_cores_build_depends_on_the_row_types_it_takes() -> None:
    assert schemas_compiled.BUILD.source / "event_check.py" in core_compiled.BUILD.depends
