"""Streams for the SDC detector's tests: the synchronous :class:`Job` of streams.py, now
also reporting loss and grad norm every step and answering the SDC check commands the
core sends it, with faults declared (NaN burst, grad spike, flaky or wrong GPU).

:class:`Pipeline` is the wiring the engine will get: ``engine.step`` does the run's
bookkeeping (dedupe, attempts, ranks, job step), then the SDC hooks run on the same
event. Closed loop: the outputs' check commands go back to the job."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

from harness.streams import Job
from trainguard.processors.core import CorePolicy, CoreState, RunState, engine
from trainguard.processors.core.detectors.sdc import (
    SdcPolicy,
    SdcState,
    on_cross_check,
    on_self_check,
    on_step_completed,
    on_step_stats,
)
from trainguard.processors.core.engine import Output
from trainguard.schemas import (
    CrossRankCheck,
    Envelope,
    RingCheck,
    RunCrossRankCheck,
    RunRingCheck,
    RunSelfCheck,
    SdcSelfCheck,
    StepStats,
    StepTiming,
)


@dataclass
class SdcJob(Job):
    """A language-model-like run: loss decays from ~10.8 toward ~2.2 with per-rank batch
    noise; the all-reduced grad norm decays too, with lognormal noise and the occasional
    heavy-tailed bump of a hard batch (as real runs have)."""

    planned_steps: int = 5000
    #: Numerical noise between ranks computing the same microbatch on good hardware.
    cross_rank_noise: float = 1e-7
    #: step -> ranks that report a non-finite loss at that step.
    nan_steps: dict[int, set[int]] = field(default_factory=dict)
    #: step -> factor the step's grad norm is multiplied by.
    grad_spikes: dict[int, float] = field(default_factory=dict)
    #: rank -> first step from which its recomputations flip bits (a transient fault).
    flaky: dict[int, int] = field(default_factory=dict)
    #: rank -> (first step, bias): it computes the same wrong answer every time.
    wrong: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: rank -> step: at the first ring check at or after it, the rank's recomputation of
    #: its neighbour's microbatch flips a bit (once: a transient fault).
    ring_flips: dict[int, int] = field(default_factory=dict)
    #: How far a ring flip moves the recomputed value, relative to it (a high mantissa
    #: bit by default; a few tolerances makes one at the edge of the noise).
    ring_flip: float = 4e-4
    #: Ranks that send no ring check report (dead, or their reports lost).
    silent: set[int] = field(default_factory=set)
    grad_norms: list[float] = field(default_factory=list)
    #: How many of `events` a closed loop has fed to the pipeline.
    fed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._stats = random.Random(self.seed * 7919 + 1)
        self._self_checks: list[RunSelfCheck] = []
        self._cross_checks: list[RunCrossRankCheck] = []
        self._rings: list[RunRingCheck] = []

    def grad_norm(self, step: int) -> float:
        base = 0.4 + 1.6 * math.exp(-step / (self.planned_steps / 10))
        bump = self._stats.paretovariate(3.0) if self._stats.random() < 0.01 else 1.0
        return base * self._stats.lognormvariate(0.0, 0.15) * bump * self.grad_spikes.get(step, 1.0)

    def train(self, n: int) -> SdcJob:
        for _ in range(n):
            self.steps(1)
            step = self.step
            grad = self.grad_norm(step)
            self.grad_norms.append(grad)
            mean_loss = 2.2 + 8.6 * math.exp(-step / (self.planned_steps / 6))
            nan = self.nan_steps.get(step, set())
            for r in range(self.world_size):
                loss = math.nan if r in nan else mean_loss * (1 + 0.02 * self._stats.gauss(0, 1))
                self.events.append(
                    StepStats(
                        **self._env(r),
                        loss=loss,
                        grad_norm=math.nan if nan else grad,
                        finite=not nan,
                    )
                )
            self._answer_checks()
        return self

    def execute(self, outputs: list[Output]) -> None:
        """What the rank actuators do with the SDC commands: run them at the next step."""
        for out in outputs:
            if isinstance(out, RunSelfCheck) and out.attempt == self.attempt:
                self._self_checks.append(out)
            elif isinstance(out, RunCrossRankCheck) and out.attempt == self.attempt:
                self._cross_checks.append(out)
            elif isinstance(out, RunRingCheck) and out.attempt == self.attempt:
                self._rings.append(out)

    def _answer_checks(self) -> None:
        step = self.step
        for command in self._self_checks:
            for r in command.ranks or []:
                batch = f"mb-{step:06d}-r{r}"
                flip = r in self.flaky and step >= self.flaky[r]
                self.events.append(
                    SdcSelfCheck(
                        **self._env(r),
                        microbatch_id=batch,
                        digest_first=_digest(batch, r, 0),
                        digest_second=_digest(batch, r, 1 if flip else 0),
                    )
                )
        for command in self._cross_checks:
            ranks = command.ranks or []
            exact = 2.0 + int(_digest(command.microbatch_id, 0, 0)[:8], 16) / 2**32
            values = [exact + self._stats.gauss(0.0, self.cross_rank_noise) + self._bias(r) for r in ranks]
            self.events.append(
                CrossRankCheck(
                    **self._env(ranks[0]), microbatch_id=command.microbatch_id, ranks=ranks, values=values
                )
            )
        for ring in self._rings:
            self._answer_ring(ring)
        self._self_checks, self._cross_checks, self._rings = [], [], []

    def _answer_ring(self, command: RunRingCheck) -> None:
        """Every rank: the value of its own microbatch, and its recomputation of rank
        (r + offset) mod W's, each with the rank's own float noise and, on a wrong GPU,
        its bias (the same in both: it is wrong the same way every time)."""
        n = self.world_size
        for r in range(n):
            if r in self.silent:
                continue
            peer = (r + command.offset) % n
            flip = self.ring_flip if self.ring_flips.get(r, math.inf) <= self.step else 0.0
            if flip:
                del self.ring_flips[r]
            own = self._value(command.check_id, r, r)
            theirs = self._value(command.check_id, peer, r) * (1.0 + flip)
            env = self._env(r)
            self.events.append(
                RingCheck(**env, check_id=command.check_id, own_value=own, peer_rank=peer, peer_value=theirs)
            )

    def _value(self, check_id: str, microbatch_of: int, rank: int) -> float:
        exact = 2.0 + int(_digest(f"{check_id}/r{microbatch_of}", 0, 0)[:8], 16) / 2**32
        return exact + self._stats.gauss(0.0, self.cross_rank_noise) + self._bias(rank)

    def _bias(self, rank: int) -> float:
        onset, bias = self.wrong.get(rank, (math.inf, 0.0))
        return bias if self.step >= onset else 0.0


def _digest(batch: str, rank: int, variant: int) -> str:
    return hashlib.blake2b(f"{batch}:{rank}:{variant}".encode(), digest_size=16).hexdigest()


@dataclass
class Pipeline:
    """engine.step, then the SDC detector on the same event, as the engine will wire it.

    Once the engine calls the SDC hooks itself (``CorePolicy.sdc`` and ``RunState.sdc``
    exist), this is plain ``engine.step`` with the policy passed in, so these tests then
    check the engine's wiring instead of this one."""

    policy: SdcPolicy = field(default_factory=SdcPolicy)
    core_policy: CorePolicy = field(default_factory=CorePolicy)
    core: CoreState = field(default_factory=CoreState)
    sdc: dict[str, SdcState] = field(default_factory=dict)
    outputs: list[Output] = field(default_factory=list)
    _completed: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.wired = "sdc" in CorePolicy.model_fields
        if self.wired:
            # The detector alone: the rollback it triggers is tested in test_rollback.py.
            update = {"sdc": self.policy, "rollback_on_sdc": False}
            self.core_policy = self.core_policy.model_copy(update=update)

    def run(self, run_id: str = "run-test") -> RunState:
        return self.core.runs[run_id]

    def state(self, run_id: str = "run-test") -> SdcState:
        if self.wired:
            state: SdcState = getattr(self.run(run_id), "sdc")  # noqa: B009 (not there before wiring)
            return state
        return self.sdc[run_id]

    def feed(self, events: list[Envelope]) -> list[Output]:
        out: list[Output] = []
        for event in events:
            out += self.step(event)
        self.outputs += out
        return out

    def step(self, event: Envelope) -> list[Output]:
        if self.wired:
            return engine.step(self.core, event, self.core_policy)[1]
        before = self.core.runs.get(event.run_id)
        dropped = (before.duplicates + before.stale) if before is not None else 0
        _, out = engine.step(self.core, event, self.core_policy)
        run = self.core.runs[event.run_id]
        if run.duplicates + run.stale != dropped:
            return out
        sdc = self.sdc.setdefault(run.run_id, SdcState())
        if isinstance(event, StepStats):
            out += on_step_stats(sdc, run, event, self.policy, engine._interruption)
        elif isinstance(event, SdcSelfCheck):
            out += on_self_check(sdc, run, event, self.policy)
        elif isinstance(event, CrossRankCheck):
            out += on_cross_check(sdc, run, event, self.policy)
        elif isinstance(event, StepTiming):
            key = (run.run_id, run.attempt)
            if event.step > self._completed.get(key, run.resumed_from_step):
                self._completed[key] = event.step
                out += on_step_completed(sdc, run, event.step, event.ts, event.event_id, self.policy)
        return out


def closed_loop(job: SdcJob, pipeline: Pipeline, steps: int) -> list[Output]:
    """Train `steps` steps one at a time, feeding each step's events (and anything the job
    emitted before, such as RunStarted) to the pipeline and its commands back to the job."""
    out = _feed_new(job, pipeline)
    for _ in range(steps):
        job.train(1)
        out += _feed_new(job, pipeline)
    return out


def _feed_new(job: SdcJob, pipeline: Pipeline) -> list[Output]:
    new = pipeline.feed(job.events[job.fed :])
    job.fed = len(job.events)
    job.execute(new)
    return new
