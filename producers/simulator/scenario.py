"""A simulated cluster and the faults injected into it, as one validated YAML file.

A scenario reads like the fault plans of torchft (``fail_at(rank, step)``) and NVRx
(``Fault.SIGKILL``): one line per fault. It is validated once, when loaded, so that
the simulator's hot loop can build events without re-validating them, and so that a
typo fails at load time with the field named (``faults.1.rank: ...``), not minutes
into a demo.

Steps are numbered from 0. A fault "at step s" strikes while step s runs, so step
s never completes in that attempt; a checkpoint "at step s" is taken after step s.

The scenario library (``scenarios/library/*.yaml``, :meth:`Scenario.library`) holds one
small scenario per fault of issue 3 plus healthy controls, each with its ground truth
(:meth:`Scenario.truth`), for measuring detectors against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...schemas import Diagnosis
from ...schemas.events import PageRule

#: Stack signature of a rank waiting for its peers inside the gradient all-reduce.
COLLECTIVE_STACK = "collective:allreduce"
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
LIBRARY_DIR = SCENARIO_DIR / "library"
#: A library file with this section is a run-level fleet scenario (fleet_scenario.py).
FLEET_SECTION = "fleet"


class ScenarioError(ValueError):
    """A scenario file that cannot be read or does not validate; the message names the fields."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _RankFault(_Strict):
    rank: int = Field(ge=0, description="Global rank the fault strikes.")
    at_step: int = Field(ge=0, description="The step during which it strikes.")
    repeat: bool = Field(
        default=False,
        description="Strike again whenever at_step is re-run after a restart (a data or code "
        "fault); by default a fault strikes once (hardware that was replaced).",
    )


class CrashFault(_RankFault):
    """The rank's process dies mid-step. Its peers wait in the all-reduce, alive, forever."""

    kind: Literal["crash"]
    signal: int | None = Field(default=9, ge=1, le=128, description="Killing signal; null: plain exit.")
    exit_code: int | None = Field(default=None, description="Default: -signal, or 1 without a signal.")

    @property
    def effective_exit_code(self) -> int:
        if self.exit_code is not None:
            return self.exit_code
        return -self.signal if self.signal is not None else 1


class HangFault(_RankFault):
    """The rank stops making progress while staying alive (a wedged NIC, a deadlock)."""

    kind: Literal["hang"]
    stack: str = Field(
        default="compute:forward>matmul",
        min_length=1,
        max_length=2000,
        description="Stack signature the culprit reports when asked for a dump; must differ "
        "from the others' (collective:allreduce) for the odd-stack rule to name it.",
    )
    phase: str = Field(
        default="forward",
        min_length=1,
        max_length=32,
        description="Training phase the culprit's heartbeats report while it hangs; the others "
        "report allreduce (they wait for it in the collective).",
    )


class NanFault(_RankFault):
    """The rank's loss is NaN at the step (a bad batch, or corrupted arithmetic); the
    all-reduced gradient is then NaN on every rank. A burst (`steps` > 1) lasts steps
    at_step .. at_step + steps - 1 of the attempt it strikes in; with `all_ranks`, every
    rank's loss is NaN (an overflow in the global batch, poisoned weights)."""

    kind: Literal["nan"]
    steps: int = Field(default=1, ge=1, le=10_000, description="Length of the burst in steps.")
    all_ranks: bool = Field(default=False, description="Every rank's loss is NaN, not only `rank`'s.")


class GradSpikeFault(_RankFault):
    """The global grad norm jumps by `factor` at the step (the SDC ceiling rule's input)."""

    kind: Literal["grad_spike"]
    factor: float = Field(default=50.0, gt=1)


class SdcFault(_RankFault):
    """From `at_step` on, the rank's GPU computes wrong answers: its bitwise self-checks
    fail (two digests of the same microbatch differ), and its cross-rank check values are
    off. Hardware: stays until replaced."""

    kind: Literal["sdc"]


class BitFlipFault(_RankFault):
    """A transient bit flip: the rank's first self-check at or after `at_step` returns
    differing digests, once; every later check passes. Never repeats."""

    kind: Literal["bitflip"]
    repeat: Literal[False] = False


class WrongGpuFault(_RankFault):
    """A deterministically wrong GPU (seed R3): from `at_step` on it computes the same wrong
    answer twice, so its self-checks PASS (equal digests), but its value in a cross-rank
    check is off by the relative `bias`, far beyond good hardware's spread
    (`cross_rank_noise`). Hardware: stays until the node is replaced."""

    kind: Literal["wrong_gpu"]
    bias: float = Field(default=1e-4, gt=0, le=1, description="Relative error of its cross-rank values.")


SlowCause = Literal["thermal", "power", "link", "network", "unknown"]


class SlowFault(_Strict):
    """Compute on the target is `factor` times slower for steps [from_step, to_step).

    The target is one rank, one node, or a whole rack (an environmental cause, seed R2).
    `cause` shapes the GpuHealth the target reports, so straggler diagnosis has evidence
    to find: thermal (hot, ~91 °C, thermal_throttle, lower SM clock), power (power_capped,
    lower SM clock, normal temperature), link (NVLink at half width, retries climbing from
    the onset), network (NIC utilisation ~0.97), unknown (nothing). The slowness belongs to the
    hardware: a rank moved to a replacement node is healthy again, unless the whole rack
    is slow (the replacement lands in the same rack).
    """

    kind: Literal["slow"]
    rank: int | None = Field(default=None, ge=0)
    node: str | None = None
    rack: str | None = None
    from_step: int = Field(default=0, ge=0)
    to_step: int | None = Field(default=None, ge=1, description="Exclusive; null: until the end.")
    factor: float = Field(gt=1, le=100)
    cause: SlowCause = "unknown"

    @model_validator(mode="after")
    def _one_target(self) -> SlowFault:
        targets = [name for name in ("rank", "node", "rack") if getattr(self, name) is not None]
        if len(targets) != 1:
            raise ValueError(f"a slow fault needs exactly one of rank, node, rack (got {targets or 'none'})")
        if self.to_step is not None and self.to_step <= self.from_step:
            raise ValueError(f"to_step ({self.to_step}) must be greater than from_step ({self.from_step})")
        return self

    def active(self, step: int) -> bool:
        return self.from_step <= step and (self.to_step is None or step < self.to_step)


class PhantomRanksFault(_Strict):
    """Records from ranks that do not exist: a launcher with a stale host list, a job of
    another size writing under this run's id, a spoofing producer. For steps [from_step,
    to_step), whenever the job completes a step, each of `ranks` (all >= world_size)
    reports a well-formed StepTiming and Heartbeat from `node`, `slowdown` times slower
    than the median rank, so that a core which accepted them would flag phantom
    stragglers. The processors must reject every one (dead letter: rank out of range)."""

    kind: Literal["phantom_ranks"]
    ranks: list[int] = Field(min_length=1, max_length=1024, description="Ranks >= world_size.")
    node: str = Field(default="node-phantom", min_length=1, max_length=128)
    from_step: int = Field(default=0, ge=0)
    to_step: int | None = Field(default=None, ge=1, description="Exclusive; null: until the end.")
    slowdown: float = Field(default=3.0, gt=0, le=100)

    def active(self, step: int) -> bool:
        return self.from_step <= step and (self.to_step is None or step < self.to_step)


Fault = Annotated[
    CrashFault
    | HangFault
    | SlowFault
    | NanFault
    | GradSpikeFault
    | SdcFault
    | BitFlipFault
    | WrongGpuFault
    | PhantomRanksFault,
    Field(discriminator="kind"),
]
RankFault = CrashFault | HangFault | NanFault | GradSpikeFault | SdcFault | BitFlipFault | WrongGpuFault


class Noise(_Strict):
    """Realistic noise on top of the lognormal `jitter` body, that a detector must NOT
    mistake for a fault: GPUs that are persistently a little faster or slower than
    others (`rank_spread`), a heavy Pareto tail (OS noise, page faults, a dataloader
    hiccup: one rank, one step) and garbage-collector pauses. All off by default.

    A tail event multiplies one rank's compute of one step by 1 + x, x ~ Pareto(scale
    `tail_min`, shape `tail_alpha`) capped at `tail_max`; a GC pause adds a uniform
    `gc_pause_s` to one random rank's compute. Both are measured before the collective,
    so they show in compute_s (and, through the slowest rank, in every total_s). In a
    synchronous job the slowest rank sets the step, so tails lengthen the median step a
    little: keep world_size * tail_prob small (about 1 per step) at large world sizes."""

    rank_spread: float = Field(
        default=0.0,
        ge=0,
        le=0.5,
        description="Lognormal sigma of each rank's persistent speed (silicon lottery).",
    )
    tail_prob: float = Field(default=0.0, ge=0, le=1, description="Chance per rank per step of a tail event.")
    tail_alpha: float = Field(default=1.5, gt=0, le=10, description="Pareto shape; smaller is heavier.")
    tail_min: float = Field(default=0.1, gt=0, le=10, description="Smallest tail slowdown (fraction).")
    tail_max: float = Field(default=1.0, gt=0, le=100, description="Cap on a tail slowdown (fraction).")
    gc_pause_prob: float = Field(default=0.0, ge=0, le=1, description="Chance per step of one GC pause.")
    gc_pause_s: tuple[float, float] = Field(default=(0.05, 0.3), description="[min, max] pause seconds.")

    @model_validator(mode="after")
    def _ranges(self) -> Noise:
        low, high = self.gc_pause_s
        if not 0 <= low <= high:
            raise ValueError(f"gc_pause_s must be [min, max] with 0 <= min <= max, got {[low, high]}")
        if self.tail_max < self.tail_min:
            raise ValueError(f"tail_max ({self.tail_max}) must be at least tail_min ({self.tail_min})")
        return self

    @property
    def active(self) -> bool:
        return self.tail_prob > 0 or self.gc_pause_prob > 0


_DIAGNOSES = {
    "thermal": Diagnosis.NODE_THERMAL,
    "power": Diagnosis.NODE_THERMAL,
    "link": Diagnosis.NODE_LINK,
    "network": Diagnosis.NETWORK_CONTENTION,
    "unknown": Diagnosis.UNKNOWN,
}


@dataclass(frozen=True, slots=True)
class FaultTruth:
    """Ground truth of one injected fault, for comparing detections against it.

    `rank` and `node` are None for a rack-wide fault; `rank` is None for a node-wide one.
    `step` is the step the fault strikes (a crash at step 80 leaves 79 as the last
    completed step; a bit flip is armed at `step` and shows at the rank's next self-check);
    `until_step` is the exclusive end of a slow window or a NaN burst. `cause` is a slow
    fault's cause; `repeat` marks a data or code fault that strikes again at the same step
    after every restart (seed R5 rule 3); `factor` a slow fault's slowdown."""

    kind: str
    rank: int | None
    node: str | None
    rack: str
    step: int
    until_step: int | None = None
    cause: str = ""
    repeat: bool = False
    factor: float = field(default=1.0, compare=False)

    @property
    def diagnosis(self) -> Diagnosis | None:
        """What straggler diagnosis should conclude for a slow fault (seed R2): a rack-wide
        thermal or power fault is environmental; otherwise by cause. None for other kinds."""
        if self.kind != "slow":
            return None
        if self.node is None and self.cause in ("thermal", "power"):
            return Diagnosis.ENVIRONMENTAL
        return _DIAGNOSES[self.cause]


#: What must not happen in a run (Expect.must_not), each scored by harness/scoring/evaluate.py:
#:   page_false            a page whose rule is not in `pages` or that no true fault explains
#:   quarantine_innocent   a node quarantined (or evicted) that holds no hardware fault
#:   rollback_after_onset  a rollback for a corruption fault to a checkpoint after its onset
#:   restart_after_same_step  a restart into a step after the same_step page about it
#:   phantom_accepted      a record from a rank outside the world size reaching the core
#: (A missed fault and a detection that explains none always fail a scenario.)
MustNot = Literal[
    "page_false",
    "quarantine_innocent",
    "rollback_after_onset",
    "restart_after_same_step",
    "phantom_accepted",
]
MUST_NOT_DEFAULT: tuple[MustNot, ...] = (
    "page_false",
    "quarantine_innocent",
    "rollback_after_onset",
    "restart_after_same_step",
    "phantom_accepted",
)


class Expect(_Strict):
    """What the run's truth requires besides "find every fault": the pages that are right
    (a data fault repeating at one step must page `same_step`), those it tolerates, and what
    must not happen. A scenario without this section expects no page and forbids
    MUST_NOT_DEFAULT. Names are checked: an unknown rule or harm fails validation."""

    pages: list[PageRule] = Field(
        default_factory=list, description="Rules that must page (each at least once)."
    )
    allow_pages: list[PageRule] = Field(
        default_factory=list,
        description="Rules that may page without counting as false: a pattern the scenario makes "
        "on purpose, e.g. failure_rate when several independent faults are packed into minutes.",
    )
    must_not: list[MustNot] = Field(
        default_factory=lambda: list(MUST_NOT_DEFAULT),
        description="Harms that fail the scenario; a scenario that tolerates one leaves it out.",
    )


class Scenario(_Strict):
    """A simulated synchronous job and the faults to inject into it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = Field(default="", max_length=2000, description="What the scenario shows, for reports.")
    run_id: str | None = Field(default=None, max_length=128, description="Default: sim-<name>-<random>.")
    world_size: int = Field(ge=1, le=131_072)
    ranks_per_node: int = Field(default=8, ge=1, le=1024)
    nodes_per_rack: int = Field(default=16, ge=1)
    step_time_s: float = Field(gt=0, le=3600, description="Healthy median of the total step time.")
    compute_fraction: float = Field(
        default=0.7, gt=0, lt=1, description="Share of the step spent computing before the collective."
    )
    jitter: float = Field(default=0.03, ge=0, le=1, description="Lognormal sigma of per-rank compute noise.")
    noise: Noise = Field(default_factory=Noise, description="Rank spread, heavy tail, GC pauses; all off.")
    cross_rank_noise: float = Field(
        default=1e-7,
        ge=0,
        le=0.01,
        description="Relative float noise between good ranks' values in a cross-rank check "
        "(different reduction orders); the processor derives its tolerance from it.",
    )
    steps: int = Field(ge=1, description="Steps 0..steps-1; the job ends after the last.")
    checkpoint_every: int = Field(default=100, ge=1, description="Checkpoint after each multiple of this.")
    checkpoint_blocking_s: float = Field(default=0.0, ge=0, description="Added to the next step (seed C).")
    checkpoint_write_s: float = Field(default=1.0, ge=0, description="Background write until durable.")
    checkpoint_validate_s: float = Field(default=1.0, ge=0, description="Validation after the write.")
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    stats_every_rank: bool = Field(
        default=False,
        description="Every rank reports its finite step stats each step. Default: one rank per node "
        "does (the all-reduced grad norm is the same on every rank and the core judges a step by its "
        "first report), and any rank whose loss or grad norm is not finite always reports. Halves "
        "the telemetry of a large run.",
    )
    gpu_health_interval_s: float = Field(default=0.0, ge=0, description="0: no GpuHealth events.")
    sdc_check_every: int = Field(
        default=0, ge=0, description="A rotating rank self-checks every this many steps (R3); 0: never."
    )
    restart_delay_s: float = Field(
        default=2.0, ge=0, description="Launcher time from teardown to RunStarted."
    )
    max_restarts: int | None = Field(
        default=None,
        ge=0,
        description="The launcher gives up instead of starting restart number max_restarts + 1 "
        "(every restart counts, commanded ones too, like torchrun --max-restarts); null: never.",
    )
    orphan_restart_after_s: float = Field(
        default=60.0,
        gt=0,
        description="A stalled attempt that no command aborts is torn down by the simulated "
        "launcher after this long (the collective timeout), then restarted.",
    )
    replacement_s: float = Field(
        default=0.0,
        ge=0,
        description="Elastic training (issue 45): seconds a replacement for a quarantined node "
        "takes to arrive, no spare being ready; 0: a spare is always at hand (replaced at the "
        "restart). The launcher then waits for it and restarts, or goes on at once with the "
        "survivors in a smaller world (the step W/W' as long) and grows back at the first "
        "checkpoint after it arrives, as the processor's InterruptionDecided says.",
    )
    decision_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="With a replacement to wait for, how long the launcher waits for the "
        "processor's decision before applying the elastic rule itself (common/elastic.py).",
    )
    seed: int = 0
    live_speed: float = Field(
        default=1.0,
        gt=0,
        le=10_000,
        description="Suggested time compression for a run through the live pipeline (the "
        "driver's `speed`); informational: the simulator itself never reads it.",
    )
    faults: list[Fault] = Field(default_factory=list)
    expect: Expect = Field(default_factory=Expect, description="Required pages and forbidden harms.")

    # ------------------------------------------------------------------ validation
    @model_validator(mode="after")
    def _faults_fit(self) -> Scenario:
        nodes = set(self.node_names())
        racks = set(self.racks().values())
        for i, fault in enumerate(self.faults):
            where = f"faults.{i}"
            if isinstance(fault, PhantomRanksFault):
                inside = [r for r in fault.ranks if r < self.world_size]
                if inside:
                    raise ValueError(f"{where}.ranks: {inside} are inside world_size {self.world_size}")
            rank = getattr(fault, "rank", None)
            if rank is not None and rank >= self.world_size:
                raise ValueError(f"{where}.rank: rank {rank} is outside world_size {self.world_size}")
            step = getattr(fault, "at_step", getattr(fault, "from_step", 0))
            if step >= self.steps:
                raise ValueError(f"{where}: step {step} is beyond the last step ({self.steps - 1})")
            if isinstance(fault, SlowFault):
                if fault.node is not None and fault.node not in nodes:
                    raise ValueError(f"{where}.node: unknown node {fault.node!r} (nodes are node-0000...)")
                if fault.rack is not None and fault.rack not in racks:
                    raise ValueError(f"{where}.rack: unknown rack {fault.rack!r} (racks are {min(racks)}...)")
        return self

    # ------------------------------------------------------------------ layout
    @property
    def node_count(self) -> int:
        return math.ceil(self.world_size / self.ranks_per_node)

    def node_names(self) -> list[str]:
        return [f"node-{i:04d}" for i in range(self.node_count)]

    def node_of(self, rank: int) -> str:
        return f"node-{rank // self.ranks_per_node:04d}"

    def rack_of_node_index(self, index: int) -> str:
        return f"rack-{index // self.nodes_per_rack:02d}"

    def racks(self) -> dict[str, str]:
        return {name: self.rack_of_node_index(i) for i, name in enumerate(self.node_names())}

    # ------------------------------------------------------------------ truth
    def truth(self) -> list[FaultTruth]:
        """The planned faults in plan order, with each one's node and rack resolved."""
        racks = self.racks()
        out: list[FaultTruth] = []
        for fault in self.faults:
            if isinstance(fault, PhantomRanksFault):
                out.append(FaultTruth("phantom_ranks", None, fault.node, "", fault.from_step, fault.to_step))
            elif isinstance(fault, SlowFault):
                node = self.node_of(fault.rank) if fault.rank is not None else fault.node
                rack = racks[node] if node is not None else str(fault.rack)
                out.append(
                    FaultTruth(
                        "slow",
                        fault.rank,
                        node,
                        rack,
                        fault.from_step,
                        fault.to_step,
                        fault.cause,
                        factor=fault.factor,
                    )
                )
            else:
                node = self.node_of(fault.rank)
                until = None
                if isinstance(fault, NanFault) and fault.steps > 1:
                    until = fault.at_step + fault.steps
                out.append(
                    FaultTruth(
                        fault.kind, fault.rank, node, racks[node], fault.at_step, until, repeat=fault.repeat
                    )
                )
        return out

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read and validate a YAML scenario; raises ScenarioError naming each bad field."""
        path = Path(path)
        data = read_mapping(path)
        if FLEET_SECTION in data:
            raise ScenarioError(
                f"{path}: a fleet scenario (run-level, failure prediction: fleet_scenario.py), not a "
                f"per-rank one: `trainguard evaluate --scenario {path.stem}` runs it"
            )
        return cls.parse(data, source=str(path))

    @classmethod
    def parse(cls, data: dict[str, object], source: str = "<scenario>") -> Scenario:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = []
            for err in exc.errors(include_url=False):
                msg = err["msg"].removeprefix("Value error, ")
                loc = ".".join(str(p) for p in err["loc"])
                lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")  # cross-field errors name their field
            raise ScenarioError(f"{source}: invalid scenario:\n" + "\n".join(lines)) from exc

    @classmethod
    def builtin(cls, name: str) -> Scenario:
        """A scenario shipped in producers/simulator/scenarios/ (e.g. "demo", "healthy-16k"),
        or in its library/ (e.g. "straggler-thermal")."""
        path = SCENARIO_DIR / f"{name}.yaml"
        if not path.exists() and (LIBRARY_DIR / f"{name}.yaml").exists():
            path = LIBRARY_DIR / f"{name}.yaml"
        return cls.load(path)

    @classmethod
    def library(cls) -> dict[str, Scenario]:
        """The labelled fault scenarios and healthy controls of issue 3, by name, sorted.
        A control has no truth (``not scenario.faults``): it must raise nothing. The
        library's fleet scenarios (failure prediction, issue 46) are fleet_library()'s."""
        out: dict[str, Scenario] = {}
        for path in sorted(LIBRARY_DIR.glob("*.yaml")):
            data = read_mapping(path)
            if FLEET_SECTION in data:
                continue  # a fleet scenario (fleet_scenario.py's fleet_library)
            scenario = cls.parse(data, source=str(path))
            if scenario.name != path.stem:
                raise ScenarioError(f"{path}: name {scenario.name!r} differs from the file name")
            out[scenario.name] = scenario
        return out


def read_mapping(path: Path) -> dict[str, object]:
    """A scenario file's YAML mapping (per-rank or fleet), or ScenarioError saying why not."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read scenario: {exc}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a YAML mapping, got {type(data).__name__}")
    return data
