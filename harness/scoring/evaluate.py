"""Scoring the detectors against labelled fault scenarios.

Each library scenario carries its ground truth (which fault, which rank/node/rack, from
which step). A run's detections (derived events) are matched to the truth detector by
detector: a detection that explains a fault is a true positive, one that explains none
is a false positive, a fault that nothing explains is a false negative. Latency is
measured from the fault's onset, in steps and in seconds of the run's own time.

Detections are half of it: the run's decisions are scored too (harness/scoring/harms.py), by what
a user suffers: false pages, innocent nodes quarantined, rollbacks to a checkpoint after a
corruption's onset, restarts into a step known to fail, records from ranks that do not
exist accepted, and the goodput each fault cost. A scenario's `expect` section says which
pages are right and which harms fail it (by default: none allowed).

Two drivers produce the detections from the same scenario: the pure core in a closed
loop (the simulator reacts to the core's commands in-process, no broker), and the live
pipeline (simulator -> Kafka -> processor -> Kafka), read back from the events topic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from trainguard.processors.core import CorePolicy, CoreState, step
from trainguard.processors.core.outputs import Forward, Reject
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.producers.simulator.scenario import Expect, FaultTruth
from trainguard.schemas import (
    Command,
    Derived,
    Diagnosis,
    Envelope,
    GoodputReport,
    GradSpike,
    Interruption,
    SdcMismatch,
    StepTiming,
    StragglerFlagged,
)
from trainguard.schemas.sharding import route, shard_size

from .harms import Harms, assess

#: Which detector each truth kind should trigger.
EXPECTED: dict[str, str] = {
    "crash": "crash",
    "hang": "hang",
    "slow": "straggler",
    "nan": "non_finite",
    "grad_spike": "grad_spike",
    "bitflip": "sdc_self_check",
    "sdc": "sdc_self_check",
    "wrong_gpu": "sdc_cross_rank",
}
#: A slowdown of a whole rack (or a placement group the run declares) is the group
#: detector's (issue 14, WP-B: GroupSlowdownFlagged); per-rank straggler flags of the
#: rack's ranks explain it too, as the only detector before it.
GROUP_DETECTOR = "group_slowdown"
#: Derived kinds -> detector, for detectors whose classes other work adds.
DETECTOR_KINDS: dict[str, str] = {"group_slowdown_flagged": GROUP_DETECTOR}


def expected_detector(truth: FaultTruth) -> str | None:
    """The detector that should find `truth` (None: not a detection, e.g. phantom ranks)."""
    if truth.kind == "slow" and truth.node is None:
        return GROUP_DETECTOR
    return EXPECTED.get(truth.kind)


@dataclass(frozen=True)
class Detection:
    detector: str
    rank: int
    node: str
    step: int
    ts: float
    event: Derived


def detector_of(output: Derived) -> str | None:
    """The detector a derived event reports for, or None for bookkeeping outputs."""
    if isinstance(output, Interruption):
        # crash, hang, non_finite, ...; an SDC rollback's interruption follows the
        # SdcMismatch that is the detection; an eviction's follows its straggler flag; a
        # smaller world's grow-back (elastic, issue 45) is planned
        return None if output.cause.value in ("sdc", "eviction", "elastic") else output.cause.value
    if isinstance(output, StragglerFlagged):
        return "straggler"
    if isinstance(output, SdcMismatch):
        return "sdc_self_check" if output.method == "self_check" else "sdc_cross_rank"
    if isinstance(output, GradSpike):
        return "grad_spike"
    return DETECTOR_KINDS.get(output.KIND)


def detections(outputs: Iterable[Derived]) -> list[Detection]:
    found = []
    for output in outputs:
        detector = detector_of(output)
        if detector is not None:
            found.append(Detection(detector, output.rank, output.node, output.step, output.ts, output))
    return found


def _explains(detection: Detection, truth: FaultTruth, racks: dict[str, str]) -> bool:
    expected = expected_detector(truth)
    also = ("straggler",) if expected == GROUP_DETECTOR else ()
    if detection.detector != expected and detection.detector not in also:
        return False
    if detection.detector in ("non_finite", "grad_spike"):
        return detection.step >= truth.step - 1  # job-level: any rank may report it
    if truth.rank is not None and (truth.kind == "slow" or truth.repeat):
        # A data fault follows its rank and step: after the first failure quarantines
        # the node, the rank runs on a spare and fails there again.
        return detection.rank == truth.rank
    if truth.node is not None:
        return detection.node == truth.node
    # rack-wide fault: a rank of the rack, or the rack (a group flag names it as its node)
    return racks.get(detection.node, detection.node) == truth.rack


@dataclass
class DetectorScore:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    latency_steps: list[int] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    diagnosis_right: int = 0
    diagnosis_wrong: int = 0


@dataclass
class ScenarioScore:
    scenario: str
    detectors: dict[str, DetectorScore]
    truths: list[FaultTruth]
    detections: list[Detection]
    misses: list[FaultTruth]
    false_alarms: list[Detection]
    harms: Harms = field(default_factory=Harms)
    #: What the scenario's truth forbids and happened (harness/scoring/harms.py), one line each.
    violations: list[str] = field(default_factory=list)
    #: The run's goodput as the core last reported it (its widest window; None: no report).
    goodput: float | None = None

    @property
    def failed(self) -> bool:
        return bool(self.misses or self.false_alarms or self.violations)


def score(
    name: str,
    truths: list[FaultTruth],
    outputs: Sequence[Derived | Command],
    step_started_ts: dict[int, float],
    racks: dict[str, str],
    expect: Expect | None = None,
    world_size: int | None = None,
    phantoms: tuple[int, int] | None = None,
) -> ScenarioScore:
    """Match detections to truths, and assess the run's decisions (harness/scoring/harms.py).
    Repeated detections of one fault (a data fault that fails after every restart, each
    rank of a hot aisle) count as one true positive. `outputs` may hold the commands too
    (the SDC detector's quarantine is a command); `phantoms` is (records from ranks
    outside the world size sent, rejected)."""
    found = detections(o for o in outputs if isinstance(o, Derived))
    diagnoses = {
        d.caused_by[0]: d
        for d in outputs
        if isinstance(d, Derived) and isinstance(getattr(d, "diagnosis", None), Diagnosis) and d.caused_by
    }
    scores: dict[str, DetectorScore] = {}
    explained: set[int] = set()
    misses = []
    for truth in truths:
        expected = expected_detector(truth)
        if expected is None:
            continue
        board = scores.setdefault(expected, DetectorScore())
        hits = [i for i, d in enumerate(found) if _explains(d, truth, racks)]
        own = [i for i in hits if found[i].detector == expected]
        explained.update(hits)
        if not own:
            board.fn += 1
            misses.append(truth)
            continue
        board.tp += 1
        first = min((found[i] for i in own), key=lambda d: d.ts)
        board.latency_steps.append(first.step - truth.step)
        onset = step_started_ts.get(truth.step)
        if onset is not None:
            board.latency_s.append(first.ts - onset)
        if expected in ("straggler", GROUP_DETECTOR) and truth.diagnosis is not None:
            # a straggler's StragglerDiagnosed follows it; a group flag carries its own diagnosis
            verdicts = [diagnoses.get(found[i].event.event_id, found[i].event) for i in own]
            right = all(v is not None and getattr(v, "diagnosis", None) == truth.diagnosis for v in verdicts)
            board.diagnosis_right += int(right)
            board.diagnosis_wrong += int(not right)
    false_alarms = [d for i, d in enumerate(found) if i not in explained]
    for alarm in false_alarms:
        scores.setdefault(alarm.detector, DetectorScore()).fp += 1
    expect = expect or Expect()
    harms = assess(truths, outputs, expect, world_size, phantoms, racks, step_started_ts)
    reports = [o for o in outputs if isinstance(o, GoodputReport)]
    last = max(reports, key=lambda r: (r.ts, r.window_s), default=None)
    goodput = last.goodput if last is not None else None
    violations = harms.violations(expect)
    return ScenarioScore(name, scores, truths, found, misses, false_alarms, harms, violations, goodput)


def scores_json(scores: Sequence[ScenarioScore]) -> list[dict[str, object]]:
    """Each scenario's score as plain data (`trainguard evaluate --json`)."""
    out: list[dict[str, object]] = []
    for scored in scores:
        h = scored.harms
        out.append(
            {
                "scenario": scored.scenario,
                "failed": scored.failed,
                "detectors": {name: asdict(board) for name, board in sorted(scored.detectors.items())},
                "misses": [asdict(m) for m in scored.misses],
                "false_alarms": [
                    {"detector": a.detector, "rank": a.rank, "node": a.node, "step": a.step}
                    for a in scored.false_alarms
                ],
                "harms": asdict(h),
                "violations": scored.violations,
                "goodput": scored.goodput,
            }
        )
    return out


def step_start_times(events: Iterable[Envelope]) -> dict[int, float]:
    """When each step started: the ts at which the job completed the step before it."""
    started: dict[int, float] = {}
    for event in events:
        if isinstance(event, StepTiming) and event.step + 1 not in started:
            started[event.step + 1] = event.ts
    return started


@dataclass
class ClosedLoop:
    """What a closed-loop run produced: the core's decisions (derived events and commands),
    when each step started, and the records from ranks outside the world size."""

    cluster: SimulatedCluster
    outputs: list[Derived | Command]
    step_started_ts: dict[int, float]
    phantoms_sent: int = 0
    phantoms_rejected: int = 0
    #: The core's states after the run, one per worker (shard 0's first).
    states: list[CoreState] = field(default_factory=list)


def closed_loop(
    scenario: Scenario,
    policy: CorePolicy,
    dt_s: float = 0.05,
    start_ts: float = 1_000.0,
    shard_ranks: int = 0,
    workers: int = 1,
) -> ClosedLoop:
    """The pure core in a closed loop with the simulator: no broker, no wall clock.

    With `shard_ranks`, the run is cut into shards exactly as the shippers cut it
    (schemas/sharding.py) and shard k is folded by worker k mod `workers`, each worker
    with its own state; forwarded reports go to shard 0's worker, as the live processor
    sends them through Kafka. A record the core rejects (Reject) is what the live driver
    dead-letters."""
    cluster = SimulatedCluster(scenario, start_ts, run_id=f"eval-{scenario.name}", id_prefix="e")
    world = scenario.world_size
    size = shard_size(world, shard_ranks)
    states = [CoreState() for _ in range(max(1, workers))]
    loop = ClosedLoop(cluster, [], {}, states=states)
    started = loop.step_started_ts

    def feed(events: list[Envelope], forwarded: bool = False) -> None:
        for event in events:
            if not forwarded:
                if event.rank >= world:
                    loop.phantoms_sent += 1
                elif isinstance(event, StepTiming) and event.step + 1 not in started:
                    started[event.step + 1] = event.ts  # as step_start_times, without keeping events
            for shard in (0,) if forwarded else route(event, world, size):
                state = states[shard % len(states)]
                for item in step(state, event, policy, world, shard, size)[1]:
                    if isinstance(item, Reject):
                        loop.phantoms_rejected += 1
                    elif isinstance(item, Command):
                        loop.outputs.append(item)
                        try:
                            feed(cluster.apply(item).events)
                        except Exception:  # a command the simulated ranks refuse (e.g. not training)
                            continue
                    elif isinstance(item, Forward):
                        feed([item.event], forwarded=True)
                    else:
                        loop.outputs.append(item)

    t = start_ts
    limit = start_ts + 20 * scenario.steps * scenario.step_time_s + 600
    while not cluster.done and t < limit:
        t += dt_s
        feed(cluster.advance(t))
    return loop


def run_core(
    scenario: Scenario,
    policy: CorePolicy,
    dt_s: float = 0.05,
    start_ts: float = 1_000.0,
    shard_ranks: int = 0,
    workers: int = 1,
) -> ScenarioScore:
    """Score `scenario` through the pure core in a closed loop (closed_loop)."""
    loop = closed_loop(scenario, policy, dt_s, start_ts, shard_ranks, workers)
    return score_loop(scenario, loop)


def score_loop(scenario: Scenario, loop: ClosedLoop) -> ScenarioScore:
    return score(
        scenario.name,
        scenario.truth(),
        loop.outputs,
        loop.step_started_ts,
        scenario.racks(),
        scenario.expect,
        scenario.world_size,
        (loop.phantoms_sent, loop.phantoms_rejected),
    )
