"""Who executes which command: one handler interface for every role that executes
commands, and the table of which roles must execute each command kind.

Three roles execute commands: every rank process (producers/rank/handlers.py), the
launcher that supervises a job's ranks (producers/launcher/commands.py), and the
simulated cluster (producers/simulator/cluster.py), which stands in for both at scale.
Each exposes its handlers as one table, `command_handlers()`, so a command kind is
handled once per role, and tests/producers/test_command_roles.py fails when a role
lacks a handler the table below requires (or has one the table does not list).

A handler takes the command and the rank it runs for (-1: the launcher) and returns the
detail of its ack; the simulator's return the detail too (its signature adds the
events a command makes the simulated job emit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, Protocol

from ..schemas.commands import (
    COMMAND_KINDS,
    Abort,
    CheckpointNow,
    Command,
    DrainNode,
    EvictRank,
    InterruptionDecided,
    PauseRun,
    QuarantineNode,
    ReleaseNode,
    ResumeFrom,
    Rollback,
    RunCrossRankCheck,
    RunNodeSelfTest,
    RunRingCheck,
    RunSelfCheck,
    SetCheckpointInterval,
    SkipUpdate,
)


class Role(StrEnum):
    RANK = "rank"  # every rank process: its training loop's flags, checks and exit
    LAUNCHER = "launcher"  # trainguard launch: processes, nodes, restarts
    SIMULATOR = "simulator"  # the simulated cluster: both of the above, for N ranks


class CommandHandlers(Protocol):
    """What every role implements: its handlers, one per command kind it executes."""

    def command_handlers(self) -> Mapping[type[Command], Callable[..., Any]]: ...


_RANK, _LAUNCHER, _SIM = Role.RANK, Role.LAUNCHER, Role.SIMULATOR

#: The roles that must execute each command kind. A rank acts inside its process (a
#: checkpoint, a check, its exit); the launcher acts on processes and nodes (restart,
#: quarantine, pause); the simulator models both.
EXECUTED_BY: Mapping[type[Command], frozenset[Role]] = {
    CheckpointNow: frozenset({_RANK, _SIM}),
    SetCheckpointInterval: frozenset({_RANK, _LAUNCHER, _SIM}),  # now, and for the next attempt
    Abort: frozenset({_RANK, _LAUNCHER, _SIM}),  # ranks leave; the launcher tears down and restarts
    SkipUpdate: frozenset({_RANK, _LAUNCHER, _SIM}),  # ranks skip; the launcher passes it to the next attempt
    RunSelfCheck: frozenset({_RANK, _SIM}),
    RunRingCheck: frozenset({_RANK, _SIM}),
    RunCrossRankCheck: frozenset({_RANK, _SIM}),
    EvictRank: frozenset({_LAUNCHER, _SIM}),
    QuarantineNode: frozenset({_LAUNCHER, _SIM}),
    RunNodeSelfTest: frozenset({_LAUNCHER, _SIM}),
    ResumeFrom: frozenset({_RANK, _LAUNCHER, _SIM}),
    Rollback: frozenset({_RANK, _LAUNCHER, _SIM}),
    PauseRun: frozenset({_LAUNCHER, _SIM}),
    ReleaseNode: frozenset({_LAUNCHER, _SIM}),
    InterruptionDecided: frozenset({_LAUNCHER, _SIM}),  # the launcher restarts without waiting more
    DrainNode: frozenset({_LAUNCHER, _SIM}),  # the launcher ends the attempt at a boundary, swaps the node
}


def kinds_of(role: Role) -> frozenset[type[Command]]:
    """The command kinds `role` executes. An actuator given them passes over another
    role's command unacked (a QuarantineNode addressed to every rank is the launcher's,
    not each rank's), instead of failing it for want of a handler."""
    return frozenset(kind for kind, roles in EXECUTED_BY.items() if role in roles)


def missing_handlers(role: Role, handlers: CommandHandlers) -> list[str]:
    """The command kinds `role` must execute and has no handler for, and those it handles
    that the table does not give it: both empty when the role matches the table."""
    have = set(handlers.command_handlers())
    required = [k for k in COMMAND_KINDS if role in EXECUTED_BY[k]]
    problems = [f"{role}: no handler for {k.KIND}" for k in required if k not in have]
    extra = [k for k in have if role not in EXECUTED_BY.get(k, ())]
    return problems + [f"{role}: handles {k.KIND}, not in EXECUTED_BY" for k in extra]


#: Kinds a gate accepts from an earlier attempt of the run too (producers/rank/gate.py):
#: about a node, not about one attempt's processes (a node's fault outlives the attempt
#: that found it; across hosts the lost host is named when the next world has formed, its
#: attempt already started), and the processor's go-ahead, which may come after the
#: launcher stopped waiting for it.
_LASTING: tuple[type[Command], ...] = (QuarantineNode, ReleaseNode, InterruptionDecided)
OUTLIVE_THEIR_ATTEMPT: frozenset[type[Command]] = frozenset(_LASTING)
