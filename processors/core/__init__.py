"""The pure policy core: deterministic detectors and policies over typed events.

No wall clock, no I/O: time comes from the events, outputs carry their reasons.
"""

from .engine import Output, goodput, run_all, step, step_time_summary
from .policy import CorePolicy, HangPolicy
from .state import CoreState, IllegalTransition, RunPhase, RunState

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
