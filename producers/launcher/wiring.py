"""Wiring a launcher to Kafka and to the process: its actuator (rank -1, journaled, so a
relaunched launcher executes a claimed but unrecorded command once) and its signal
handlers."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...schemas import RUN_LEVEL_RANK
from .launcher import Launcher

log = logging.getLogger(__name__)


def make_actuator(
    launcher: Launcher, bootstrap: str, commands_topic: str, acks_topic: str, master_secret: bytes
) -> Any:
    """An Actuator for the launcher (rank -1: it answers commands addressed to every rank,
    which is how the processor sends Abort, QuarantineNode, EvictRank and Rollback), with
    its journal under the run dir, and the launcher's handlers registered.

    A relaunch after a SIGKILL: the actuator's journal claims a command id before the
    handler runs (at most once), the launcher's records it when executed; an id claimed
    but never recorded (the predecessor died in between) was not executed, so the gate
    forgets it and the redelivered command runs once. The actuator joins no consumer
    group (it assigns its partitions itself), so a relaunched launcher reads the unacked
    commands at once, while the recovery still accepts the interrupted attempt's."""
    from ...schemas import auth
    from ..command_roles import Role, kinds_of
    from ..rank.actuator import Actuator

    journal = launcher.run_dir / "launcher.journal"
    actuator = Actuator(
        bootstrap,
        commands_topic,
        acks_topic,
        launcher.config.run_id,
        attempt=launcher.attempt,
        local_ranks=[RUN_LEVEL_RANK],
        key=auth.run_key(master_secret, launcher.config.run_id),
        # Across hosts each agent acks as its host (every agent reads every command).
        node=launcher.config.node if launcher.config.rendezvous is not None else "launcher",
        instance=f"launcher-{launcher.config.node}" if launcher.config.rendezvous is not None else "launcher",
        journal_path=journal,
        executes=kinds_of(Role.LAUNCHER),
    )
    for command_id in launcher.unexecuted(_claimed(journal, launcher.config.run_id)):
        log.warning("recovery: command %s was claimed but never executed; it may run once", command_id)
        actuator.gate.forget(RUN_LEVEL_RANK, command_id)
    launcher.register(actuator)
    return actuator


def _claimed(path: Path, run_id: str) -> list[str]:
    """Command ids the launcher's actuator journal holds for rank -1 (its format:
    one JSON [run_id, rank, command_id] a line)."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rid, rank, command_id = json.loads(line)
        except (ValueError, TypeError):
            continue
        if rid == run_id and rank == RUN_LEVEL_RANK and isinstance(command_id, str):
            out.append(command_id)
    return out


def install_signal_handlers(
    launcher: Launcher, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)
) -> None:
    """SIGINT/SIGTERM stop the launcher: the group is torn down, exits reported requested."""
    for sig in signals:
        signal.signal(sig, lambda *_: launcher.stop())
