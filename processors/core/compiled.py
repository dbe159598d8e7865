"""The core compiled with mypyc (issue 20): which modules, and whether this process uses them.

The per-event core is pure Python, and a quiet step timing costs ~35 Python statements
(~1.2 us a row on the 16k drain), which no rearrangement of the Python got much below.
mypyc compiles the same typed modules to C: a compiled class's fields are C slots and a
call between compiled functions is a C call, so the whole decode and fold runs ~25%
faster (docs/benchmarks.md). `trainguard.devtools.compile_core` (run by `scripts/setup`)
builds MODULES into ``_compiled/`` beside this file, with a stamp of the sources it
compiled; the package then puts ``_compiled/`` first on its ``__path__``, so
``trainguard.processors.core.engine`` is the compiled engine.

The sources stay the truth. A build is used only while every source it was compiled from
is unchanged and for the same interpreter: edit a module and this process runs the
Python (with a warning to rebuild) rather than a stale build. ``TRAINGUARD_PURE_PYTHON=1``
runs the Python whatever was built (to debug, profile or monkeypatch the core). Without
a compiler or mypy (a plain ``pip install``) nothing is built and everything is as before.

Not compiled: modules that define pydantic models (the policies; mypyc checks a class
attribute's default against its annotation, and a pydantic ``Field(...)`` default fails
that check at import), and modules whose frozen dataclasses are pickled (a compiled
class is unpickled by setting its attributes, which a frozen one refuses). Both are off
the hot path. Compiled classes that snapshots pickle say so (``mypyc_attr(serializable=
True)``); a compiled class has no ``__dict__`` and takes no attribute it does not declare.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: Where the build goes, and its stamp (the sources' digests and the interpreter).
BUILD = HERE / "_compiled"
STAMP = BUILD / "stamp.json"
#: Set (to anything but "" or "0") to run the Python whatever was built.
PURE_ENV = "TRAINGUARD_PURE_PYTHON"

#: The compiled modules of trainguard.processors.core (module docstring: which are not).
MODULES = (
    "baseline",
    "block",
    "dedupe",
    "diagnosis",
    "engine",
    "eviction",
    "group_slowdown",
    "ids",
    "node_tests",
    "paging",
    "peer_loss",
    "quarantine",
    "repeat_step",
    "resume",
    "sdc",
    "sdc_cross",
    "stack_window",
    "state",
    "straggler",
    "straggler_state",
    "watchdog",
)


def stamp() -> dict[str, object]:
    """What a build is valid for: this interpreter and the current sources of MODULES."""
    digests = {name: hashlib.sha256((HERE / f"{name}.py").read_bytes()).hexdigest() for name in MODULES}
    return {"python": sys.implementation.cache_tag, "sources": digests}


def build_is_current() -> bool:
    """A build is there, and its stamp is this interpreter's and the current sources'."""
    try:
        return bool(json.loads(STAMP.read_text()) == stamp())
    except (OSError, ValueError):
        return False


def use_build(package_path: list[str]) -> bool:
    """Put a valid build first on the core package's `package_path` (its ``__path__``);
    False (the Python runs) when there is none, it is stale, or PURE_ENV is set."""
    if os.environ.get(PURE_ENV, "") not in ("", "0") or not STAMP.is_file():
        return False
    if not build_is_current():
        log.warning(
            "trainguard: the compiled core in %s is stale (a source changed since it was built): "
            "running the Python core; rebuild with `.venv/bin/python -m trainguard.devtools.compile_core`",
            BUILD,
        )
        return False
    package_path.insert(0, str(BUILD))
    return True


def active() -> bool:
    """Whether this process runs the compiled core."""
    from . import engine

    return bool(engine.__file__) and not str(engine.__file__).endswith(".py")
