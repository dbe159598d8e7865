"""A package's hot modules compiled by mypyc (issue 20): what a build is valid for, and
putting a valid one first on the package's path.

Each compiled package declares its modules and its build (processors/core/compiled.py,
schemas/compiled.py) and calls ``BUILD.use(__path__)`` before it imports them;
`harness.devtools.compile_core` (run by `scripts/setup`) builds every declared
package into ``_compiled/`` beside its sources, with a stamp of the sources it compiled.

The sources stay the truth. A build is used only while every source it was compiled from
is unchanged and for the same interpreter and platform: edit a module and this process runs the
Python (with a warning to rebuild) rather than a stale build. ``TRAINGUARD_PURE_PYTHON=1``
runs the Python whatever was built (to debug, profile or monkeypatch). Without a
compiler or mypy nothing is built and everything is Python. A wheel built from a tree that
holds valid builds carries them (pyproject's package data; the Dockerfile builds them in
a stage of its own), and an installed package uses them on the same terms.

Each package is its own build (its own mypyc group): a compiled module calls another
package's functions as Python, so one package's build never runs another's stale code.
This module imports nothing of trainguard: the lowest package (schemas) uses it too.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Set (to anything but "" or "0") to run the Python whatever was built.
PURE_ENV = "TRAINGUARD_PURE_PYTHON"


def pure_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class CompiledBuild:
    """The compiled build of `modules` of the package whose sources are in `source`."""

    #: The package's dotted name (its build's mypyc group is named after it).
    package: str
    source: Path
    #: Dotted below the package: "engine", or "detectors.sdc" for a sub-package's module.
    modules: tuple[str, ...]
    #: Sources of another package whose types this one's code was compiled against (mypyc
    #: checks a value's type where it crosses into compiled code): a change there leaves
    #: this build stale too.
    depends: tuple[Path, ...] = ()

    @property
    def folder(self) -> Path:
        return self.source / "_compiled"

    def module_path(self, module: str) -> Path:
        """The source of one of `modules`."""
        return self.source.joinpath(*module.split(".")).with_suffix(".py")

    @property
    def stamp_file(self) -> Path:
        return self.folder / "stamp.json"

    @property
    def group(self) -> str:
        return f"{self.package}.native"

    def stamp(self) -> dict[str, object]:
        """What a build is valid for: this interpreter, this platform's extensions (a wheel
        that carries a build may be installed elsewhere), and the current sources."""
        digests = {name: _digest(self.module_path(name)) for name in self.modules}
        digests.update({f"{path.parent.name}/{path.name}": _digest(path) for path in self.depends})
        platform = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
        return {"python": sys.implementation.cache_tag, "extensions": platform, "sources": digests}

    def is_current(self) -> bool:
        """A build is there, and its stamp is this interpreter's and the current sources'."""
        try:
            return bool(json.loads(self.stamp_file.read_text()) == self.stamp())
        except (OSError, ValueError):
            return False

    def use(self, package_path: list[str]) -> bool:
        """Put a valid build first on the package's `package_path` (its ``__path__``);
        False (the Python runs) when there is none, it is stale, or PURE_ENV is set."""
        if pure_requested() or not self.stamp_file.is_file():
            return False
        if not self.is_current():
            log.warning(
                "trainguard: the compiled build in %s is stale (a source changed since it was built): "
                "running the Python; rebuild with `.venv/bin/python -m harness.devtools.compile_core`",
                self.folder,
            )
            return False
        package_path.insert(0, str(self.folder))
        return True

    def use_in(self, subpackage_path: list[str], subpackage: str) -> bool:
        """A sub-package of the package (`subpackage`: its dotted name, `subpackage_path`:
        its ``__path__``) takes the build's folder of the same name first, when the package
        itself uses the build (its modules are built in ``_compiled/<sub-package>/``)."""
        parent = sys.modules.get(self.package)
        if parent is None or str(self.folder) not in list(getattr(parent, "__path__", ())):
            return False
        relative = subpackage.removeprefix(f"{self.package}.").split(".")
        subpackage_path.insert(0, str(self.folder.joinpath(*relative)))
        return True


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
