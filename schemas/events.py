"""Telemetry events emitted by ranks and launchers, and events derived by processors.

Each class is one schema kind at one version. Telemetry travels on the telemetry
topic in per-node batches (:class:`~trainguard.schemas.codec.Batch`); derived events
travel one per record on the events topic.

One file of ~600 lines on purpose: it is the catalogue of every event a rank, a
launcher or a processor writes, read side by side when a field or a version changes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal, get_args

from pydantic import ConfigDict, Field

from .base import Envelope, Reason

# --------------------------------------------------------------------------- telemetry


class RunStarted(Envelope):
    """A launcher (or the simulator) registers an attempt of a run before its ranks report."""

    KIND: ClassVar[str] = "run_started"
    VERSION: ClassVar[int] = 3

    world_size: int = Field(ge=1, le=1_048_576)
    ranks_per_node: int = Field(ge=1, le=1024)
    nodes: list[str] = Field(max_length=131_072, description="Node of rank r is nodes[r // ranks_per_node].")
    racks: dict[str, str] = Field(default_factory=dict, description="node -> rack (failure domain).")
    resumed_from_step: int = Field(
        default=-1, ge=-1, description="Checkpoint step this attempt resumes from."
    )
    config_digest: str = Field(default="", max_length=128)
    # v2: placement groups the run declares (an aisle, a power domain, a switch), watched as
    # a whole by the group slowdown detector like the racks.
    placement_groups: dict[str, list[str]] = Field(
        default_factory=dict, description="group -> its nodes (a node may be in several groups)."
    )
    # v3 (issue 45): the spares the launcher holds ready, which say whether a lost node is
    # replaced at once or the policy must choose between waiting and a smaller world.
    spares: int | None = Field(
        default=None,
        ge=0,
        description="Proven spare nodes ready for this run as the attempt starts; None: not "
        "said (the core then decides, for every node lost, what to do if none is ready).",
    )


#: Training phases a heartbeat may report (Heartbeat.phase); "" when the rank does not say.
PHASES = ("forward", "backward", "allreduce", "optimizer", "data", "checkpoint", "eval")


class Heartbeat(Envelope):
    """Process liveness; `step` is the last step this rank completed. v2: `phase`, what the
    training loop was doing when the heartbeat left (a hang's culprit is the rank whose
    phase differs from everyone waiting in the collective)."""

    KIND: ClassVar[str] = "heartbeat"
    VERSION: ClassVar[int] = 2

    phase: str = Field(default="", max_length=32, description="e.g. forward, allreduce; '' unknown.")


class StepTiming(Envelope):
    """One completed step. compute_s is measured BEFORE the collective (seed §7)."""

    KIND: ClassVar[str] = "step_timing"
    VERSION: ClassVar[int] = 1

    compute_s: float = Field(ge=0, description="Forward+backward before gradient synchronisation.")
    total_s: float = Field(ge=0, description="Whole step including the collective and the optimizer.")


class StepStats(Envelope):
    """Loss and gradient norm of a step. Non-finite values are legal here: they are the signal."""

    KIND: ClassVar[str] = "step_stats"
    VERSION: ClassVar[int] = 1
    model_config = ConfigDict(allow_inf_nan=True)

    loss: float
    grad_norm: float | None = Field(default=None, description="None when the loop did not measure it.")
    finite: bool = Field(description="loss (and grad_norm, when measured) are finite.")


class SdcSelfCheck(Envelope):
    """Two digests of the same microbatch computed twice on the same device (seed R3)."""

    KIND: ClassVar[str] = "sdc_self_check"
    VERSION: ClassVar[int] = 1

    microbatch_id: str = Field(max_length=200)
    digest_first: str = Field(max_length=256)
    digest_second: str = Field(max_length=256)

    @property
    def passed(self) -> bool:
        return self.digest_first == self.digest_second


class CrossRankCheck(Envelope):
    """Two or three ranks computed the same microbatch; values compared at a tolerance."""

    KIND: ClassVar[str] = "cross_rank_check"
    VERSION: ClassVar[int] = 1

    microbatch_id: str = Field(max_length=200)
    ranks: list[int] = Field(min_length=2, max_length=3)
    values: list[float] = Field(min_length=2, max_length=3)


class RingCheck(Envelope):
    """One rank's part of a ring cross-rank check (RunRingCheck): the value of its own
    microbatch, and its recomputation of ring neighbour `peer_rank`'s microbatch with the
    same weights. The processor compares `peer_value` with the neighbour's `own_value`."""

    KIND: ClassVar[str] = "ring_check"
    VERSION: ClassVar[int] = 1

    check_id: str = Field(min_length=1, max_length=200)
    own_value: float
    peer_rank: int = Field(ge=0)
    peer_value: float


class GpuHealth(Envelope):
    """GPU and link health from NVML. On a machine without a GPU, present=False and nothing else.
    A field the device does not support (NVLink on a PCIe card, ECC off) is None, never a guess.

    Version 2 (issue 15) adds the memory temperature, the clocks against their maxima, power,
    the named clock-event (throttle) reasons, lifetime ECC counts and NVLink CRC errors.
    Version 3 (issue 46) adds the failure precursors: retired pages, remapped rows (pending,
    failed), XID errors seen since the reader started, PCIe replays; and `injected`, set
    only by the reader's injection hook (tests, chaos), never by a device."""

    KIND: ClassVar[str] = "gpu_health"
    VERSION: ClassVar[int] = 3

    present: bool
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    power_capped: bool | None = None
    thermal_throttle: bool | None = None
    nvlink_width: int | None = None
    nvlink_expected_width: int | None = None
    nvlink_retries: int | None = Field(default=None, description="NVLink replay + recovery errors.")
    ecc_corrected: int | None = Field(default=None, description="Since the last driver reload (volatile).")
    ecc_uncorrected: int | None = Field(default=None, description="Since the last driver reload (volatile).")
    nic_utilization: float | None = Field(default=None, ge=0, le=1)
    memory_temperature_c: float | None = Field(default=None, description="HBM temperature.")
    sm_clock_max_mhz: float | None = None
    memory_clock_mhz: float | None = None
    power_w: float | None = Field(default=None, ge=0)
    power_limit_w: float | None = Field(default=None, ge=0)
    throttle_reasons: list[str] | None = Field(
        default=None,
        max_length=32,
        description="Active clock-event reasons by NVML name (sw_power_cap, hw_slowdown, "
        "sw_thermal_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown, sync_boost, ...).",
    )
    ecc_corrected_total: int | None = Field(default=None, description="Over the device's life (aggregate).")
    ecc_uncorrected_total: int | None = Field(default=None, description="Over the device's life (aggregate).")
    nvlink_crc_errors: int | None = Field(default=None, description="NVLink CRC flit + data errors.")
    retired_pages: int | None = Field(
        default=None,
        ge=0,
        description="Memory pages retired for ECC errors (pre-Ampere; single + double bit).",
    )
    retired_pages_pending: bool | None = Field(default=None, description="A page retirement awaits a reset.")
    remapped_rows_correctable: int | None = Field(
        default=None, ge=0, description="HBM rows remapped for correctable errors (Ampere and later)."
    )
    remapped_rows_uncorrectable: int | None = Field(
        default=None, ge=0, description="HBM rows remapped for uncorrectable errors (Ampere and later)."
    )
    remap_pending: bool | None = Field(default=None, description="A row remap awaits a GPU reset.")
    remap_failed: bool | None = Field(default=None, description="A row remap failed (no spare row left).")
    xid_errors: int | None = Field(
        default=None, ge=0, description="Critical XID events this reader has seen since it started."
    )
    last_xid: int | None = Field(default=None, ge=0, description="The most recent XID's code.")
    pcie_replays: int | None = Field(default=None, ge=0, description="PCIe replay counter.")
    injected: bool | None = Field(
        default=None,
        description="True: the reading came from the injection hook (tests, chaos), not a device.",
    )


#: GpuHealth's failure precursors that are counts, each growing while the driver is loaded
#: (issue 46): what the core's hazard model, the simulators and the injection hook share.
PRECURSOR_COUNTERS: tuple[str, ...] = (
    "ecc_corrected",
    "ecc_uncorrected",
    "retired_pages",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "xid_errors",
    "pcie_replays",
    "nvlink_crc_errors",
    "nvlink_retries",
)
#: GpuHealth's failure precursors that are flags (a remap or retirement awaiting a reset,
#: a remap that failed).
PRECURSOR_FLAGS: tuple[str, ...] = ("remap_pending", "remap_failed", "retired_pages_pending")


class CheckpointWritten(Envelope):
    """A checkpoint is durable (its manifest is written); not yet resumable."""

    KIND: ClassVar[str] = "checkpoint_written"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)
    shards: int = Field(ge=1)
    digest: str = Field(max_length=256)
    bytes: int = Field(ge=0)
    blocking_s: float = Field(ge=0, description="Time the training step was blocked (the C of seed §6).")
    write_s: float = Field(ge=0, description="Background write time.")


class CheckpointValidated(Envelope):
    """All shards present, digests match, test load succeeded: resumable."""

    KIND: ClassVar[str] = "checkpoint_validated"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)
    last_verified_step: int = Field(ge=-1, description="Newest step at which an SDC check passed (R6).")


class CheckpointFailed(Envelope):
    KIND: ClassVar[str] = "checkpoint_failed"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)
    error: str = Field(max_length=4000)


class RankExit(Envelope):
    """A rank process ended. stack_signature summarises its stack at exit (for hang culprits).
    step: the newest step this rank completed; job_step: the newest step ANY rank of the
    attempt completed when this exit was reported (the launcher reads every rank's progress
    file), so that an interruption declared on this exit counts its lost steps exactly even
    while the survivors' last reports are still in their shippers. v3: peer_lost. Under
    in-process restart across hosts, a rank that left its attempt alive on a lost peer (its
    process goes on in the next attempt) is reported so: exit_code None, peer_lost."""

    KIND: ClassVar[str] = "rank_exit"
    VERSION: ClassVar[int] = 3

    exit_code: int | None = None
    signal: int | None = Field(default=None, ge=1, le=128)
    requested: bool = Field(default=False, description="True when the exit executed an abort command.")
    stack_dump_ref: str = Field(default="", max_length=2000)
    stack_signature: str = Field(default="", max_length=2000)
    job_step: int = Field(default=-1, ge=-1, description="Newest step any rank completed (-1: unknown).")
    peer_lost: bool = Field(
        default=False,
        description="The rank died because a peer did: its collective failed with the peer's "
        "connection reset or closed, or the communicator aborted (producers/training/peer_loss.py). "
        "Evidence about another rank, so never a culprit by itself.",
    )


class RestartPhases(Envelope):
    """The launcher's measurement of one restart (seed §6 R; issue 5): seconds per phase from
    the moment it noticed the interruption to the new attempt's first completed step, in
    order: detect, reschedule, process_start, checkpoint_load, pg_init, first_step. `attempt`
    is the attempt that started; rank -1."""

    KIND: ClassVar[str] = "restart_phases"
    VERSION: ClassVar[int] = 1

    interrupted_attempt: int = Field(ge=0, description="The attempt that ended.")
    cause: str = Field(default="", max_length=64, description="What the launcher saw: crash, abort, ...")
    phases: dict[str, float] = Field(description="Phase name -> seconds, in order.")
    resumed_from_step: int = Field(default=-1, ge=-1)


class Tick(Envelope):
    """Processing-time marker written INTO the telemetry log by the live driver, so that
    silence (no events at all) still advances the core's clock, and replay sees the same ticks."""

    KIND: ClassVar[str] = "tick"
    VERSION: ClassVar[int] = 1


class GroupComputeTimes(Envelope):
    """A non-coordinator shard's per-step summary of its groups' (racks', placement groups')
    pre-collective compute times, forwarded to shard 0, which alone has the run-wide
    reference (processors/core/detectors/group_slowdown.py). One record per shard per evaluated step;
    rank -1. `health` carries, every few steps, each group's GPU-health digest, since the
    GpuHealth reports of a shard's ranks never reach shard 0."""

    KIND: ClassVar[str] = "group_compute_times"
    VERSION: ClassVar[int] = 1

    shard: int = Field(ge=0)
    groups: list[str] = Field(max_length=65_536)
    medians: list[float] = Field(max_length=65_536, description="Median compute_s per group (aligned).")
    counts: list[int] = Field(max_length=65_536, description="Ranks that reported, per group (aligned).")
    health: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="group -> health digest (median_temp_c, hot_share, nic_median)."
    )


class NodeSelfTestResult(Envelope):
    """A node's self-test with known answers (seed §SDC (c)): a GEMM on each of its devices
    and an all-reduce across them, run by the launcher on a quarantined node before it may
    return to the pool and on a spare before it joins (producers/launcher/node_selftest.py). rank -1;
    node: the node tested. The core keeps a node that failed out of the pool."""

    KIND: ClassVar[str] = "node_self_test_result"
    VERSION: ClassVar[int] = 1

    passed: bool
    tests: list[str] = Field(max_length=16)
    failed_tests: list[str] = Field(default_factory=list, max_length=16)
    purpose: Literal["quarantine", "spare", "operator"] = Field(
        description="quarantine: a suspected node, before it may return; spare: before it joins."
    )
    command_id: str = Field(default="", max_length=200, description="The RunNodeSelfTest it answers.")
    devices: int = Field(ge=0, description="Devices (worker processes) that reported.")
    wall_s: float = Field(ge=0)
    reason: Reason


class NodeExcluded(Envelope):
    """The launcher kept a node out of this launch for its history across runs (issue 46): a
    "lemon" with `failures` failures or quarantines within `window_days` in the archive
    (trainguard/common/lemons.py). rank -1; node: the node kept out. The core pages once."""

    KIND: ClassVar[str] = "node_excluded"
    VERSION: ClassVar[int] = 1

    failures: int = Field(ge=0, description="Its failures and quarantines within the window.")
    window_days: float = Field(gt=0)
    runs: list[str] = Field(default_factory=list, max_length=64, description="The runs they happened in.")
    reason: Reason


class CheckpointRejected(Envelope):
    """A checkpoint failed verification when the ranks were about to resume from it (rank
    0's report; a REJECTED marker is written next to it, so it is never chosen again). The
    attempt resumes from `resumed_from_step`, the newest validated checkpoint older than it
    (-1: none is left). A checkpoint fault, not a node fault."""

    KIND: ClassVar[str] = "checkpoint_rejected"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    uri: str = Field(max_length=2000)
    error: str = Field(max_length=4000)
    resumed_from_step: int = Field(ge=-1, description="The step this attempt resumes from instead.")


TELEMETRY_KINDS: tuple[type[Envelope], ...] = (
    RunStarted,
    Heartbeat,
    StepTiming,
    StepStats,
    SdcSelfCheck,
    CrossRankCheck,
    GpuHealth,
    CheckpointWritten,
    CheckpointValidated,
    CheckpointFailed,
    RankExit,
    RestartPhases,
    Tick,
    RingCheck,
    GroupComputeTimes,
    NodeSelfTestResult,
    CheckpointRejected,
    NodeExcluded,
)

# --------------------------------------------------------------------------- derived


class InterruptionCause(StrEnum):
    CRASH = "crash"
    HANG = "hang"
    SDC = "sdc"
    NON_FINITE = "non_finite"
    EVICTION = "eviction"
    OPERATOR = "operator"
    #: A planned stop at a checkpoint to grow a smaller world back to full size (issue 45).
    ELASTIC = "elastic"
    #: A planned stop at a checkpoint to take out a node predicted to fail (issue 46).
    DRAIN = "drain"


class Derived(Envelope):
    """A processor's output. Its event_id is derived from its causes, so re-processing the
    same input yields the same id and consumers dedupe it."""

    reason: Reason
    caused_by: list[str] = Field(default_factory=list, max_length=64)


class StragglerFlagged(Derived):
    """rank/node: the straggler. Flagged after `consecutive_steps` over the threshold."""

    KIND: ClassVar[str] = "straggler_flagged"
    VERSION: ClassVar[int] = 1

    robust_z: float
    slowdown: float = Field(ge=0, description="compute_s / median compute_s")
    consecutive_steps: int = Field(default=0, ge=0)
    onset_step: int = Field(default=-1, ge=-1, description="First step of the slow streak.")


class StragglerCleared(Derived):
    """A flagged rank is back within the threshold."""

    KIND: ClassVar[str] = "straggler_cleared"
    VERSION: ClassVar[int] = 1

    flagged_steps: int = Field(ge=0)


class Diagnosis(StrEnum):
    """Why a rank straggles (seed R2), which decides what may be done about it."""

    NODE_THERMAL = "node_thermal"  # evict: a fan or paste problem
    ENVIRONMENTAL = "environmental"  # the rack is hot: do not evict, alert facilities
    NODE_LINK = "node_link"  # NVLink degraded: evict
    NETWORK_CONTENTION = "network_contention"  # evict and change placement
    UNKNOWN = "unknown"  # evict once, then stop


class StragglerAction(StrEnum):
    EVICT = "evict"
    ALERT_FACILITIES = "alert_facilities"
    EVICT_AND_REPLACE = "evict_and_change_placement"
    EVICT_ONCE = "evict_once"
    NONE = "none"


class StragglerDiagnosed(Derived):
    KIND: ClassVar[str] = "straggler_diagnosed"
    VERSION: ClassVar[int] = 1

    diagnosis: Diagnosis
    action: StragglerAction
    evidence: dict[str, float] = Field(default_factory=dict)


class EvictionVerdict(StrEnum):
    """What the eviction policy decided about a diagnosed straggler (seed R2)."""

    EVICT = "evict"  # EvictRank issued: the rank leaves at the next checkpoint boundary
    DECLINED = "declined"  # payback R / (P(healthy) x cost) longer than the horizon
    DEFERRED = "deferred"  # worth it, but the run had an eviction less than min_gap_s ago
    PAGED = "paged"  # the previous eviction was in the same rack: a human decides
    NOT_EVICTED = "not_evicted"  # the diagnosis does not recommend eviction, or it is disabled


class EvictionDecision(Derived):
    """The straggler-eviction decision and its numbers (seed R2): expected benefit =
    P(healthy replacement) x straggler cost; payback = R / benefit. rank/node: the straggler."""

    KIND: ClassVar[str] = "eviction_decision"
    VERSION: ClassVar[int] = 1

    decision: EvictionVerdict
    slowdown: float = Field(ge=0, description="The straggler's compute_s / median compute_s.")
    straggler_cost: float = Field(
        ge=0, le=1, description="Fraction of job throughput lost to it: 1 - 1/slowdown."
    )
    p_healthy: float = Field(ge=0, le=1, description="P(the replacement is healthy), from past evictions.")
    restart_s: float = Field(ge=0, description="R: what the planned restart costs.")
    benefit: float = Field(ge=0, le=1, description="p_healthy x straggler_cost.")
    payback_s: float = Field(ge=0, description="restart_s / benefit; 1e12 stands for never.")
    horizon_s: float = Field(gt=0, description="Evict only if payback_s is not longer than this.")
    evictions_resolved: int = Field(ge=0, description="Past evictions of the run that resolved the straggle.")
    evictions_unresolved: int = Field(ge=0, description="Past evictions after which it straggled again.")


class FailurePredicted(Derived):
    """A node's failure precursors (issue 46): its GPUs' error counters and trends against
    the fleet's own noise, turned into the probability that the node fails within
    `horizon_s` (processors/core/detectors/hazard.py). Made where the node's GPU health is seen (any
    shard); shard 0 decides about a drain (DrainDecision). node: the node; rank: the GPU
    with the strongest evidence."""

    KIND: ClassVar[str] = "failure_predicted"
    VERSION: ClassVar[int] = 1

    probability: float = Field(ge=0, le=1, description="P(the node fails within horizon_s).")
    horizon_s: float = Field(gt=0)
    signals: list[str] = Field(
        min_length=1, max_length=32, description="Each precursor with its numbers, strongest first."
    )
    evidence: float = Field(ge=0, description="The strongest signal's surprise: -log10 of its noise p-value.")


class DrainDecision(Derived):
    """Whether to drain a node predicted to fail (issue 46), by expected goodput: drain
    when probability x (restart_s + lost_work_s) exceeds drain_cost_s. node: the node."""

    KIND: ClassVar[str] = "drain_decision"
    VERSION: ClassVar[int] = 1

    decision: Literal["drain", "decline"]
    probability: float = Field(ge=0, le=1)
    horizon_s: float = Field(gt=0)
    restart_s: float = Field(
        ge=0, description="R: what an unplanned restart costs (the run's, else the prior)."
    )
    lost_work_s: float = Field(
        ge=0, description="Work expected lost at a failure: since the last checkpoint."
    )
    drain_cost_s: float = Field(ge=0, description="What the drain costs the job: its checkpoint and swap.")
    expected_saving_s: float = Field(description="probability x (restart_s + lost_work_s) - drain_cost_s.")
    within_s: float = Field(ge=0, description="drain: the checkpoint boundary to drain at comes within this.")


class RanksMissing(Derived):
    """Ranks that reported nothing for a step the others completed: reported, not ignored."""

    KIND: ClassVar[str] = "ranks_missing"
    VERSION: ClassVar[int] = 1

    ranks: list[int] = Field(max_length=1_048_576)


class GradSpike(Derived):
    """grad-norm above the multiple of its running p99: the update is skipped and counted."""

    KIND: ClassVar[str] = "grad_spike"
    VERSION: ClassVar[int] = 1

    grad_norm: float = Field(ge=0)
    threshold: float = Field(ge=0)
    anomalies: int = Field(ge=1, description="Grad spikes counted in this run so far.")


class MtbfUpdate(Derived):
    """The run's measured failure rate, with a confidence interval and the world-size prior."""

    KIND: ClassVar[str] = "mtbf_update"
    VERSION: ClassVar[int] = 1

    mtbf_s: float = Field(gt=0)
    ci_low_s: float = Field(gt=0)
    ci_high_s: float = Field(gt=0)
    prior_mtbf_s: float = Field(gt=0)
    interruptions: int = Field(ge=0)
    exposure_s: float = Field(ge=0)
    by_cause: dict[str, int] = Field(default_factory=dict)
    rate_1h: float = Field(ge=0, description="Interruptions in the last hour of event time.")
    baseline_rate_per_h: float = Field(ge=0)


class HangDetected(Derived):
    KIND: ClassVar[str] = "hang_detected"
    VERSION: ClassVar[int] = 1

    last_step: int = Field(ge=-1)
    stalled_s: float = Field(ge=0)
    timeout_s: float = Field(ge=0)


class SdcMismatch(Derived):
    """rank/node: the device that computed a wrong answer (seed R3)."""

    KIND: ClassVar[str] = "sdc_mismatch"
    VERSION: ClassVar[int] = 1

    method: str = Field(max_length=64, description="self_check or cross_rank")
    microbatch_id: str = Field(max_length=200)
    tolerance: float | None = Field(default=None, ge=0, description="cross_rank: the 5-sigma band used.")
    deviation: float | None = Field(default=None, ge=0)


class Interruption(Derived):
    """The job stopped. rank/node name the culprit when known (seed §4 interruption row)."""

    KIND: ClassVar[str] = "interruption"
    VERSION: ClassVar[int] = 1

    interruption_id: str = Field(max_length=200)
    cause: InterruptionCause
    detected_by: str = Field(max_length=64)
    lost_steps: int = Field(ge=0)
    last_checkpoint_step: int = Field(ge=-1)


class InterruptionRecovered(Derived):
    """The next attempt completed its first step: restart_seconds closes the interruption."""

    KIND: ClassVar[str] = "interruption_recovered"
    VERSION: ClassVar[int] = 1

    interruption_id: str = Field(max_length=200)
    restart_s: float = Field(ge=0, description="Detection to the next attempt's first completed step.")
    resumed_attempt: int = Field(ge=0)
    phases: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds per restart phase, in order: detect (fault onset to detection: a hang's "
        "stall), reschedule (detection to the next attempt's launch), startup (launch to its first "
        "completed step: process start, checkpoint load, process-group init, first step).",
    )
    lost_s: float = Field(default=0.0, ge=0, description="Work re-done: lost steps x the median step time.")
    # The restart's own count, which the Interruption's (the newest validated checkpoint the
    # processor knew at detection) can miss: a validation may land after the crash, or the
    # checkpoint fail its verification at resume. None in records written before.
    lost_steps: int | None = Field(default=None, ge=0, description="Steps re-done after the resume.")
    resumed_from_step: int | None = Field(
        default=None, ge=-1, description="The checkpoint the restart resumed from (-1: none)."
    )
    world_size: int = Field(default=0, ge=0)
    gpu_hours: float = Field(
        default=0.0, ge=0, description="Cost: world_size x (detect + restart + lost seconds) / 3600."
    )


class Quarantine(Derived):
    KIND: ClassVar[str] = "quarantine"
    VERSION: ClassVar[int] = 1

    run_ids_affected: list[str] = Field(default_factory=list)


#: Every rule the core pages on (processors/core: decisions/paging.py, decisions/eviction.py,
#: decisions/rollback.py, detectors/group_slowdown.py). Page.rule stays a str so a record with
#: a newer rule still decodes.
PageRule = Literal[
    "same_node",
    "same_step",
    "failure_rate",
    "goodput",
    "same_rack_eviction",
    "no_clean_ancestor",
    "facilities",
    "lemon_node",
]
PAGE_RULES: tuple[str, ...] = get_args(PageRule)


class Page(Derived):
    KIND: ClassVar[str] = "page"
    VERSION: ClassVar[int] = 1

    rule: str = Field(max_length=64)
    evidence: list[str] = Field(default_factory=list)


class IntervalUpdate(Derived):
    KIND: ClassVar[str] = "interval_update"
    VERSION: ClassVar[int] = 1

    mtbf_s: float = Field(gt=0)
    checkpoint_cost_s: float = Field(ge=0)
    interval_s: float = Field(gt=0)


class GoodputReport(Derived):
    """Where a run's time went over a trailing window of event time (seed §6):
    goodput = (1 - (checkpoint + lost + restart) / elapsed) x ideal/actual step time,
    the last factor being 1 - (straggler_s + narrow_s) / (elapsed - restart). v2: narrow_s."""

    KIND: ClassVar[str] = "goodput_report"
    VERSION: ClassVar[int] = 2

    window_s: float = Field(gt=0, description="The trailing window (1 h, 24 h, 7 d by default).")
    elapsed_s: float = Field(ge=0, description="Run time inside the window.")
    checkpoint_s: float = Field(ge=0, description="Training blocked by checkpoints (C).")
    lost_s: float = Field(ge=0, description="Work lost to interruptions: steps re-done.")
    restart_s: float = Field(
        ge=0, description="From each interruption's detection to the next attempt's first step."
    )
    straggler_s: float = Field(ge=0, description="Training time lost to the slowest rank's pace.")
    narrow_s: float = Field(
        default=0.0,
        ge=0,
        description="Training time lost to a smaller world (issue 45): (1 - W'/W) of each second "
        "trained at W' of the full W ranks, the global batch the same (ETTR's reduced width).",
    )
    goodput: float = Field(ge=0, le=1)
    interruptions: int = Field(default=0, ge=0, description="Interruptions detected inside the window.")


class QuarantineReleased(Derived):
    """A node quarantined on a failure is back in the pool: the failure repeated at the
    same step on other nodes (data or code, not this node). node: the node released."""

    KIND: ClassVar[str] = "quarantine_released"
    VERSION: ClassVar[int] = 1

    quarantine_id: str = Field(max_length=200, description="The Quarantine event it undoes.")


class GroupSlowdownFlagged(Derived):
    """A rack or placement group computes persistently slower than the run as a whole
    (its median against the median of the groups' medians). rank -1; node: the group's
    first node. Never evicts: environmental -> alert facilities, otherwise a human looks."""

    KIND: ClassVar[str] = "group_slowdown_flagged"
    VERSION: ClassVar[int] = 1

    group: str = Field(max_length=128)
    group_kind: str = Field(max_length=32, description="rack or placement_group")
    members: list[str] = Field(max_length=4096, description="The group's nodes.")
    slowdown: float = Field(ge=0, description="Mean group median / run reference over the streak.")
    threshold: float = Field(ge=0, description="Relative excess above which a step counted as slow.")
    consecutive_steps: int = Field(ge=0)
    onset_step: int = Field(ge=-1)
    diagnosis: Diagnosis
    action: StragglerAction
    evidence: dict[str, float] = Field(default_factory=dict)


class GroupSlowdownCleared(Derived):
    """A flagged group is back within its threshold."""

    KIND: ClassVar[str] = "group_slowdown_cleared"
    VERSION: ClassVar[int] = 1

    group: str = Field(max_length=128)
    flagged_steps: int = Field(ge=0)


class ResumeRejected(Derived):
    """The core's record of a checkpoint refused before resume (from CheckpointRejected):
    its reason, the step the attempt resumes from instead, and the interruption whose
    restart it belongs to (its timeline entry). A checkpoint fault quarantines no node."""

    KIND: ClassVar[str] = "resume_rejected"
    VERSION: ClassVar[int] = 1

    checkpoint_step: int = Field(ge=0)
    resumed_from_step: int = Field(ge=-1)
    interruption_id: str = Field(default="", max_length=200, description="'' when no interruption is open.")


DERIVED_KINDS: tuple[type[Derived], ...] = (
    StragglerFlagged,
    StragglerCleared,
    StragglerDiagnosed,
    EvictionDecision,
    RanksMissing,
    GradSpike,
    MtbfUpdate,
    HangDetected,
    SdcMismatch,
    Interruption,
    InterruptionRecovered,
    Quarantine,
    Page,
    IntervalUpdate,
    GoodputReport,
    QuarantineReleased,
    GroupSlowdownFlagged,
    GroupSlowdownCleared,
    ResumeRejected,
    FailurePredicted,
    DrainDecision,
)
