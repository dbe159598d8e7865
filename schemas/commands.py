"""Commands (processors -> ranks) and acknowledgements (ranks -> processors).

A command can stop a thousand-GPU job, so each one is signed with the run's key
(:mod:`trainguard.schemas.auth`) and carries a `command_id` that the actuator
executes at most once per rank. Command ids are derived from the decision's cause,
so a decision re-made after a processor restart has the same id.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from .base import RUN_LEVEL_RANK, Reason, Record


class Command(Record):
    command_id: str = Field(min_length=1, max_length=200)
    run_id: str = Field(min_length=1, max_length=128)
    attempt: int = Field(ge=0, description="The attempt the command is meant for; others ignore it.")
    ranks: list[int] | None = Field(default=None, description="Target ranks; None means every rank.")
    issued_ts: float = Field(ge=0, description="Event time of the decision (not a wall clock).")
    reason: Reason
    caused_by: list[str] = Field(default_factory=list, max_length=64)
    signature: str = Field(default="", max_length=128, description="HMAC-SHA256 hex over the rest.")

    def targets(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


class CheckpointNow(Command):
    KIND: ClassVar[str] = "checkpoint_now"
    VERSION: ClassVar[int] = 1


class SetCheckpointInterval(Command):
    KIND: ClassVar[str] = "set_checkpoint_interval"
    VERSION: ClassVar[int] = 1

    interval_s: float = Field(gt=0)


class Abort(Command):
    """Stop the attempt; with stack_dump, every targeted rank dumps all threads' stacks first."""

    KIND: ClassVar[str] = "abort"
    VERSION: ClassVar[int] = 1

    stack_dump: bool = True


class SkipUpdate(Command):
    KIND: ClassVar[str] = "skip_update"
    VERSION: ClassVar[int] = 1

    step: int = Field(ge=0)


class RunSelfCheck(Command):
    KIND: ClassVar[str] = "run_self_check"
    VERSION: ClassVar[int] = 1

    step: int = Field(ge=0)


class RunCrossRankCheck(Command):
    """`ranks` (two, or three to bisect) compute the same microbatch and report CrossRankCheck.
    v2: `batch_rank`, which a real rank needs to know which microbatch that is."""

    KIND: ClassVar[str] = "run_cross_rank_check"
    VERSION: ClassVar[int] = 2

    step: int = Field(ge=0)
    microbatch_id: str = Field(max_length=200)
    batch_rank: int | None = Field(
        default=None,
        ge=0,
        description="Whose batch at `step` the named ranks recompute (a ring edge's target); "
        "None: not known (a pair check's microbatch), which real ranks cannot run.",
    )


class RunRingCheck(Command):
    """A ring cross-rank check (every rank, one extra microbatch each): at the first step at
    or after `step`, rank r computes its own microbatch and recomputes that of rank
    (r + offset) mod world_size with the same weights, and reports RingCheck."""

    KIND: ClassVar[str] = "run_ring_check"
    VERSION: ClassVar[int] = 1

    step: int = Field(ge=0)
    check_id: str = Field(min_length=1, max_length=200)
    offset: int = Field(ge=1)


class EvictRank(Command):
    """Leave the job at the next checkpoint boundary."""

    KIND: ClassVar[str] = "evict_rank"
    VERSION: ClassVar[int] = 1

    rank: int = Field(ge=0)


class QuarantineNode(Command):
    KIND: ClassVar[str] = "quarantine_node"
    VERSION: ClassVar[int] = 1

    node: str = Field(min_length=1, max_length=128)


class RunNodeSelfTest(Command):
    """Test a node suspected of silent data corruption before it returns to the pool (seed
    §SDC (c)): short runs with known answers catch the deterministically wrong GPU that only
    shows under load. `ranks` are the node's ranks; each tests its own device."""

    KIND: ClassVar[str] = "run_node_self_test"
    VERSION: ClassVar[int] = 1

    def targets(self, rank: int) -> bool:
        """The launcher (rank -1) runs it: it owns the node and tests it once the node's
        ranks have left it; `ranks` only say which devices of the job were on the node."""
        return rank == RUN_LEVEL_RANK

    node: str = Field(min_length=1, max_length=128)
    tests: list[str] = Field(
        default_factory=lambda: ["gemm", "collective"],
        min_length=1,
        max_length=16,
        description="Self-tests to run, each a short workload with known answers: gemm (a matrix "
        "multiply on every GPU of the node), collective (an all-reduce across them) (seed §SDC (c)).",
    )


class ResumeFrom(Command):
    KIND: ClassVar[str] = "resume_from"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)


class Rollback(Command):
    """Roll back to the clean ancestor: the newest checkpoint at or before the watermark (R6)."""

    KIND: ClassVar[str] = "rollback"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)


class PauseRun(Command):
    """Stop restarting the run: it failed at `step` again and again, on different nodes
    (data or code, not hardware), so another restart would fail the same way. The launcher
    ends the attempt if one is running, restarts nothing, and exits with a paused status
    and this reason for a human (or a scheduler) to act on."""

    KIND: ClassVar[str] = "pause_run"
    VERSION: ClassVar[int] = 1

    step: int = Field(ge=-1, description="The step that keeps failing (-1: not known).")


class ReleaseNode(Command):
    """Return a node quarantined on a failure that turned out to be the run's (data or
    code) to the pool: it was not the node's fault."""

    KIND: ClassVar[str] = "release_node"
    VERSION: ClassVar[int] = 1

    node: str = Field(min_length=1, max_length=128)


class InterruptionDecided(Command):
    """The processor decided all it will about the interruption of ``attempt``: what it
    implies (a QuarantineNode...) was sent before this, on the run's partition. The
    launcher restarts as soon as it has this (issue 18), instead of waiting out its
    ``decision_wait_s``, which is left as the bound for a processor that does not answer.

    v2 (issue 45, elastic training): where the interruption takes nodes out and no spare is
    known to be ready, what to do if none is: ``capacity`` "wait" for the replacement, or
    "shrink" (go on at ``world_size`` ranks, grow back at a checkpoint once it is there),
    by the rule of trainguard/common/elastic.py; ``reason`` then says why, with its numbers."""

    KIND: ClassVar[str] = "interruption_decided"
    VERSION: ClassVar[int] = 2

    interruption_id: str = Field(min_length=1, max_length=200)
    capacity: Literal["wait", "shrink"] | None = Field(
        default=None,
        description="With no spare ready for the nodes lost: wait for a replacement, or shrink; "
        "None: no capacity decision (nothing lost, or spares are ready for it).",
    )
    world_size: int | None = Field(
        default=None, ge=1, description="shrink: the smaller world to go on at; None otherwise."
    )
    expected_replacement_s: float | None = Field(
        default=None,
        ge=0,
        description="The replacement's expected arrival (seconds after the interruption) the "
        "decision assumed: the run's history, else the policy's prior; None: no decision.",
    )

    def targets(self, rank: int) -> bool:
        return rank == RUN_LEVEL_RANK  # the launcher's alone


class DrainNode(Command):
    """Take `node` out at a checkpoint boundary before it fails (issue 46): the ranks agree
    on a step, checkpoint there and leave in their processes (no step lost); the node's
    ranks go to pre-tested warm spares, or the world shrinks when elastic training prefers
    it; the node is quarantined. The boundary is the next checkpoint the cadence makes due,
    or a checkpoint `within_s` after the command, whichever comes first."""

    KIND: ClassVar[str] = "drain_node"
    VERSION: ClassVar[int] = 1

    node: str = Field(min_length=1, max_length=128)
    within_s: float = Field(ge=0, description="The latest a checkpoint boundary is taken for the drain.")

    def targets(self, rank: int) -> bool:
        return rank == RUN_LEVEL_RANK  # the launcher's alone


COMMAND_KINDS: tuple[type[Command], ...] = (
    CheckpointNow,
    SetCheckpointInterval,
    Abort,
    SkipUpdate,
    RunSelfCheck,
    RunCrossRankCheck,
    EvictRank,
    QuarantineNode,
    RunNodeSelfTest,
    ResumeFrom,
    Rollback,
    RunRingCheck,
    PauseRun,
    ReleaseNode,
    InterruptionDecided,
    DrainNode,
)


class AckStatus(StrEnum):
    EXECUTED = "executed"
    DUPLICATE = "duplicate"  # already executed on this rank; not run again
    REFUSED = "refused"  # bad signature, wrong run, stale attempt
    FAILED = "failed"  # the handler raised


class Ack(Record):
    KIND: ClassVar[str] = "ack"
    VERSION: ClassVar[int] = 1

    command_id: str = Field(min_length=1, max_length=200)
    command_kind: str = Field(max_length=64)
    run_id: str = Field(min_length=1, max_length=128)
    attempt: int = Field(ge=0)
    rank: int = Field(ge=-1)
    node: str = Field(max_length=128)
    status: AckStatus
    detail: str = Field(default="", max_length=2000)
    ts: float = Field(ge=0)
