"""What the run-level simulators share (longrun.py's month-long run, fleet.py's failure
prediction run): the Llama 3 failure rate, the pool of nodes with its spares, the
envelope of the launcher's and the reporting rank's records, the commands a run-level
model executes (the checkpoint interval, a node's quarantine), and a checkpoint's
records.

A run-level simulator emits what the launcher and ONE reporting rank see, not every
rank's telemetry: a month at 16,384 ranks per rank and per step would be ~10^11 events,
and the decision layer needs the run's course, not each rank's step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...schemas import (
    CheckpointValidated,
    CheckpointWritten,
    Command,
    QuarantineNode,
    RunStarted,
    SetCheckpointInterval,
)

#: Llama 3 (Dubey et al., 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384
DAY_S = 86_400.0


def llama3_mtbf_s(world_size: int) -> float:
    """The Llama 3 job MTBF scaled inversely with the world size (3.09 h at 16,384 GPUs)."""
    return LLAMA3_DAYS * DAY_S / LLAMA3_INTERRUPTIONS * LLAMA3_GPUS / world_size


class RunLevel:
    """A run's node pool and the records of its launcher and reporting rank (rank 0).

    Nodes are ``n00000``...; a quarantined node leaves the pool at the next launch and a
    spare (``spare00001``...) takes its place in the same rack. `intervals` and
    `quarantined` record what the core's commands changed, for the run's truth."""

    def __init__(
        self,
        run_id: str,
        world_size: int,
        ranks_per_node: int,
        nodes_per_rack: int,
        interval_s: float,
        start_ts: float,
    ) -> None:
        self.run_id = run_id
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        n_nodes = math.ceil(world_size / ranks_per_node)
        self.nodes = [f"n{i:05d}" for i in range(n_nodes)]
        self.racks = {node: f"rack{i // nodes_per_rack:03d}" for i, node in enumerate(self.nodes)}
        self.spares = 0
        self.pending_quarantine: list[str] = []
        self.attempt = 0
        self.seq = 0
        self.interval_s = interval_s
        #: (ts, interval in seconds) each time the interval in force changed.
        self.intervals: list[tuple[float, float]] = [(start_ts, interval_s)]
        #: The nodes that left the pool, in order.
        self.quarantined: list[str] = []

    def event_id(self) -> str:
        self.seq += 1
        return f"{self.run_id}-{self.seq:09d}"

    def envelope(self, rank: int, step: int, ts: float) -> dict[str, object]:
        node = self.nodes[rank // self.ranks_per_node] if rank >= 0 else ""
        return {
            "event_id": self.event_id(),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "rank": rank,
            "node": node,
            "step": step,
            "ts": ts,
        }

    def command_handlers(self) -> dict[type[Command], Callable[[Any, float], None]]:
        """The simulator role's handlers for what a run-level model has: the checkpoint
        interval and the node pool. The other kinds act on ranks this model does not have
        (checks, skips, a rank's exit) or on restarts it draws itself (Abort, Rollback), so
        they are deliberately not modelled here; producers/simulator/cluster.py models
        every kind per rank (producers/command_roles.py)."""
        return {SetCheckpointInterval: self._set_interval, QuarantineNode: self._quarantine}

    def apply(self, commands: list[Command], ts: float) -> None:
        handlers = self.command_handlers()
        for command in commands:
            handler = handlers.get(type(command))
            if handler is not None:
                handler(command, ts)

    def _set_interval(self, command: SetCheckpointInterval, ts: float) -> None:
        if command.interval_s != self.interval_s:
            self.interval_s = command.interval_s
            self.intervals.append((ts, command.interval_s))

    def _quarantine(self, command: QuarantineNode, ts: float) -> None:
        if command.node in self.racks:
            self.pending_quarantine.append(command.node)

    def relaunch_nodes(self) -> list[tuple[str, str]]:
        """Quarantined nodes leave the pool before the next launch: a spare takes each
        place (in the same rack). Returns (node, its spare) for each one replaced."""
        replaced = []
        for node in self.pending_quarantine:
            if node in self.nodes:
                self.spares += 1
                spare = f"spare{self.spares:05d}"
                self.racks[spare] = self.racks[node]
                self.nodes[self.nodes.index(node)] = spare
                self.quarantined.append(node)
                replaced.append((node, spare))
        self.pending_quarantine.clear()
        return replaced

    def run_started(self, ts: float, resumed_from_step: int, **fields: Any) -> RunStarted:
        """The launcher's record of the current attempt."""
        return RunStarted(
            **self.envelope(-1, resumed_from_step, ts),
            world_size=self.world_size,
            ranks_per_node=self.ranks_per_node,
            nodes=self.nodes,
            racks=self.racks,
            resumed_from_step=resumed_from_step,
            **fields,
        )

    def checkpoint(
        self, step: int, ts: float, checkpoint_s: float
    ) -> tuple[CheckpointWritten, CheckpointValidated]:
        """A checkpoint after `step`, blocking `checkpoint_s`, written and validated at `ts`."""
        uri = f"sim://{self.run_id}/ckpt/step-{step:09d}"
        written = CheckpointWritten(
            **self.envelope(0, step, ts),
            checkpoint_step=step,
            uri=uri,
            shards=self.world_size,
            digest=f"sha256:{step:064x}",
            bytes=0,
            blocking_s=checkpoint_s,
            write_s=checkpoint_s,
        )
        validated = CheckpointValidated(
            **self.envelope(-1, step, ts), checkpoint_step=step, uri=uri, last_verified_step=step
        )
        return written, validated
