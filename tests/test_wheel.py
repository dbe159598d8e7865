"""The product's wheel, built once here from a copy of the repository: what it carries
and what it leaves out.

- The product and nothing else (issue 48): every module of the folders pyproject maps
  under `trainguard`, and none of the development harness (harness/: the test streams, the
  scenario scoring, the harms, the oracle, the soak, the devtools), which is a
  distribution of its own (harness/pyproject.toml, version pinned with the product's).
- The compiled builds (pyproject's package data; the Dockerfile's image is built that
  way): installed from the wheel, the package runs the builds whose stamp still holds,
  and the Python of a package whose sources changed after its build."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from trainguard.compiled_build import pure_requested
from trainguard.processors.core import compiled as core_compiled
from trainguard.schemas import compiled as schemas_compiled

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Not copied: what is no source of the repository (environments, caches, local state).
NOT_SOURCE = (".git", ".venv", "node_modules", ".trainguard", "__pycache__", "*.egg-info", "build", "dist")
NOT_SOURCE += (".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "_compiled.new")
_WHICH = """
from trainguard.processors.core import compiled, engine
from trainguard.processors.core.detectors import watchdog
from trainguard.schemas import block_check
core_active = compiled.active() and not watchdog.__file__.endswith(".py")  # a sub-package's too
print(core_active, block_check.__file__.endswith(".py"), engine.__file__)
"""


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product's wheel, as `pip wheel` builds it from the whole repository (the harness
    included: the wheel must leave it out), with the block checks edited after their build
    (test_a_wheel_carries_the_builds_and_its_install_runs_them)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    with (source / "schemas" / "block_check.py").open("a") as edited:
        edited.write("\n# edited after the build\n")
    build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)]
    subprocess.run(build, check=True, cwd=tmp_path)
    (built,) = (tmp_path / "dist").glob("trainguard-*.whl")
    return built


def product_modules() -> set[str]:
    """Every module of the folders pyproject maps under `trainguard`, as a wheel names it."""
    out = set()
    for package, folder in PROJECT["tool"]["setuptools"]["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT / folder)
            if "_compiled" in relative.parts[0] or "__pycache__" in relative.parts:
                continue
            out.add("/".join([*package.split("."), *relative.parts]))
    return out


#: The development harness's modules, by name: none of them is in the wheel.
HARNESS_NAMES = ("harness", "devtools", "scoring", "oracle", "soak", "harms", "evaluate", "streams")


def test_the_wheel_carries_the_product_and_not_the_harness(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    modules = {name for name in names if name.endswith(".py")}
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"trainguard"}
    assert [m for m in sorted(modules) if any(word in m for word in HARNESS_NAMES)] == []
    assert not modules & {"trainguard/replay/capacity.py", "trainguard/replay/prediction.py"}
    # The product's own: every module of its folders (a sub-package left off pyproject's
    # package list would be missing here), its policies and scenarios.
    expected = product_modules()
    assert len(expected) > 150 and "trainguard/replay/prediction_backtest.py" in expected
    assert sorted(expected - modules) == []
    assert "trainguard/processors/policies/demo.yaml" in names
    assert any(name.startswith("trainguard/producers/simulator/scenarios/library/") for name in names)
    # No development command: the harness's entry point is the harness's own.
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "trainguard.cli" not in text.replace("trainguard.cli:main", "")


def test_the_harness_is_a_distribution_pinned_with_the_product() -> None:
    harness = tomllib.loads((ROOT / "harness" / "pyproject.toml").read_text())
    version = PROJECT["project"]["version"]
    assert harness["project"]["version"] == version
    assert f"trainguard=={version}" in harness["project"]["dependencies"]
    commands = harness["project"]["entry-points"]["trainguard.cli"]
    assert commands == {"devtools": "harness.devtools.cli:register"}
    assert "entry-points" not in PROJECT["project"]


@pytest.mark.skipif(
    pure_requested() or not (core_compiled.BUILD.is_current() and schemas_compiled.BUILD.is_current()),
    reason="no current compiled builds here to ship (scripts/setup makes them)",
)
def test_a_wheel_carries_the_builds_and_its_install_runs_them(wheel: Path, tmp_path: Path) -> None:
    # The wheel's block checks were edited after their build: that build must not run.
    target = tmp_path / "installed"
    subprocess.run(
        [*PIP, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, cwd=tmp_path
    )
    carried = target / "trainguard/processors/core/_compiled"
    assert sorted(p.name for p in carried.glob("engine.*"))
    assert sorted(p.name for p in carried.glob("detectors/watchdog.*"))  # a sub-package's module

    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}  # (no PURE_ENV: the builds may run)
    out = subprocess.run(
        [sys.executable, "-c", _WHICH], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    core_active, schemas_python, engine_file = out.stdout.split()
    assert core_active == "True" and engine_file.startswith(str(target))  # the installed core's build
    assert schemas_python == "True" and "stale" in out.stderr  # the edited package: its Python, and a warning


def test_the_compile_extra_pins_what_the_dev_extra_does() -> None:
    """The Dockerfile's build stage installs the compile extra, scripts/setup the dev one:
    both build with the same mypy."""
    extras = PROJECT["project"]["optional-dependencies"]
    assert extras["compile"] and set(extras["compile"]) <= set(extras["dev"])
