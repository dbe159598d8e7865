"""A simulated cluster and the faults injected into it, as one validated YAML file.

A scenario reads like the fault plans of torchft (``fail_at(rank, step)``) and NVRx
(``Fault.SIGKILL``): one line per fault. It is validated once, when loaded, so that
the simulator's hot loop can build events without re-validating them, and so that a
typo fails at load time with the field named (``faults.1.rank: ...``), not minutes
into a demo.

Steps are numbered from 0. A fault "at step s" strikes while step s runs, so step
s never completes in that attempt; a checkpoint "at step s" is taken after step s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: Stack signature of a rank waiting for its peers inside the gradient all-reduce.
COLLECTIVE_STACK = "collective:allreduce"
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


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


class NanFault(_RankFault):
    """The rank's loss is NaN at the step (a bad batch, or corrupted arithmetic)."""

    kind: Literal["nan"]


class GradSpikeFault(_RankFault):
    """The global grad norm jumps by `factor` at the step (the SDC ceiling rule's input)."""

    kind: Literal["grad_spike"]
    factor: float = Field(default=50.0, gt=1)


class SdcFault(_RankFault):
    """From `at_step` on, the rank's GPU computes wrong answers: its bitwise self-checks
    fail (two digests of the same microbatch differ). Hardware: stays until replaced."""

    kind: Literal["sdc"]


SlowCause = Literal["thermal", "link", "network", "unknown"]


class SlowFault(_Strict):
    """Compute on the target is `factor` times slower for steps [from_step, to_step).

    The target is one rank, one node, or a whole rack (an environmental cause, seed R2).
    `cause` shapes the GpuHealth the target reports (hot and throttled, a narrow NVLink,
    a busy NIC), so straggler diagnosis has evidence to find. The slowness belongs to the
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


Fault = Annotated[
    CrashFault | HangFault | SlowFault | NanFault | GradSpikeFault | SdcFault,
    Field(discriminator="kind"),
]
RankFault = CrashFault | HangFault | NanFault | GradSpikeFault | SdcFault


@dataclass(frozen=True, slots=True)
class FaultTruth:
    """Ground truth of one injected fault, for comparing detections against it.

    `rank` and `node` are None for a rack-wide fault; `rank` is None for a node-wide one.
    `step` is the step the fault strikes (a crash at step 80 leaves 79 as the last
    completed step); `until_step` is the exclusive end of a slow window."""

    kind: str
    rank: int | None
    node: str | None
    rack: str
    step: int
    until_step: int | None = None
    cause: str = ""


class Scenario(_Strict):
    """A simulated synchronous job and the faults to inject into it."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    run_id: str | None = Field(default=None, max_length=128, description="Default: sim-<name>-<random>.")
    world_size: int = Field(ge=1, le=131_072)
    ranks_per_node: int = Field(default=8, ge=1, le=1024)
    nodes_per_rack: int = Field(default=16, ge=1)
    step_time_s: float = Field(gt=0, le=3600, description="Healthy median of the total step time.")
    compute_fraction: float = Field(
        default=0.7, gt=0, lt=1, description="Share of the step spent computing before the collective."
    )
    jitter: float = Field(default=0.03, ge=0, le=1, description="Lognormal sigma of per-rank compute noise.")
    steps: int = Field(ge=1, description="Steps 0..steps-1; the job ends after the last.")
    checkpoint_every: int = Field(default=100, ge=1, description="Checkpoint after each multiple of this.")
    checkpoint_blocking_s: float = Field(default=0.0, ge=0, description="Added to the next step (seed C).")
    checkpoint_write_s: float = Field(default=1.0, ge=0, description="Background write until durable.")
    checkpoint_validate_s: float = Field(default=1.0, ge=0, description="Validation after the write.")
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    gpu_health_interval_s: float = Field(default=0.0, ge=0, description="0: no GpuHealth events.")
    sdc_check_every: int = Field(
        default=0, ge=0, description="A rotating rank self-checks every this many steps (R3); 0: never."
    )
    restart_delay_s: float = Field(
        default=2.0, ge=0, description="Launcher time from teardown to RunStarted."
    )
    orphan_restart_after_s: float = Field(
        default=60.0,
        gt=0,
        description="A stalled attempt that no command aborts is torn down by the simulated "
        "launcher after this long (the collective timeout), then restarted.",
    )
    seed: int = 0
    faults: list[Fault] = Field(default_factory=list)

    # ------------------------------------------------------------------ validation
    @model_validator(mode="after")
    def _faults_fit(self) -> Scenario:
        nodes = set(self.node_names())
        racks = set(self.racks().values())
        for i, fault in enumerate(self.faults):
            where = f"faults.{i}"
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
            if isinstance(fault, SlowFault):
                node = self.node_of(fault.rank) if fault.rank is not None else fault.node
                rack = racks[node] if node is not None else str(fault.rack)
                out.append(
                    FaultTruth("slow", fault.rank, node, rack, fault.from_step, fault.to_step, fault.cause)
                )
            else:
                node = self.node_of(fault.rank)
                out.append(FaultTruth(fault.kind, fault.rank, node, racks[node], fault.at_step))
        return out

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read and validate a YAML scenario; raises ScenarioError naming each bad field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ScenarioError(f"{path}: cannot read scenario: {exc}") from exc
        if not isinstance(data, dict):
            raise ScenarioError(f"{path}: a scenario is a YAML mapping, got {type(data).__name__}")
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
        """A scenario shipped in producers/simulator/scenarios/ (e.g. "demo", "healthy-16k")."""
        return cls.load(SCENARIO_DIR / f"{name}.yaml")
