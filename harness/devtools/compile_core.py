"""Compile the hot modules with mypyc (trainguard/compiled_build.py: when a build is used;
processors/core/compiled.py and schemas/compiled.py: which modules and why).

    .venv/bin/python -m harness.devtools.compile_core          # build what is not up to date
    .venv/bin/python -m harness.devtools.compile_core --force  # build everything again

`scripts/setup` runs it. mypyc needs the modules under their package names, which the
repository maps from top-level folders (pyproject's package-dir): as `scripts/typecheck`
does, the build runs in a link tree shaped like the installed package (under
.trainguard/compile), and only the compiled extensions and their stamp are copied into
each package's _compiled/. Each package is its own mypyc group, built by its own run
(its modules call another package's as Python). About 35 s on two cores; needs mypy
(the dev extra) and a C compiler. A build that fails leaves no build: that package runs
as Python.

Builds are kept in the machine's cache (`$TRAINGUARD_CACHE`, else ~/.cache/trainguard,
under compiled/), keyed by what makes one valid (the stamp: interpreter, platform,
sources) and by what made it (mypy's version, the project's mypy settings): a fresh clone
of the same sources copies its build from there instead of compiling for a minute.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mypy.version import __version__ as MYPY_VERSION

from harness.devtools.broker_jars import cache_root

# The builder imports the packages it builds (their BUILD declarations): a stale build's
# warning is its own to fix, not to print. Which build runs is left as the process has it
# (a test that imports this module goes on running the compiled modules).
_stale_warning = logging.getLogger("trainguard.compiled_build")
_stale_warning.disabled = True
try:
    from trainguard.compiled_build import CompiledBuild
    from trainguard.processors.core import compiled as core_compiled
    from trainguard.schemas import compiled as schemas_compiled
finally:
    _stale_warning.disabled = False

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / ".trainguard" / "compile"
#: Every compiled package's build, in build order.
BUILDS: tuple[CompiledBuild, ...] = (schemas_compiled.BUILD, core_compiled.BUILD)
_SETUP = """
from mypyc.build import mypycify
from setuptools import setup
paths = {paths!r}
setup(name="trainguard-compiled", py_modules=[], ext_modules=mypycify(paths, group_name={group!r}),
      script_args=["build_ext", "--build-lib", {out!r}, "--build-temp", {tmp!r}])
"""


def link_tree() -> None:
    """The repository shaped like the installed package, under TREE."""
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "trainguard"
    package.mkdir(parents=True)
    for path in (ROOT / "trainguard").iterdir():
        (package / path.name).symlink_to(path)
    for folder in ("schemas", "producers", "processors", "sinks", "replay"):
        (package / folder).symlink_to(ROOT / folder)


def build(target: CompiledBuild) -> Path:
    """Compile one package's modules; return the folder its extensions were built in."""
    relative = Path(*target.package.split("."))
    name = target.package.replace(".", "_")
    # mypy's settings are the project's (pyproject.toml), as scripts/typecheck uses them.
    paths = ["--config-file", str(ROOT / "pyproject.toml")]
    paths += [str(relative.joinpath(*module.split(".")).with_suffix(".py")) for module in target.modules]
    script = TREE / f"setup_{name}.py"
    script.write_text(_SETUP.format(paths=paths, group=target.group, out=f"out_{name}", tmp=f"tmp_{name}"))
    subprocess.run([sys.executable, script.name], cwd=TREE, check=True, stdout=subprocess.DEVNULL)
    return TREE / f"out_{name}" / relative


def install(target: CompiledBuild, built: Path) -> int:
    """Replace the package's _compiled/ with the new extensions and their stamp (a
    sub-package's in a folder of its name, as mypyc built them)."""
    extensions = sorted(built.rglob("*.so")) + sorted(built.rglob("*.pyd"))
    staged = target.folder.with_name("_compiled.new")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for extension in extensions:
        copy = staged / extension.relative_to(built)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(extension, copy)
    (staged / "stamp.json").write_text(json.dumps(target.stamp(), indent=1))
    shutil.rmtree(target.folder, ignore_errors=True)
    staged.rename(target.folder)
    return len(extensions)


def cached(target: CompiledBuild) -> Path:
    """Where `target`'s build for the current sources is kept in the machine's cache."""
    made_by = {"stamp": target.stamp(), "mypy": MYPY_VERSION, "settings": _digest(ROOT / "pyproject.toml")}
    key = hashlib.sha256(json.dumps(made_by, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "compiled" / f"{target.package}-{key}"


def restore(target: CompiledBuild) -> bool:
    """`target`'s build copied from the machine's cache; False when it has none (or the copy
    is not current after all: then nothing is left in place)."""
    kept = cached(target)
    if not (kept / "stamp.json").is_file():
        return False
    staged = target.folder.with_name("_compiled.new")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(kept, staged)
    shutil.rmtree(target.folder, ignore_errors=True)
    staged.rename(target.folder)
    if target.is_current():
        return True
    shutil.rmtree(target.folder, ignore_errors=True)
    return False


def keep(target: CompiledBuild) -> None:
    """A new build into the machine's cache (written aside, then renamed: a clone that reads
    the cache meanwhile sees a whole build or none)."""
    kept = cached(target)
    staged = kept.with_name(f"{kept.name}.{os.getpid()}")
    try:
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(target.folder, staged)
        shutil.rmtree(kept, ignore_errors=True)
        staged.rename(kept)
    except OSError as exc:  # the cache is a convenience: a read-only home loses nothing
        shutil.rmtree(staged, ignore_errors=True)
        print(f"the build of {target.package} was not kept in {kept.parent}: {exc}", file=sys.stderr)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="build even what is up to date")
    args = parser.parse_args(argv)
    todo = [target for target in BUILDS if args.force or not target.is_current()]
    for target in (target for target in BUILDS if target not in todo):
        print(f"the compiled build in {target.folder} is up to date", file=sys.stderr)
    for target in [] if args.force else list(todo):
        if restore(target):
            print(f"the compiled build of {target.package} copied from {cached(target)}", file=sys.stderr)
            todo.remove(target)
    if todo:
        link_tree()
    failed = 0
    for target in todo:
        started = time.monotonic()
        shutil.rmtree(target.folder, ignore_errors=True)  # a failed build leaves the Python in use
        try:
            count = install(target, build(target))
            keep(target)
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"compiling {target.package} failed ({exc}): it runs as Python", file=sys.stderr)
            failed += 1
            continue
        took = time.monotonic() - started
        print(
            f"compiled {count} extensions of {target.package} into {target.folder} in {took:.0f} s",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
