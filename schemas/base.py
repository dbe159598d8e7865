"""The record base classes: every record on a trainguard topic is one of these.

A record's schema is its kind plus a version (``"heartbeat/1"``). The kind and
version live on the class (``KIND``, ``VERSION``), not in the model's fields; the
codec writes them into the ``schema`` key on the wire and uses them to pick the
class when reading (see :mod:`trainguard.schemas.codec`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

#: Rank number used by records that concern the whole run, not one rank.
RUN_LEVEL_RANK = -1
#: Step number used before the first step has completed.
NO_STEP = -1
#: The envelope's length bounds: an event id, and a run id or node name (schemas/block_check.py
#: checks a columnar block's rows against the same).
MAX_EVENT_ID = 200
MAX_NAME = 128


class Record(BaseModel):
    """Base of every wire record: frozen, strict about unknown fields, finite floats."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        ser_json_inf_nan="strings",
    )

    KIND: ClassVar[str]
    VERSION: ClassVar[int]

    @classmethod
    def schema_name(cls) -> str:
        return f"{cls.KIND}/{cls.VERSION}"


class Envelope(Record):
    """The envelope every event carries (docs/architecture.md, schemas/)."""

    event_id: str = Field(
        min_length=1, max_length=MAX_EVENT_ID, description="Unique; consumers dedupe on it."
    )
    run_id: str = Field(min_length=1, max_length=MAX_NAME)
    attempt: int = Field(ge=0, description="Restart generation of the run; 0 is the first launch.")
    rank: int = Field(ge=RUN_LEVEL_RANK, description="Global rank, or -1 for a run-level record.")
    node: str = Field(max_length=MAX_NAME, description="Host name of the emitter ('' when not node-bound).")
    step: int = Field(ge=NO_STEP, description="Training step the record refers to (-1: none yet).")
    # Finite even where a kind allows non-finite values (StepStats): a timestamp of
    # infinity would stop every event-time clock of the core.
    ts: float = Field(ge=0, allow_inf_nan=False, description="Emitter clock, seconds since the Unix epoch.")


class ReasonCode(StrEnum):
    """Why a detector or policy produced an output; tests assert on these."""

    NO_PROGRESS = "no_progress"
    RANK_EXITED = "rank_exited"
    ODD_STACK = "odd_stack"
    NO_ODD_STACK = "no_odd_stack"
    STACKS_INCOMPLETE = "stacks_incomplete"
    RESUMED = "resumed"
    INTERRUPTION = "interruption"
    OPERATOR = "operator"
    # stragglers (seed §7, R2)
    STRAGGLER = "straggler"
    STRAGGLER_RECOVERED = "straggler_recovered"
    MISSING_RANKS = "missing_ranks"
    NODE_THERMAL = "node_thermal"
    ENVIRONMENTAL = "environmental"
    NODE_LINK = "node_link"
    NETWORK_CONTENTION = "network_contention"
    UNKNOWN_CAUSE = "unknown_cause"
    EVICTION = "eviction"
    EVICTION_DECLINED = "eviction_declined"
    EVICTION_DEFERRED = "eviction_deferred"
    PAGE_SAME_RACK = "page_same_rack"
    # silent data corruption (seed §7, R3)
    NON_FINITE_LOSS = "non_finite_loss"
    GRAD_SPIKE = "grad_spike"
    SELF_CHECK_MISMATCH = "self_check_mismatch"
    CROSS_RANK_MISMATCH = "cross_rank_mismatch"
    SDC_CHECK_SCHEDULED = "sdc_check_scheduled"
    NODE_SELF_TEST = "node_self_test"
    # failure-rate baseline
    MTBF = "mtbf"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    PAGE_SAME_NODE = "page_same_node"
    PAGE_SAME_STEP = "page_same_step"
    PAGE_FAILURE_RATE = "page_failure_rate"
    QUARANTINE = "quarantine"
    GOODPUT = "goodput"
    PAGE_GOODPUT = "page_goodput"
    ROLLBACK = "rollback"
    NO_CLEAN_ANCESTOR = "no_clean_ancestor"
    # pages and quarantines only on evidence (issue 14 item 4)
    ODD_PHASE = "odd_phase"
    CULPRIT_UNKNOWN = "culprit_unknown"
    NODE_ALREADY_LEAVING = "node_already_leaving"
    PAUSE_RUN = "pause_run"
    SKIP_BATCH = "skip_batch"
    QUARANTINE_RELEASED = "quarantine_released"
    # rack / placement-group slowdown (issue 14 item 1)
    GROUP_SLOWDOWN = "group_slowdown"
    GROUP_SLOWDOWN_CLEARED = "group_slowdown_cleared"
    # node self-test results (issue 15 item 6)
    NODE_SELF_TEST_PASSED = "node_self_test_passed"
    NODE_SELF_TEST_FAILED = "node_self_test_failed"
    # a checkpoint refused at resume: a data fault, not a node fault (issue 15 item 1)
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    # across hosts: a host went silent while the others' ranks died of a lost peer (issue 17)
    HOST_LOST = "host_lost"
    # ranks died of a lost peer and no host went silent: culprit unknown
    PEER_LOST = "peer_lost"
    # elastic training (issue 45): capacity lost with no spare ready; the planned grow-back
    CAPACITY_WAIT = "capacity_wait"
    CAPACITY_SHRINK = "capacity_shrink"
    CAPACITY_GROW = "capacity_grow"
    # failure prediction (issue 46): a node's health trends, the drain decided by expected
    # goodput, a node kept out of a launch for its history across runs
    FAILURE_PREDICTED = "failure_predicted"
    DRAIN = "drain"
    DRAIN_DECLINED = "drain_declined"
    LEMON_NODE = "lemon_node"


class Reason(Record):
    """A machine-readable code plus a sentence for humans."""

    KIND: ClassVar[str] = "reason"
    VERSION: ClassVar[int] = 1

    code: ReasonCode
    text: str = Field(max_length=2000)
