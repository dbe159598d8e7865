"""The cluster simulator: the events N real ranks would emit (8 to 16,384 of them), with
faults injected from a scenario file. A pure, deterministic core
(:class:`SimulatedCluster`) plus a thin real-time driver (:func:`run_simulation`)."""

from .cluster import CommandRefused, CommandResult, FiredFault, LauncherNote, Phase, SimulatedCluster
from .scenario import FaultTruth, Scenario, ScenarioError

__all__ = [
    "CommandRefused",
    "CommandResult",
    "FaultTruth",
    "FiredFault",
    "LauncherNote",
    "Phase",
    "Scenario",
    "ScenarioError",
    "SimulatedCluster",
]
