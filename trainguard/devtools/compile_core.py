"""Compile the core's hot modules with mypyc (processors/core/compiled.py says which and why).

    .venv/bin/python -m trainguard.devtools.compile_core          # build unless up to date
    .venv/bin/python -m trainguard.devtools.compile_core --force  # build again

`scripts/setup` runs it. mypyc needs the modules under their package names, which the
repository maps from top-level folders (pyproject's package-dir): as `scripts/typecheck`
does, the build runs in a link tree shaped like the installed package (under
.trainguard/compile), and only the compiled extensions and their stamp are copied into
processors/core/_compiled/. About 30 s on two cores; needs mypy (the dev extra) and a
C compiler. A build that fails leaves no build: the core runs as Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRAINGUARD_PURE_PYTHON"] = "1"  # the builder itself runs the Python (no stale-build warning)
from trainguard.processors.core import compiled  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / ".trainguard" / "compile"
#: The shared library of the group lands beside the modules, inside the core package.
GROUP = "trainguard.processors.core.native"
_SETUP = """
from mypyc.build import mypycify
from setuptools import setup
paths = {paths!r}
setup(name="trainguard-core-compiled", py_modules=[], ext_modules=mypycify(paths, group_name={group!r}),
      script_args=["build_ext", "--build-lib", "out", "--build-temp", "tmp"])
"""


def build() -> Path:
    """Compile MODULES; return the folder the extensions were built in."""
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "trainguard"
    package.mkdir(parents=True)
    for path in (ROOT / "trainguard").iterdir():
        (package / path.name).symlink_to(path)
    for folder in ("schemas", "producers", "processors", "sinks", "replay"):
        (package / folder).symlink_to(ROOT / folder)
    # mypy's settings are the project's (pyproject.toml), as scripts/typecheck uses them.
    paths = ["--config-file", str(ROOT / "pyproject.toml")]
    paths += [f"trainguard/processors/core/{name}.py" for name in compiled.MODULES]
    (TREE / "setup_compiled.py").write_text(_SETUP.format(paths=paths, group=GROUP))
    subprocess.run([sys.executable, "setup_compiled.py"], cwd=TREE, check=True, stdout=subprocess.DEVNULL)
    return TREE / "out" / "trainguard" / "processors" / "core"


def install(built: Path) -> int:
    """Replace processors/core/_compiled with the new extensions and their stamp."""
    extensions = sorted(built.glob("*.so")) + sorted(built.glob("*.pyd"))
    staged = compiled.BUILD.with_name("_compiled.new")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for extension in extensions:
        shutil.copy2(extension, staged / extension.name)
    (staged / "stamp.json").write_text(json.dumps(compiled.stamp(), indent=1))
    shutil.rmtree(compiled.BUILD, ignore_errors=True)
    staged.rename(compiled.BUILD)
    return len(extensions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="build even when the build is up to date")
    args = parser.parse_args(argv)
    if not args.force and compiled.build_is_current():
        print(f"the compiled core in {compiled.BUILD} is up to date", file=sys.stderr)
        return 0
    started = time.monotonic()
    shutil.rmtree(compiled.BUILD, ignore_errors=True)  # a failed build leaves the Python in use
    try:
        count = install(build())
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"compiling the core failed ({exc}): the core runs as Python", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    print(f"compiled {count} extensions of the core into {compiled.BUILD} in {took:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
