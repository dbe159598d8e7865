"""The compiled builds travel in a wheel (pyproject's package data; the Dockerfile's
image is built that way): installed from a wheel, the package runs the builds whose stamp
still holds, and the Python of a package whose sources changed after its build."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainguard.compiled_build import pure_requested
from trainguard.processors.core import compiled as core_compiled
from trainguard.schemas import compiled as schemas_compiled

ROOT = Path(__file__).resolve().parents[2]
#: What a wheel is built from: the project file and the folders pyproject maps.
TREE = ("pyproject.toml", "README.md", "trainguard", "schemas", "producers", "processors", "sinks", "replay")
_WHICH = """
from trainguard.processors.core import compiled, engine
from trainguard.processors.core.detectors import watchdog
from trainguard.schemas import block_check
core_active = compiled.active() and not watchdog.__file__.endswith(".py")  # a sub-package's too
print(core_active, block_check.__file__.endswith(".py"), engine.__file__)
"""


@pytest.mark.skipif(
    pure_requested() or not (core_compiled.BUILD.is_current() and schemas_compiled.BUILD.is_current()),
    reason="no current compiled builds here to ship (scripts/setup makes them)",
)
def test_a_wheel_carries_the_builds_and_its_install_runs_them(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in TREE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(
                path, source / name, ignore=shutil.ignore_patterns("__pycache__", "_compiled.new")
            )
        else:
            shutil.copy2(path, source / name)
    # The block checks edited after their build: that build must not run once installed.
    with (source / "schemas" / "block_check.py").open("a") as edited:
        edited.write("\n# edited after the build\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)]
    subprocess.run(build, check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("trainguard-*.whl")
    target = tmp_path / "installed"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, cwd=tmp_path
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
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["compile"] and set(extras["compile"]) <= set(extras["dev"])
