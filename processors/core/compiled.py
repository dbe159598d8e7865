"""The core compiled with mypyc (issue 20): which modules, and whether this process uses them.

The per-event core is pure Python, and a quiet step timing costs ~35 Python statements
(~1.2 us a row on the 16k drain), which no rearrangement of the Python got much below.
mypyc compiles the same typed modules to C: a compiled class's fields are C slots and a
call between compiled functions is a C call, so the whole decode and fold runs ~25%
faster (docs/benchmarks.md). `harness.devtools.compile_core` (run by `scripts/setup`)
builds MODULES into ``_compiled/`` beside this file; the package puts a valid build
first on its ``__path__`` (trainguard/compiled_build.py: when a build is valid, and
``TRAINGUARD_PURE_PYTHON=1``), so ``trainguard.processors.core.engine`` is the compiled
engine.

Not compiled: modules that define pydantic models (the policies; mypyc checks a class
attribute's default against its annotation, and a pydantic ``Field(...)`` default fails
that check at import), and modules whose frozen dataclasses are pickled (a compiled
class is unpickled by setting its attributes, which a frozen one refuses). Both are off
the hot path. Compiled classes that snapshots pickle say so (``mypyc_attr(serializable=
True)``); a compiled class has no ``__dict__`` and takes no attribute it does not declare.
"""

from __future__ import annotations

from pathlib import Path

from ...compiled_build import CompiledBuild
from ...schemas import compiled as schemas_compiled

#: The compiled modules of trainguard.processors.core, dotted below it (a sub-package's
#: module is built in _compiled/<sub-package>/; module docstring: which are not).
MODULES = (
    "accounting.baseline",
    "accounting.baseline_state",
    "accounting.goodput_state",
    "decisions.eviction",
    "decisions.node_tests",
    "decisions.paging",
    "decisions.quarantine",
    "decisions.repeat_step",
    "decisions.resume",
    "dedupe",
    "detectors.diagnosis",
    "detectors.group_slowdown",
    "detectors.peer_loss",
    "detectors.sdc",
    "detectors.sdc_cross",
    "detectors.stack_window",
    "detectors.straggler",
    "detectors.straggler_state",
    "detectors.watchdog",
    "engine",
    "folds.block",
    "folds.quiet",
    "folds.stored",
    "ids",
    "state",
)

#: The core takes the schemas' rows (schemas/event_check.py, compiled too) as typed values.
BUILD = CompiledBuild(
    "trainguard.processors.core",
    Path(__file__).parent,
    MODULES,
    (schemas_compiled.BUILD.source / "event_check.py",),
)


def active() -> bool:
    """Whether this process runs the compiled core."""
    from . import engine

    return bool(engine.__file__) and not str(engine.__file__).endswith(".py")
