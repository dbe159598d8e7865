"""The pure policy core: deterministic detectors and policies over typed events.

No wall clock, no I/O: time comes from the events, outputs carry their reasons. Its hot
modules run compiled when a valid build is there (compiled.py), first on this package's
path; else the Python.
"""

from .compiled import BUILD

BUILD.use(__path__)

from .engine import Output, goodput, run_all, step, step_time_summary  # noqa: E402 (the build first)
from .policy import CorePolicy, HangPolicy  # noqa: E402
from .state import CoreState, IllegalTransition, RunPhase, RunState  # noqa: E402

__all__ = [
    "CorePolicy",
    "CoreState",
    "HangPolicy",
    "IllegalTransition",
    "Output",
    "RunPhase",
    "RunState",
    "goodput",
    "run_all",
    "step",
    "step_time_summary",
]
