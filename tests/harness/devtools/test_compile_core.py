"""The machine-wide cache of mypyc builds (harness.devtools.compile_core): a fresh clone of
the same sources copies its build instead of compiling it; a build is never taken for
other sources, and a cached copy whose stamp does not hold is not left in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.devtools import compile_core
from trainguard.compiled_build import CompiledBuild


def _package(root: Path) -> CompiledBuild:
    """A package of one module with a build in place (its extension a stand-in file: the
    cache copies folders, it never loads them)."""
    source = root / "pkg"
    source.mkdir(parents=True)
    (source / "hot.py").write_text("def f(x: int) -> int:\n    return x + 1\n")
    target = CompiledBuild("pkg", source, ("hot",))
    target.folder.mkdir()
    (target.folder / "hot.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF built")
    target.stamp_file.write_text(json.dumps(target.stamp()))
    return target


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRAINGUARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_kept_build_is_restored_into_a_fresh_clone_of_the_same_sources(tmp_path: Path, cache: Path) -> None:
    built = _package(tmp_path / "first")
    compile_core.keep(built)
    assert compile_core.cached(built).parent == cache / "compiled"

    clone = _package(tmp_path / "clone")
    for path in clone.folder.iterdir():
        path.unlink()
    clone.folder.rmdir()
    assert not clone.is_current()
    assert compile_core.restore(clone)
    assert clone.is_current()
    assert (clone.folder / "hot.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"\x7fELF built"


def test_other_sources_find_no_build(tmp_path: Path, cache: Path) -> None:
    built = _package(tmp_path / "first")
    compile_core.keep(built)
    edited = _package(tmp_path / "edited")
    (edited.source / "hot.py").write_text("def f(x: int) -> int:\n    return x + 2\n")
    assert compile_core.cached(edited) != compile_core.cached(built)
    assert not compile_core.restore(edited)


def test_a_cached_copy_whose_stamp_does_not_hold_is_not_left_in_place(tmp_path: Path, cache: Path) -> None:
    built = _package(tmp_path / "first")
    compile_core.keep(built)
    kept = compile_core.cached(built)
    (kept / "stamp.json").write_text(json.dumps({**built.stamp(), "python": "cpython-299"}))
    clone = _package(tmp_path / "clone")
    assert not compile_core.restore(clone)
    assert not clone.folder.exists()  # the Python runs, as with no build


def test_importing_the_builder_leaves_which_build_runs_as_it_is() -> None:
    """The builder imports the packages it builds; a process that imports it first (a test
    worker) goes on running their compiled modules when the build is current (it once ran
    everything after as Python: every later compiled-vs-Python check in that worker failed)."""
    probe = (
        "import os, harness.devtools.compile_core\n"
        "from trainguard.schemas import block_check, compiled\n"
        "print(os.environ.get('TRAINGUARD_PURE_PYTHON'), block_check.__file__.endswith('.py'),"
        " compiled.BUILD.is_current())"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_PURE_PYTHON"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    setting, python, current = done.stdout.split()
    assert setting == "None" and python == str(current == "False")
