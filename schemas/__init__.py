"""Typed, versioned records: the telemetry, derived events, commands and acks that
travel on trainguard's topics, and the one codec that reads and writes them."""

from .base import NO_STEP, RUN_LEVEL_RANK, Envelope, Reason, ReasonCode, Record
from .codec import (
    Batch,
    DecodedBatch,
    Rejected,
    Rejection,
    RejectReason,
    decode,
    decode_batch,
    encode,
    encode_batch,
)
from .commands import (
    Abort,
    Ack,
    AckStatus,
    CheckpointNow,
    Command,
    EvictRank,
    QuarantineNode,
    ResumeFrom,
    Rollback,
    RunSelfCheck,
    SetCheckpointInterval,
    SkipUpdate,
)
from .events import (
    CheckpointFailed,
    CheckpointValidated,
    CheckpointWritten,
    CrossRankCheck,
    Derived,
    GpuHealth,
    HangDetected,
    Heartbeat,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    IntervalUpdate,
    Page,
    Quarantine,
    RankExit,
    RunStarted,
    SdcMismatch,
    SdcSelfCheck,
    StepStats,
    StepTiming,
    StragglerFlagged,
    Tick,
)

__all__ = [
    "NO_STEP", "RUN_LEVEL_RANK", "Envelope", "Reason", "ReasonCode", "Record",
    "Batch", "DecodedBatch", "Rejected", "RejectReason", "Rejection",
    "decode", "decode_batch", "encode", "encode_batch",
    "Abort", "Ack", "AckStatus", "CheckpointNow", "Command", "EvictRank", "QuarantineNode",
    "ResumeFrom", "Rollback", "RunSelfCheck", "SetCheckpointInterval", "SkipUpdate",
    "CheckpointFailed", "CheckpointValidated", "CheckpointWritten", "CrossRankCheck", "Derived",
    "GpuHealth", "HangDetected", "Heartbeat", "Interruption", "InterruptionCause",
    "InterruptionRecovered", "IntervalUpdate", "Page", "Quarantine", "RankExit", "RunStarted",
    "SdcMismatch", "SdcSelfCheck", "StepStats", "StepTiming", "StragglerFlagged", "Tick",
]  # fmt: skip
