"""A fleet run for failure prediction (issue 46): a long run at run level, as longrun.py
models one, with every GPU's health, failures foretold or not, and drains.

What it emits, in time order (what the decision layer needs, not every rank's step):

- ``RunStarted`` per attempt (nodes, racks, the spares ready, the step resumed from);
- one ``StepTiming`` per job step from the reporting rank (rank 0);
- ``CheckpointWritten`` and ``CheckpointValidated`` at the interval in force;
- ``GpuHealth`` (v3) from every GPU of the attempt every ``health_interval_s`` (each GPU
  at its own offset within the interval), from the launch to the attempt's end: the
  healthy noise and precursor episodes of precursors.py. Real ranks report every 30 s;
  a coarser interval loses no count (the counters are cumulative), only time resolution,
  and keeps a 16,384-rank day at ~11.8 million reports (120 s, the default: the core cuts
  its windows into buckets of prediction.check_every_s, 120 s, and a GPU reporting less
  often than that would leave buckets without its report);
- a failure as longrun.py models one, the culprit rank's ``RankExit`` at its detection:
  a crash at once; a hang after the progress watchdog's step timeout (``hang_detect_s``;
  the job is stalled meanwhile, its GPUs busy); a wrong GPU at the first ring check after
  its onset (every ``ring_check_every_s`` of training, judged 3 steps after), the job
  training on meanwhile and then resuming from the checkpoint before the onset (every
  step since is re-done). A failure while the job is down strikes at the next launch.

Restarts take R (``reschedule_fraction`` of it before the launch); the work since the
last checkpoint is re-done. The core's commands are applied: SetCheckpointInterval and
QuarantineNode as in longrun.py, and DrainNode: the job checkpoints at the next boundary
(the checkpoint the interval makes due, or one at the first step end ``within_s`` after
the command, whichever first), then the node's ranks go to a spare (``drain_swap_s`` from
the checkpoint's end to the next first step) and the node leaves the job, its foretold
failure with it (fleet_truth.py); while the job is down a drained node is simply left out
of the relaunch. A drain found a wrong GPU that had already struck on its node (the
drained node's self-test fails): that is the wrong GPU's detection.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from ...schemas import Command, DrainNode, Envelope, GpuHealth, RankExit, StepTiming
from .factory import EventFactory
from .fleet_scenario import FleetScenario
from .fleet_truth import DrainTruth, FailureTruth, FleetTruth, draw_plan
from .precursors import THERMAL_SLOWDOWN_C, Episode, FleetHealth, throttle_reasons
from .runlevel import DAY_S, RunLevel

#: Receives each event and returns the commands the core issued for it.
Core = Callable[[Envelope], list[Command]]
START_TS = 1_767_225_600.0  # 2026-01-01T00:00:00Z
#: Failures are drawn this far past the run's end, so that the last drains are judged too.
MARGIN_S = 6 * 3600.0
#: Job steps after a ring check's step before it is judged (the core's ring_wait_steps).
RING_WAIT_STEPS = 3


class _FleetRun(RunLevel):
    def __init__(
        self, scenario: FleetScenario, interval_s: float, start_ts: float, run_id: str, validate: bool
    ) -> None:
        f = scenario.fleet
        super().__init__(run_id, f.world_size, f.ranks_per_node, f.nodes_per_rack, interval_s, start_ts)
        self.fleet = f
        self.end_ts = start_ts + f.days * DAY_S
        failures, foretold, false = draw_plan(f, start_ts, MARGIN_S)
        self.truth = FleetTruth(
            start_ts=start_ts,
            failures=failures,
            false_episodes=false,
            intervals=self.intervals,
            quarantined=self.quarantined,
        )
        rng = np.random.default_rng([f.seed, 7])
        self.health = FleetHealth(f.noise, f.world_size, f.ranks_per_node, rng)
        self.health.episodes = sorted([*foretold, *false], key=lambda e: e.start_ts)
        self._onset = 0  # the next episode to bind (health.episodes is in onset order)
        self._fi = 0  # the next failure of the plan
        offsets = rng.random(f.world_size) * f.health_interval_s
        self._order = np.argsort(offsets, kind="stable").tolist()
        self._offsets = np.sort(offsets).tolist()
        self._tick = 0
        self._pos = 0  # the next report of the current tick
        self._factory = EventFactory(run_id, f"{run_id}-h", validate=validate)
        self._template = self._factory.template(GpuHealth)
        self._template["present"] = True
        self._live = False
        self._load = (start_ts, 0.0, 0.0)  # (since, level then, target): first-order to the target
        self.step = -1
        self.ckpt_step = -1
        self.ckpt_done_ts = start_ts
        self.high_water = -1
        self._drains: dict[str, DrainTruth] = {}  # requested, not yet executed
        self._deadline = math.inf
        #: An undetected wrong GPU: (its failure, the good checkpoint's step, the ring's step).
        self._corrupt: tuple[FailureTruth, int, int] | None = None
        self._frozen_high_water = -1
        self._found = False  # the last failure was found by a drain at its boundary
        self._joining: set[int] = set()  # slots a spare took, until its attempt's first step
        self._warming: dict[int, float] = {}  # slot -> the first step it trained from, cold

    # ------------------------------------------------------------------ commands
    def command_handlers(self) -> dict[type[Command], Callable[[Any, float], None]]:
        return {**super().command_handlers(), DrainNode: self._drain}

    def _drain(self, command: DrainNode, ts: float) -> None:
        node = command.node
        if node in self._drains or node not in self.nodes:
            return  # already asked, or no longer in the job
        drain = self._drains[node] = DrainTruth(node, command.issued_ts)
        self.truth.drains.append(drain)
        if not self._live:  # the job is down: left out of the relaunch, no boundary needed
            self._swap(None)
        else:
            self._deadline = min(self._deadline, command.issued_ts + command.within_s)

    def _swap(self, boundary: float | None) -> None:
        """Nodes leave the job (quarantined, drained); spares take their places, fresh.
        `boundary`: the checkpoint boundary a drain stopped the job at (None: it was down)."""
        self.pending_quarantine += [n for n in self._drains if n not in self.pending_quarantine]
        for node, spare in self.relaunch_nodes():
            slot = self.nodes.index(spare)
            self.health.replace_node(slot)
            if self.fleet.spare_idle:
                self._joining.add(slot)  # idle until now: it warms up from its first step
            drain = self._drains.get(node)
            for failure in self.truth.failures[self._fi :]:
                if failure.node == node and failure.outcome == "pending":
                    failure.outcome = "drained" if drain is not None else "removed"
                    if drain is not None:
                        failure.drained_ts = drain.decided_ts
                        if drain.failure is None:
                            drain.failure, drain.failure_ts = failure.id, failure.ts
            if drain is not None:
                drain.boundary_ts = boundary
                if drain.failure is None:  # the node failed after the decision, before the boundary
                    late = [
                        f
                        for f in self.truth.failures
                        if f.node == node and (f.struck_ts or 0) >= drain.decided_ts
                    ]
                    if late:
                        drain.failure, drain.failure_ts, drain.late = late[0].id, late[0].ts, True
                drain.false_episode = any(
                    e.node == node and e.start_ts <= drain.decided_ts for e in self.truth.false_episodes
                )
        self._drains.clear()
        self._deadline = math.inf

    # ------------------------------------------------------------------ health
    def _load_at(self, ts: float) -> float:
        since, level, target = self._load
        return target + (level - target) * math.exp(-max(0.0, ts - since) / self.fleet.noise.thermal_tau_s)

    def _set_load(self, ts: float, target: float) -> None:
        self._load = (ts, self._load_at(ts), target)

    def _slot_load(self, slot: int, ts: float) -> float:
        """The load of a node that joined this attempt (a spare, idle before): it warms up
        from the attempt's first step, whatever the others' temperature."""
        load = self._load_at(ts)
        since = self._warming.get(slot)
        if since is None:
            return load
        if ts - since > 20 * self.fleet.noise.thermal_tau_s:
            del self._warming[slot]
            return load
        return min(load, 1.0 - math.exp(-max(0.0, ts - since) / self.fleet.noise.thermal_tau_s))

    def _bind(self, until: float) -> None:
        """Each precursor belongs to the node in its slot when it begins."""
        episodes = self.health.episodes
        while self._onset < len(episodes) and episodes[self._onset].start_ts <= until:
            episode: Episode = episodes[self._onset]
            episode.node = self.nodes[episode.slot]
            if episode.failure is not None:
                self.truth.failures[episode.failure].node = episode.node
            self._onset += 1

    def _flush(self, until: float) -> Iterator[Envelope]:
        """Every GPU's reports due before `until` (from the GPUs of a live attempt)."""
        interval, w, h = self.fleet.health_interval_s, self.world_size, self.health
        rpn, order, offsets = self.ranks_per_node, self._order, self._offsets
        build, truth, template = self._factory.build, self.truth, self._template
        run_id, next_id = self.run_id, self._factory.next_id
        hot = THERMAL_SLOWDOWN_C
        while True:
            t0 = self.truth.start_ts + self._tick * interval
            if self._pos == 0:
                if t0 >= until:
                    self._bind(until)
                    return
                self._bind(t0)
                h.tick(t0, interval, self.nodes)
            while self._pos < w:
                ts = t0 + offsets[self._pos]
                if ts >= until:
                    self._bind(until)
                    return
                if self._live:
                    rank = order[self._pos]
                    data = template.copy()
                    data["event_id"] = next_id()
                    data["run_id"], data["attempt"], data["rank"] = run_id, self.attempt, rank
                    data["node"], data["step"], data["ts"] = self.nodes[rank // rpn], self.step, ts
                    c = h.columns(t0)
                    data.update(c.static[rank])
                    load = self._slot_load(rank // rpn, ts) if self._warming else self._load_at(ts)
                    temp = data["temperature_c"] = c.idle_c[rank] + load * c.rise_c[rank]
                    data["power_w"] = c.idle_w[rank] + load * c.rise_w[rank]
                    slow = c.slowdown[rank]
                    data["throttle_reasons"] = throttle_reasons(slow, temp) if slow or temp > hot else []
                    yield build(GpuHealth, data)
                    truth.health_reports += 1
                self._pos += 1
            self._tick += 1
            self._pos = 0

    # ------------------------------------------------------------------ failures
    def _due(self, before: float) -> FailureTruth | None:
        """The next failure of the plan still to come that strikes before `before`."""
        failures = self.truth.failures
        while self._fi < len(failures) and failures[self._fi].outcome != "pending":
            self._fi += 1
        if self._fi < len(failures) and failures[self._fi].ts < before:
            return failures[self._fi]
        return None

    def _strikes(self, failure: FailureTruth) -> bool:
        """At its strike: a foretold failure whose node left the job never strikes."""
        if failure.precursor is None:
            failure.node = self.nodes[failure.slot]
        elif failure.node not in self.nodes:
            failure.outcome = "removed"
            return False
        return True

    def _exit(self, failure: FailureTruth, ts: float) -> RankExit:
        failure.outcome, failure.detected_ts = "struck", ts
        rank = failure.slot * self.ranks_per_node + failure.gpu
        hung = failure.kind == "hang"
        self._live = False
        self._set_load(ts, 0.0)
        return RankExit(
            **self.envelope(rank, max(self.step, self.ckpt_step), ts),
            exit_code=-9 if hung else 1,
            signal=9 if hung else None,
        )

    # ------------------------------------------------------------------ the run
    def events(self) -> Iterator[Envelope]:
        """The run's events in time order; reads what `apply` changes (the interval, the
        nodes, the drains) as it goes."""
        f, truth = self.fleet, self.truth
        launch_ts, first_ts, restart = truth.start_ts, truth.start_ts + f.step_s, "first"
        while True:
            # ---- launch an attempt (a failure due before its first step fails it)
            if launch_ts >= self.end_ts:
                return
            yield from self._flush(launch_ts)
            self._live = True
            self.health.new_attempt()
            self._set_load(launch_ts, 0.0)
            yield self.run_started(launch_ts, self.ckpt_step, spares=f.spares)
            self.step = self.ckpt_step
            failure, at = self._due(first_ts), launch_ts
            while failure is not None:
                at = max(failure.ts, launch_ts)
                if at >= self.end_ts:
                    failure = None
                    break
                yield from self._flush(at)
                if self._strikes(failure):
                    break
                failure = self._due(first_ts)
            if failure is not None:
                self._account(restart, at - launch_ts)
                failure.struck_ts = at
                yield self._exit(failure, at)
                t = at
            elif first_ts >= self.end_ts:
                self._account(restart, self.end_ts - launch_ts)
                yield from self._flush(self.end_ts)
                return
            else:
                self._account(restart, first_ts - launch_ts)
                trained = yield from self._train(first_ts)
                if trained is None:
                    return
                t = trained
                if self._live:  # a planned stop for a drain at the checkpoint that ended at t
                    self._live = False
                    self._set_load(t, 0.0)
                    self._swap(t)
                    self.attempt += 1
                    launch_ts, first_ts, restart = t + f.drain_swap_s / 2, t + f.drain_swap_s, "drain"
                    self._account("drain", launch_ts - t)
                    continue
            # ---- restart after a failure detected at t: R to the next first step
            self._swap(t if self._drains and self._found else None)
            self._found = False
            self.attempt += 1
            launch_ts, first_ts, restart = t + f.reschedule_fraction * f.restart_s, t + f.restart_s, "failure"
            self._account(restart, min(launch_ts, self.end_ts) - t)

    def _account(self, restart: str, seconds: float) -> None:
        if restart == "failure":
            self.truth.restart_s += seconds
        elif restart == "drain":
            self.truth.drain_s += seconds

    def _train(self, first_ts: float) -> Generator[Envelope, None, float | None]:
        """Train from the attempt's first step until a failure's detection (its ts), a
        drain's planned stop (the ts its checkpoint ended, the attempt still live), or the
        run's end (None)."""
        f, truth, end = self.fleet, self.truth, self.end_ts
        t = first_ts - f.step_s
        yield from self._flush(t)
        self._set_load(t, 1.0)
        self._warming.update(dict.fromkeys(self._joining, t))
        self._joining.clear()
        self.ckpt_done_ts = t
        since = 0.0
        while True:
            checkpointing = since >= self.interval_s or (bool(self._drains) and t >= self._deadline)
            done = t + (f.checkpoint_s if checkpointing else f.step_s)
            failure = self._due(min(done, end))
            if failure is not None:
                yield from self._flush(failure.ts)
                if not self._strikes(failure):
                    continue
                failure.struck_ts = failure.ts
                if failure.kind == "wrong_gpu":
                    failure.outcome = "struck"  # silently: detected later
                    if self._corrupt is None:  # the job trains on, wrong, until a ring check
                        ring = max(1, round(f.failures.ring_check_every_s / f.step_s))
                        judged = (self.step // ring + 1) * ring + RING_WAIT_STEPS
                        self._corrupt = (failure, self.ckpt_step, judged)
                        self._frozen_high_water = self.high_water
                    else:
                        failure.detected_ts = self._corrupt[0].detected_ts  # found with the first
                    continue
                # the step in progress and everything since the last checkpoint is re-done
                if checkpointing:
                    truth.checkpoint_s += failure.ts - t
                    truth.lost_s += t - self.ckpt_done_ts
                else:
                    truth.lost_s += failure.ts - self.ckpt_done_ts
                detected = failure.ts
                if failure.kind == "hang":
                    detected = min(end, failure.ts + f.failures.hang_detect_s)
                    truth.stall_s += detected - failure.ts
                yield from self._flush(detected)
                if detected >= end:
                    return None
                self._rolled_back(self.ckpt_step)  # a wrong GPU as well: back before its onset
                yield self._exit(failure, detected)
                return detected
            if done >= end:  # the run ends here; nothing is re-done
                if checkpointing:
                    truth.checkpoint_s += end - t
                yield from self._flush(end)
                return None
            yield from self._flush(done)
            t = done
            if checkpointing:
                truth.checkpoint_s += f.checkpoint_s
                truth.checkpoints += 1
                self.ckpt_step, self.ckpt_done_ts, since = self.step, t, 0.0
                yield from self.checkpoint(self.step, t, f.checkpoint_s)
                if self._drains:
                    found = self._found_by_drain(t)
                    if found is not None:
                        self._found = True
                        yield found
                    return t  # the planned stop, or the failure the drain found
                continue
            self.step += 1
            if self._corrupt is None:
                self.high_water = max(self.high_water, self.step)
            since += f.step_s
            yield StepTiming(**self.envelope(0, self.step, t), compute_s=0.7 * f.step_s, total_s=f.step_s)
            if self._corrupt is not None and self.step >= self._corrupt[2]:
                wrong = self._corrupt[0]
                self._rolled_back(self.step)
                yield self._exit(wrong, t)
                return t

    def _rolled_back(self, upto: int) -> None:
        """A wrong GPU found (or another failure while one computes wrong answers): the job
        goes back to the checkpoint before its onset; the steps from there to `upto` are
        re-done (those after `upto` are already counted)."""
        if self._corrupt is None:
            return
        wrong, good, _ = self._corrupt
        self.truth.lost_s += max(0, upto - good) * self.fleet.step_s
        self.ckpt_step = good
        self.high_water = self._frozen_high_water
        wrong.outcome = "struck"
        self._corrupt = None

    def _found_by_drain(self, ts: float) -> RankExit | None:
        """A drained node's self-test finds the wrong GPU that struck on it: its detection."""
        if self._corrupt is None or self._corrupt[0].node not in self._drains:
            return None
        wrong = self._corrupt[0]
        self._rolled_back(self.step)
        return self._exit(wrong, ts)

    def finish(self) -> FleetTruth:
        truth = self.truth
        truth.elapsed_s = self.end_ts - truth.start_ts
        truth.steps = self.high_water + 1
        return truth


def simulate_fleet(
    scenario: FleetScenario,
    core: Core,
    interval_s: float = 1800.0,
    start_ts: float = START_TS,
    run_id: str | None = None,
    validate: bool = False,
) -> FleetTruth:
    """Drive `core` with the fleet run's events for the scenario's days; return what
    really happened. `validate`: build every GpuHealth through pydantic (tests)."""
    sim = _FleetRun(scenario, interval_s, start_ts, run_id or f"fleet-{scenario.name}", validate)
    for event in sim.events():
        commands = core(event)
        if commands:
            sim.apply(commands, event.ts)
    return sim.finish()
