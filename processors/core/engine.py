"""The policy core: ``step(state, event) -> (state, outputs)``.

Pure and deterministic: no clock (time is the events' ts), no I/O, no randomness.
The faust app (live) and the replay engine (offline) both drive this function, so a
backtest decides exactly what the live system decided. Outputs are derived events
and *unsigned* commands; the driver signs commands and publishes both.

`state` is owned by the caller and updated in place (a 16,384-rank run is too big
to copy per event); it is also returned, so call sites read as a fold.

One file on purpose: it is the router that decides, per event kind, which detectors and
policies see it and in what order; the decisions themselves live in the modules it calls.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import numpy as np

from ...schemas import (
    CheckpointRejected,
    CheckpointValidated,
    CheckpointWritten,
    Command,
    CrossRankCheck,
    Derived,
    Diagnosis,
    DrainNode,
    Envelope,
    FailurePredicted,
    GpuHealth,
    GroupComputeTimes,
    GroupSlowdownCleared,
    GroupSlowdownFlagged,
    HangDetected,
    Heartbeat,
    Interruption,
    InterruptionCause,
    InterruptionRecovered,
    MtbfUpdate,
    NodeExcluded,
    NodeSelfTestResult,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    ReleaseNode,
    RingCheck,
    Rollback,
    RunStarted,
    SdcMismatch,
    SdcSelfCheck,
    StepStats,
    StepTiming,
    StragglerAction,
    StragglerCleared,
    StragglerDiagnosed,
    StragglerFlagged,
)
from ...schemas.codec import RejectReason, rank_out_of_range
from .accounting import baseline
from .accounting import goodput as accounting
from .decisions import (
    capacity,
    drain,
    eviction,
    interval,
    node_tests,
    paging,
    quarantine,
    repeat_step,
    resume,
    rollback,
)
from .detectors import diagnosis, group_slowdown, hazard, peer_loss, sdc, slowdown, straggler
from .detectors.stack_window import open_window, window_closed
from .detectors.stacks import hang_culprit
from .detectors.watchdog import is_hung, stall_s, step_timeout_s
from .ids import derived_id
from .outputs import Forward, Reject, abort_for, node_of
from .policy import CorePolicy
from .state import CoreState, OpenInterruption, PendingHang, RankState, RunPhase, RunState, state_key

Output = Derived | Command | Forward | Reject


def step(
    state: CoreState,
    event: Envelope,
    policy: CorePolicy,
    world_size_hint: int | None = None,
    shard: int = 0,
    shard_ranks: int = 0,
) -> tuple[CoreState, list[Output]]:
    """Apply one telemetry event. `world_size_hint` (from the batch header) sizes a run
    whose RunStarted has not been seen; `shard`/`shard_ranks` (also from the header) say
    which shard of a sharded run the event was routed to (schemas/sharding.py)."""
    key = event.run_id if shard == 0 else state_key(event.run_id, shard)
    run = state.runs.get(key)
    if run is None:
        run = state.runs[key] = RunState(
            event.run_id, world_size=world_size_hint, shard=shard, shard_ranks=shard_ranks
        )
        run.step_times = type(run.step_times)(maxlen=policy.hang.window)
    size = run.world_size or world_size_hint
    if size and event.rank >= size:  # a rank that does not exist: no state, no clock, no decision
        run.rejected += 1
        return state, [Reject(event, RejectReason.RANK_OUT_OF_RANGE, rank_out_of_range(event, size))]
    if event.event_id in run.seen.ids:
        run.duplicates += 1
        return state, []
    run.seen.add(event.event_id, policy.dedupe_window)
    if event.attempt < run.attempt:
        run.stale += 1
        return state, []
    ts = event.ts
    if run.first_ts is None or ts < run.first_ts:
        run.first_ts = ts
    if ts > run.last_ts:
        run.last_ts = ts

    if not run.coordinator:
        return state, _on_shard_event(run, event, policy)
    accounting.advance(run.goodput, ts, run.open_interruption is not None, policy.goodput)
    outputs: list[Output] = []
    # Dispatch on the exact class (telemetry kinds are final: schemas/events.py), the
    # most frequent first: an isinstance miss on a pydantic model is an ABC check.
    if type(event) is RunStarted:
        outputs += _on_run_started(run, event, policy)
        outputs += baseline.on_time(run.baseline, run, event, policy.baseline)
        return state, _consequences(run, outputs, policy)  # a crash concluded by the next world
    if event.attempt > run.attempt:  # the launcher's record is late or lost
        outputs += _attempt_over(run, None, policy)
        outputs += _begin_attempt(run, event, resumed_from_step=run.last_validated_step)
    rank = _rank(run, event)
    if type(event) is Heartbeat:
        if rank is not None:
            outputs += _on_heartbeat(run, rank, event, policy)
    elif type(event) is StepStats:
        outputs += sdc.on_step_stats(run.sdc, run, event, policy.sdc, _interruption)
    elif type(event) is GpuHealth:
        diagnosis.observe_health(run.health, run, event, policy.diagnosis)
        hazard.observe(run.hazard, event.rank, event.node, event.ts, event.__dict__, policy.prediction)
    elif type(event) is StepTiming:
        if rank is not None:
            outputs += _on_step_timing(run, rank, event, policy)
    else:
        outputs += _on_other(run, rank, event, policy)
    if run.pending_hang is not None:
        open_window(run.pending_hang, event, run.last_ts)
        outputs += _maybe_conclude_hang(run, event.ts, policy)
    if run.pending_crash is not None and run.pending_hang is None and peer_loss.due(run, policy.crash):
        outputs += _conclude_peer_loss(run, None)
    outputs += baseline.on_time(run.baseline, run, event, policy.baseline)
    if hazard.due(run.hazard, ts, policy.prediction):
        outputs += _predictions(run, event, policy)
    if run.eviction.deferred:
        outputs += eviction.on_time(run.eviction, event.ts, run.attempt, policy.eviction)
    outputs = _consequences(run, outputs, policy)
    reports = accounting.reports(run.goodput, run.run_id, event, policy.goodput)
    if reports:
        outputs += reports
        gp = policy.goodput
        usual_restart = eviction.restart_estimate_s(run.eviction, policy.eviction)
        interval_s = run.interval.current_s or policy.interval.initial_s
        outputs += paging.on_goodput(run.paging, reports[0], gp, usual_restart, interval_s)
    return state, outputs


def _on_step_timing(run: RunState, rank: RankState, event: StepTiming, policy: CorePolicy) -> list[Output]:
    outputs: list[Output] = []
    new_step = event.step > run.job_step
    starting = run.phase == RunPhase.STARTING
    outputs += _on_step(run, rank, event)
    if starting and run.phase == RunPhase.TRAINING:  # the attempt's first step: its ranks listen
        outputs += interval.on_attempt_training(run.interval, run.run_id, event, policy.interval)
    if new_step:
        outputs += sdc.on_step_completed(run.sdc, run, event.step, event.ts, event.event_id, policy.sdc)
        eviction.on_step(run.eviction, event.attempt, event.step, policy.eviction)
    outputs += _stragglers(run, event, policy)
    return outputs


def _on_other(run: RunState, rank: RankState | None, event: Envelope, policy: CorePolicy) -> list[Output]:
    """The telemetry kinds other than the four per-step ones (step's dispatch)."""
    outputs: list[Output] = []
    if isinstance(event, GroupComputeTimes):
        outputs += _group_findings(
            run, group_slowdown.on_summary(run.groups, run, event, policy.group_slowdown, policy.diagnosis)
        )
    elif isinstance(event, SdcSelfCheck):
        outputs += sdc.on_self_check(run.sdc, run, event, policy.sdc)
    elif isinstance(event, CrossRankCheck):
        outputs += sdc.on_cross_check(run.sdc, run, event, policy.sdc)
    elif isinstance(event, RingCheck):
        outputs += sdc.on_ring_check(run.sdc, run, event, policy.sdc)
    elif isinstance(event, CheckpointWritten):
        mtbf = baseline.mtbf_s(run.baseline, policy.baseline)
        outputs += interval.on_checkpoint(run.interval, run.run_id, event, mtbf, policy.interval)
        accounting.on_checkpoint(run.goodput, event)
    elif isinstance(event, CheckpointValidated):
        run.last_validated_step = max(run.last_validated_step, event.checkpoint_step)
        pin = run.sdc.oldest_cross_watermark(run.world_size or len(run.ranks))
        rollback.on_validated(run.rollback, event, rollback.keep_count(run, policy), policy.retention, pin)
    elif isinstance(event, RankExit) and rank is not None:
        outputs += _on_exit(run, rank, event)
    elif isinstance(event, NodeSelfTestResult):
        outputs += node_tests.on_result(run.paging, event, policy.release_on_self_test_pass)
    elif isinstance(event, FailurePredicted):  # a shard's prediction: shard 0 decides the drain
        outputs += drain.on_predicted(run, event, policy)
    elif isinstance(event, StragglerFlagged | StragglerDiagnosed | StragglerCleared):  # a shard's
        outputs += _decide_straggler(run, event, policy)
    elif isinstance(event, NodeExcluded):
        outputs += drain.on_excluded(run, event)
    elif isinstance(event, CheckpointRejected):
        outputs += resume.on_rejected(run, event)
        if event.attempt == run.attempt and run.phase == RunPhase.STARTING:
            _resumes_from(run, run.resumed_from_step)
    return outputs


def _consequences(run: RunState, outputs: list[Output], policy: CorePolicy) -> list[Output]:
    """What the decisions of one event imply: rollbacks behind SDC findings, and for each
    interruption its baseline, pages, quarantine and accounting; the node moves and MTBF
    updates that follow."""
    if outputs:
        if policy.rollback_on_sdc:
            found_now = [o for o in outputs if isinstance(o, SdcMismatch)]
            for found in found_now:  # back to the clean ancestor of every device found at once
                outputs += _roll_back(run, found, found_now)
        for interruption in [o for o in outputs if isinstance(o, Interruption)]:
            if interruption.cause not in capacity.PLANNED:  # planned: not a failure
                starting = interruption.step <= run.resumed_from_step  # no step done in its attempt
                outputs += baseline.on_interruption(run.baseline, run, interruption, policy.baseline)
                pages = paging.on_interruption(
                    run.paging, interruption, run.baseline, policy.baseline, policy.paging, starting
                )
                outputs += pages
                outputs += quarantine.on_interruption(run.paging, interruption, starting)
                outputs += repeat_step.on_pages(run.paging, interruption, pages, policy.paging, starting)
            accounting.on_interruption(run.goodput, interruption, list(run.step_times))
            if interruption.cause not in capacity.PLANNED and interruption.node:
                hazard.on_failure(run.hazard, interruption.node, interruption.ts, policy.prediction)
        for drained in [o for o in outputs if isinstance(o, DrainNode)]:
            hazard.on_drained(run.hazard, drained.node)
        for leaving in [o for o in outputs if isinstance(o, QuarantineNode)]:  # one node, one action
            eviction.on_node_leaving(run.eviction, leaving.node, leaving.attempt, leaving.command_id)
            node_tests.note_leaving(run.paging, leaving)
        for back in [o for o in outputs if isinstance(o, ReleaseNode)]:
            node_tests.note_released(run.paging, back)
        for recovered in [o for o in outputs if isinstance(o, InterruptionRecovered)]:
            eviction.on_recovered(run.eviction, recovered, policy.eviction)
            capacity.on_recovered(run.capacity, recovered, policy.elastic)
            drain.on_recovered(run, recovered)
        for update in [o for o in outputs if isinstance(o, MtbfUpdate)]:  # M moved: re-derive T
            outputs += interval.rederive(run.interval, run.run_id, update, update.mtbf_s, policy.interval)
        # last: what each interruption implies is out before the launcher is told to go on,
        # with the capacity decision when it took nodes out that no ready spare covers
        outputs += [capacity.decide(run, o, outputs, policy) for o in outputs if isinstance(o, Interruption)]
    return outputs


def run_all(
    events: Iterable[Envelope], policy: CorePolicy, state: CoreState | None = None
) -> tuple[CoreState, list[Output]]:
    """Fold a sequence of events (replay, tests)."""
    state = state if state is not None else CoreState()
    outputs: list[Output] = []
    for event in events:
        state, out = step(state, event, policy)
        outputs += out
    return state, outputs


def _stragglers(run: RunState, event: StepTiming, policy: CorePolicy) -> list[Output]:
    """The straggler detectors on one step timing (the per-step rule, and the windowed one
    over the steps it completes: detectors/slowdown.py); a flag is diagnosed before any action
    (R2), and the flagged slowdowns are what goodput accounting charges the run for. On
    the coordinator, a diagnosis recommending eviction goes to the payback decision; a
    sharded run's other shards flag and diagnose, and forward both (and the clear) to shard
    0, which charges the slowdown and decides (:func:`_decide_straggler`)."""
    outputs: list[Output] = []
    judged: list[Derived | GroupComputeTimes] = []
    windowed: list[Derived] = []

    def groups(step: int, values: np.ndarray, reported: int, trigger: StepTiming) -> None:
        judged.extend(
            group_slowdown.on_local_step(
                run.groups, run, step, values, trigger, policy.group_slowdown, policy.diagnosis, reported
            )
        )
        windowed.extend(
            slowdown.on_step(
                run.slowdown, run, step, values, reported, trigger, policy.slowdown, policy.eviction
            )
        )

    per_step = straggler.observe_step(run.straggler, run, event, policy.straggler, groups)
    # the windowed detector's flags (issue 47) are diagnosed and decided as the per-step rule's
    for found in slowdown.absorb(run.slowdown, run, per_step) + windowed:
        outputs.append(found)
        if not isinstance(found, StragglerFlagged | StragglerCleared):
            continue
        mine: list[StragglerFlagged | StragglerDiagnosed | StragglerCleared] = [found]
        if isinstance(found, StragglerFlagged):
            mine.append(_in_flagged_group(run, diagnosis.diagnosed(run.health, run, found, policy.diagnosis)))
            outputs.append(mine[-1])
        for item in mine:  # shard 0 charges and decides; another shard forwards it there
            if run.coordinator:
                outputs += _decide_straggler(run, item, policy)
            else:
                outputs.append(Forward(item, "a shard's straggler: shard 0 charges it and decides"))
    for made in judged:  # a shard's summary goes to shard 0, which alone has the reference
        outputs += [Forward(made, "group step summary")] if isinstance(made, GroupComputeTimes) else []
    return outputs + _group_findings(run, [d for d in judged if not isinstance(d, GroupComputeTimes)])


def _decide_straggler(
    run: RunState, found: StragglerFlagged | StragglerDiagnosed | StragglerCleared, policy: CorePolicy
) -> list[Output]:
    """Shard 0's part of a straggler, its own or one a shard forwarded: the flag's slowdown
    charged to goodput and counted in the eviction's P, the diagnosis priced for eviction
    (decisions/eviction.py, once per diagnosis), the clear forgetting both."""
    if isinstance(found, StragglerFlagged):
        run.goodput.slowdowns[found.rank] = found.slowdown
        eviction.on_flagged(run.eviction, found, policy.eviction)
        return []
    if isinstance(found, StragglerDiagnosed):
        return list(
            eviction.on_diagnosed(run.eviction, found, run.racks.get(found.node), None, policy.eviction)
        )
    run.goodput.slowdowns.pop(found.rank, None)
    eviction.on_cleared(run.eviction, found.rank)
    return []


def _group_findings(run: RunState, found: list[Derived]) -> list[Output]:
    """Group slowdown flags and clears; a flagged group slows the whole job by its factor
    (goodput charges it like a straggler, keyed by a negative id: no rank's)."""
    for item in found:
        if isinstance(item, GroupSlowdownFlagged):
            run.goodput.slowdowns[_group_key(run, item.group)] = item.slowdown
        elif isinstance(item, GroupSlowdownCleared):
            run.goodput.slowdowns.pop(_group_key(run, item.group), None)
    return list(found)


def _group_key(run: RunState, group: str) -> int:
    names = [g.name for g in run.groups.groups]
    return -1 - (names.index(group) if group in names else len(names))


def _in_flagged_group(run: RunState, diagnosed: StragglerDiagnosed) -> StragglerDiagnosed:
    """A straggler whose node is in a group flagged ENVIRONMENTAL is the environment's too,
    whatever its own node says: alert facilities, never evict it node by node."""
    group = group_slowdown.flagged_environment(run.groups, diagnosed.node)
    if group is None or diagnosed.action == StragglerAction.ALERT_FACILITIES:
        return diagnosed
    reason = Reason(
        code=ReasonCode.ENVIRONMENTAL,
        text=f"{diagnosed.node} is in {group}, flagged slow as a whole and environmental: the "
        f"environment, not the node; alert facilities, do not evict (own diagnosis: "
        f"{diagnosed.reason.text[:300]})",
    )
    update = {
        "diagnosis": Diagnosis.ENVIRONMENTAL,
        "action": StragglerAction.ALERT_FACILITIES,
        "reason": reason,
    }
    return diagnosed.model_copy(update=update)


def _on_shard_event(run: RunState, event: Envelope, policy: CorePolicy) -> list[Output]:
    """A non-coordinator shard: per-rank detectors on its ranks (stragglers, their
    diagnosis); reports that need a run-level decision are forwarded to shard 0, and
    run-level outputs (interruptions, hang watchdog, checks, MTBF) are never made here."""
    if isinstance(event, RunStarted):
        _on_run_started(run, event, policy)  # its interruption bookkeeping belongs to shard 0
        return []
    if event.attempt > run.attempt:
        _begin_attempt(run, event, resumed_from_step=run.last_validated_step)
    rank = _rank(run, event)
    if isinstance(event, GpuHealth):
        diagnosis.observe_health(run.health, run, event, policy.diagnosis)
        hazard.observe(run.hazard, event.rank, event.node, event.ts, event.__dict__, policy.prediction)
    predicted = (
        _predictions(run, event, policy) if hazard.due(run.hazard, event.ts, policy.prediction) else []
    )
    if isinstance(event, GpuHealth):
        return predicted
    if isinstance(event, StepTiming) and rank is not None:
        _on_step(run, rank, event)
        return predicted + _stragglers(run, event, policy)
    return predicted + _on_shard_rest(run, rank, event, policy)


def _on_shard_rest(
    run: RunState, rank: RankState | None, event: Envelope, policy: CorePolicy
) -> list[Output]:
    """A shard's event other than a step timing or a GPU report (_on_shard_event)."""
    if isinstance(event, Heartbeat) and rank is not None:
        if rank.progress_ts is None:
            rank.progress_ts = event.ts
        # A hang stalls every rank: shard 0's watchdog sees it on its own ranks. What it
        # cannot see is this shard's phases, its evidence when no stack dump comes.
        return _forward_phase(run, rank, event, policy)
    if isinstance(event, StepStats):
        # A finite report is judged by shard 0 from its own ranks (the all-reduced grad
        # norm is the same on every rank); a non-finite one may be this rank's alone.
        return [Forward(event, "non-finite step stats")] if sdc.is_non_finite(event) else []
    return [Forward(event, f"{event.KIND} is decided by shard 0")]  # misrouted: still decided


def _predictions(run: RunState, event: Envelope, policy: CorePolicy) -> list[Output]:
    """Failure prediction's evaluation, when due (detectors/hazard.py): on shard 0 each prediction is
    decided at once (decisions/drain.py); a shard's goes out and to shard 0, which decides."""
    nodes = len(run.nodes) or max(1, len(run.ranks) // max(1, run.ranks_per_node))
    per_node_s = 1.0 / (baseline.mtbf_s(run.baseline, policy.baseline) * nodes)
    found = hazard.on_time(run.hazard, run.run_id, run.attempt, event.ts, per_node_s, policy.prediction)
    outputs: list[Output] = []
    for predicted in found:
        outputs.append(predicted)
        if run.coordinator:
            outputs += drain.on_predicted(run, predicted, policy)
        else:
            outputs.append(Forward(predicted, "failure prediction: shard 0 decides the drain"))
    return outputs


def _forward_phase(run: RunState, rank: RankState, event: Heartbeat, policy: CorePolicy) -> list[Output]:
    """A non-coordinator shard forwards the phase of a rank stalled past half the step
    timeout, once per phase and stall: shard 0 learns every rank's phase before it
    concludes a hang (one record per rank per hang), and nothing while the job progresses."""
    if not event.phase:
        return []
    if stall_s(rank, event.ts) < 0.5 * step_timeout_s(run, policy.hang):
        rank.forwarded_phase = ""
        return []
    if event.phase == rank.forwarded_phase:
        return []
    rank.forwarded_phase = event.phase
    return [Forward(event, "the phase of a stalled rank: hang evidence for shard 0")]


# --------------------------------------------------------------------------- handlers


def _rank(run: RunState, event: Envelope) -> RankState | None:
    if event.rank < 0:
        return None
    rank = run.ranks.get(event.rank)
    if rank is None:
        rank = run.ranks[event.rank] = RankState(node=event.node)
    if event.ts > rank.last_seen_ts:
        rank.last_seen_ts = event.ts
    return rank


def _on_run_started(run: RunState, event: RunStarted, policy: CorePolicy) -> list[Output]:
    outputs: list[Output] = []
    if event.attempt > run.attempt:  # the next world names its hosts
        outputs += _attempt_over(run, set(event.nodes), policy)
    opened = run.open_interruption
    if opened is not None and event.attempt > run.attempt and opened.launched_ts is None:
        opened.launched_ts = event.ts  # the restart's reschedule phase ends here
    capacity.on_run_started(run.capacity, run, event, policy.elastic)  # before the world changes
    run.world_size = event.world_size
    accounting.set_width(run.goodput, event.world_size, run.capacity.full_world)
    run.ranks_per_node = event.ranks_per_node
    run.nodes = tuple(event.nodes)
    run.racks = dict(event.racks)
    group_slowdown.on_run_started(run.groups, run, event, policy.group_slowdown)
    if event.attempt > run.attempt or run.phase == RunPhase.STARTING and not run.ranks:
        restart = event.attempt > run.attempt
        outputs += _begin_attempt(run, event, resumed_from_step=event.resumed_from_step)
        if restart:  # after: an undeclared restart's interruption is declared by _begin_attempt
            _resumes_from(run, event.resumed_from_step)
    return outputs


def _attempt_over(run: RunState, next_nodes: set[str] | None, policy: CorePolicy) -> list[Output]:
    """The next attempt's first event: a hang still collecting stacks, and a wait for the
    culprit of a lost peer, conclude now on the evidence in hand and the next world's hosts
    (None: not known). Its ranks are gone: no more stacks or exits will come."""
    outputs: list[Output] = []
    if run.pending_hang is not None:
        outputs += _maybe_conclude_hang(run, run.last_ts, policy, attempt_over=True)
    if run.pending_crash is not None:
        outputs += _conclude_peer_loss(run, next_nodes)
    return outputs


def _conclude_peer_loss(run: RunState, next_nodes: set[str] | None) -> list[Output]:
    """End the wait for a lost peer's culprit (detectors/peer_loss.py); a hang that opened
    it keeps its own verdict when no host was lost."""
    hang = peer_loss.hang_stands(run, next_nodes)
    if hang is None:
        return peer_loss.conclude(run, next_nodes, _interruption)
    run.pending_crash = None
    return [_hang_interruption(run, hang, *_hang_culprit(run, _answered_stacks(run)))]


def _begin_attempt(run: RunState, event: Envelope, resumed_from_step: int) -> list[Output]:
    outputs: list[Output] = []
    undeclared = event.attempt > run.attempt and run.phase in (RunPhase.TRAINING, RunPhase.STARTING)
    if undeclared and run.ranks:  # the attempt ended without an interruption of the core's
        outputs.append(_undeclared_restart(run, event))
    run.attempt = event.attempt
    run.ranks = {}
    run.pending_hang = None
    run.resumed_from_step = resumed_from_step
    run.job_step = resumed_from_step
    run.exit_step = -1
    run.restart_of = run.open_interruption.interruption_id if run.open_interruption is not None else ""
    run.move_to(RunPhase.STARTING)
    return outputs


def _undeclared_restart(run: RunState, event: Envelope) -> Interruption:
    """A new attempt started although the core declared no interruption: the planned
    restart of an eviction or a drain it issued (at a checkpoint boundary: a cost to
    account, not a failure; it stopped when its ranks did), or something only the launcher
    saw. Either way it is recorded, so the timeline stays complete. A smaller world growing
    back to full size is planned too (decisions/capacity.py)."""
    stopped = min(max((r.last_seen_ts for r in run.ranks.values()), default=event.ts), event.ts)
    # The launcher's record names the checkpoint the new attempt resumed from: its lost work
    # is counted back to that one (a planned stop is at a boundary: none), also when the
    # boundary's validation lands after the record (it runs in the background).
    resumed = event.resumed_from_step if type(event) is RunStarted else None

    def planned(
        cause: InterruptionCause, by: str, cause_id: str, culprit: int, reason: Reason
    ) -> Interruption:
        return _interruption(
            run, cause=cause, detected_by=by, cause_id=cause_id, at=stopped, culprit=culprit, reason=reason,
            checkpoint=resumed,
        )  # fmt: skip

    grown = capacity.take_grow(run.capacity)
    if grown:
        return planned(
            InterruptionCause.ELASTIC, "elastic", grown, -1, capacity.grow_reason(run, grown, event.attempt)
        )
    drained = drain.issued_in(run, run.attempt)
    if drained is not None:
        command_id, node = drained
        culprit = next((r for r, state in sorted(run.ranks.items()) if state.node == node), -1)
        text = (
            f"attempt {run.attempt} stopped at a checkpoint boundary to drain {node}, predicted to "
            f"fail; attempt {event.attempt} goes on without it"
        )
        made = planned(
            InterruptionCause.DRAIN,
            "prediction",
            command_id,
            culprit,
            Reason(code=ReasonCode.DRAIN, text=text),
        )
        run.drain.interruptions.add(made.interruption_id)
        return made
    evicted = eviction.issued_in(run.eviction, run.attempt)
    if evicted is not None:
        decision_id, rank = evicted
        text = (
            f"attempt {run.attempt} stopped at a checkpoint to evict rank {rank} "
            f"({node_of(run, rank) or 'unknown node'}); attempt {event.attempt} replaces it"
        )
        return planned(
            InterruptionCause.EVICTION,
            "eviction",
            decision_id,
            rank,
            Reason(code=ReasonCode.EVICTION, text=text),
        )
    return _interruption(
        run,
        cause=InterruptionCause.OPERATOR,
        detected_by="launcher",
        cause_id=event.event_id,
        at=event.ts,
        culprit=-1,
        reason=Reason(
            code=ReasonCode.INTERRUPTION,
            text=f"attempt {event.attempt} started while attempt {run.attempt} had no detected interruption",
        ),
        checkpoint=resumed,
    )


def _on_step(run: RunState, rank: RankState, event: StepTiming) -> list[Output]:
    rank.note_step(event.step, event.ts, event.compute_s, event.total_s)
    outputs: list[Output] = []
    if event.step > run.job_step:
        run.job_step = event.step
        run.step_times.append(event.total_s)  # one sample per job step
        if event.step > run.high_water_step:
            run.useful_steps += event.step - max(run.high_water_step, run.resumed_from_step)
            run.high_water_step = event.step
    if run.phase == RunPhase.STARTING:
        run.move_to(RunPhase.TRAINING)
        if run.open_interruption is not None:
            outputs.append(_recovered(run, run.open_interruption, event))
            run.open_interruption = None
    return outputs


def _recovered(run: RunState, opened: OpenInterruption, event: StepTiming) -> InterruptionRecovered:
    """The interruption is over: its restart phases, lost work and cost in GPU-hours."""
    restart_s = max(0.0, event.ts - opened.detected_ts)
    launched = opened.launched_ts if opened.launched_ts is not None else opened.detected_ts
    reschedule_s = min(restart_s, max(0.0, launched - opened.detected_ts))
    phases = {"detect": opened.detect_s, "reschedule": reschedule_s, "startup": restart_s - reschedule_s}
    lost_s = opened.lost_steps * (statistics.median(run.step_times) if run.step_times else 0.0)
    world = run.world_size or len(run.ranks)
    cost_s = opened.detect_s + restart_s + lost_s
    return InterruptionRecovered(
        event_id=derived_id("interruption_recovered", opened.interruption_id),
        run_id=run.run_id,
        attempt=run.attempt,
        rank=-1,
        node="",
        step=event.step,
        ts=event.ts,
        reason=Reason(
            code=ReasonCode.RESUMED,
            text=f"attempt {run.attempt} completed step {event.step} {restart_s:.0f} s after the "
            f"detection; {opened.lost_steps} steps ({lost_s:.0f} s) to re-do; cost "
            f"{world * cost_s / 3600:,.1f} GPU-hours",
        ),
        caused_by=[opened.event_id, event.event_id],
        interruption_id=opened.interruption_id,
        restart_s=restart_s,
        resumed_attempt=run.attempt,
        phases=phases,
        lost_s=lost_s,
        lost_steps=opened.lost_steps,
        resumed_from_step=opened.checkpoint_step,
        world_size=world,
        gpu_hours=world * cost_s / 3600,
    )


def _on_heartbeat(run: RunState, rank: RankState, event: Heartbeat, policy: CorePolicy) -> list[Output]:
    if rank.progress_ts is None:  # first sign of life in this attempt starts its clock
        rank.progress_ts = event.ts
    if event.phase and event.ts >= rank.phase_ts:
        rank.phase, rank.phase_ts = event.phase, event.ts
    if run.shard_ranks and (owned := run.owned()) is not None and event.rank not in owned:
        return []  # another shard's rank, forwarded for its phase: its own shard watches it
    timeout = is_hung(run, rank, event.ts, policy.hang)
    if timeout is None:
        return []
    stalled = stall_s(rank, event.ts)
    # Run-level: the rank whose heartbeat noticed the stall is only a witness (in a hang every
    # rank stalls); naming it as the record's rank would contradict the interruption that
    # names the culprit from the evidence. The text names it, labelled as the witness.
    hang = HangDetected(
        event_id=derived_id("hang_detected", event.event_id),
        run_id=run.run_id,
        attempt=run.attempt,
        rank=-1,
        node="",
        step=run.job_step,
        ts=event.ts,
        reason=Reason(
            code=ReasonCode.NO_PROGRESS,
            text=f"the job is alive but no step completed for {stalled:.1f}s "
            f"(timeout {timeout:.1f}s) after step {run.job_step}; the culprit is named from "
            "the ranks' stack dumps, else their last reported phases "
            f"(witness: rank {event.rank}, whose heartbeat showed the stall first; every rank's "
            "does in a hang, so it says nothing about the cause)",
        ),
        caused_by=[event.event_id],
        last_step=run.job_step,
        stalled_s=stalled,
        timeout_s=timeout,
    )
    run.pending_hang = PendingHang(hang.event_id, event.ts, run.job_step, event.rank, stalled)
    return [hang, abort_for(run, hang, stack_dump=True)]


def _on_exit(run: RunState, rank: RankState, event: RankExit) -> list[Output]:
    run.exit_step = max(run.exit_step, event.step, event.job_step)
    rank.exited = True
    rank.requested_exit = rank.requested_exit or event.requested
    if event.stack_signature:  # the launcher's report of the same exit may come without it
        rank.stack_signature = event.stack_signature
    lost_peer = event.peer_lost and not event.requested and run.no_checkpoint_attempt != run.attempt
    if run.pending_hang is not None and lost_peer:
        # A rank that died of a lost peer while a hang's stacks are collected: a host lost
        # whole looks like a hang to the watchdog when its ranks stop before the others'
        # collectives fail (a loaded machine). Kept: _maybe_conclude_hang may need it.
        peer_loss.on_exit(run, event)
    if _died_before_the_hang(run, rank, event, lost_peer):
        run.pending_hang = None  # the hang's Abort is out: the crash needs no second one
        late = "; its report came after the stall it caused was seen as a hang"
        return [_crash(run, event, late)]
    if (
        run.phase in (RunPhase.INTERRUPTED, RunPhase.FINISHED)
        or run.pending_hang is not None
        or event.requested
    ):
        # teardown of an attempt already being handled, or a second report of an exit
        # (the rank's own, then its launcher's) after the run finished
        return []
    if event.exit_code == 0 and event.signal is None:
        if run.world_size and sum(r.exited for r in run.ranks.values()) >= run.world_size:
            run.move_to(RunPhase.FINISHED)
        return []
    if lost_peer:  # evidence about another rank
        peer_loss.on_exit(run, event)
        return []
    how = f"signal {event.signal}" if event.signal is not None else f"exit code {event.exit_code}"
    if run.no_checkpoint_attempt == run.attempt:  # the ranks had nothing valid to resume from
        return [
            _interruption(
                run,
                cause=InterruptionCause.CRASH,
                detected_by="rank_exit",
                cause_id=event.event_id,
                at=event.ts,
                culprit=-1,
                reason=Reason(
                    code=ReasonCode.CHECKPOINT_REJECTED,
                    text=f"rank {event.rank} on {event.node} ended ({how}): no valid checkpoint was "
                    "left to resume from; a checkpoint fault, no node is quarantined",
                ),
            )
        ]
    interruption = _crash(run, event)
    return [interruption, abort_for(run, interruption, stack_dump=False)]


def _crash(run: RunState, event: RankExit, why: str = "") -> Interruption:
    """Rank `event.rank` died on its own: the crash that interrupted the attempt."""
    how = f"signal {event.signal}" if event.signal is not None else f"exit code {event.exit_code}"
    return _interruption(
        run,
        cause=InterruptionCause.CRASH,
        detected_by="rank_exit",
        cause_id=event.event_id,
        at=event.ts,
        culprit=event.rank,
        reason=Reason(
            code=ReasonCode.RANK_EXITED,
            text=f"rank {event.rank} on {event.node} died ({how}) after step {completed_step(run)}{why}",
        ),
    )


def _died_before_the_hang(run: RunState, rank: RankState, event: RankExit, lost_peer: bool) -> bool:
    """A rank's own death (not requested, not of a lost peer, not a clean end) reported while
    a hang's stacks are collected, that came before the stall reached the length at which the
    watchdog fired: the crash was the stall's cause, its report merely late (a loaded
    launcher or broker). Measured on the rank's own clock (its exit against its last step:
    the rank and its launcher share a host), so skew between hosts cannot move it. A death
    after that (a collective's own timeout ending the waiting ranks) is the hang's consequence."""
    pending = run.pending_hang
    if pending is None or event.requested or lost_peer or run.no_checkpoint_attempt == run.attempt:
        return False
    if event.exit_code == 0 and event.signal is None:
        return False
    return rank.progress_ts is not None and event.ts - rank.progress_ts <= pending.stalled_s


def _roll_back(run: RunState, found: SdcMismatch, found_now: list[SdcMismatch]) -> list[Output]:
    """An SDC mismatch: roll back to the clean ancestor (or page that none is left), behind
    every device found by the same event (`found_now`). The rollback ends the attempt, so
    it is an interruption, its lost work counted back to the checkpoint it returns to."""
    bound = min((rollback.bound_for(run.sdc, f) for f in found_now), key=lambda b: b.step)
    decided: list[Output] = list(rollback.on_mismatch(run.rollback, found, bound))
    target = next((d for d in decided if isinstance(d, Rollback)), None)
    if target is None or run.phase in (RunPhase.INTERRUPTED, RunPhase.FINISHED):
        return decided
    interruption = _interruption(
        run,
        cause=InterruptionCause.SDC,
        detected_by="sdc",
        cause_id=found.event_id,
        at=found.ts,
        culprit=found.rank,
        reason=target.reason,
    )
    lost = lost_steps(completed_step(run), target.checkpoint_step)
    if run.open_interruption is not None:
        run.open_interruption.lost_steps = lost
        run.open_interruption.checkpoint_step = target.checkpoint_step
    update = {"lost_steps": lost, "last_checkpoint_step": target.checkpoint_step, "node": found.node}
    return [interruption.model_copy(update=update), *decided]


def _maybe_conclude_hang(
    run: RunState, now_ts: float, policy: CorePolicy, attempt_over: bool = False
) -> list[Output]:
    """The hang's verdict once its stack window closes (or the next attempt started:
    `attempt_over`), from the stacks and phases in hand."""
    pending = run.pending_hang
    assert pending is not None
    expected = run.world_size or len(run.ranks)
    answered = _answered_stacks(run)
    if not attempt_over and not window_closed(pending, answered, expected, now_ts, policy.hang):
        return []
    culprit, reason = _hang_culprit(run, answered)
    run.pending_hang = None
    if culprit < 0 and answered and peer_loss.silent_hosts(run, None):
        # The stacks name nobody, and while other hosts' ranks answered, one host's ranks all
        # went silent: a lost host, seen first as a hang. The peer-loss wait names it, as it
        # would have without the hang: when the next world forms without it or its window
        # ends (a launcher slow to report is in the next world: not a lost host, and the
        # hang's verdict stands).
        peer_loss.after_hang(run, pending)
        return []
    return [_hang_interruption(run, pending, culprit, reason)]


def _answered_stacks(run: RunState) -> dict[int, str]:
    """The stack signature of each rank that exited (its answer to the hang's dump)."""
    return {r: s.stack_signature for r, s in run.ranks.items() if s.exited}


def _hang_culprit(run: RunState, answered: dict[int, str]) -> tuple[int, Reason]:
    """The hung rank named by the `answered` stacks, else the ranks' phases."""
    expected = run.world_size or len(run.ranks)
    return hang_culprit(answered, {r: s.phase for r, s in run.ranks.items() if s.phase}, expected)


def _hang_interruption(run: RunState, pending: PendingHang, culprit: int, reason: Reason) -> Interruption:
    return _interruption(
        run,
        cause=InterruptionCause.HANG,
        detected_by="progress_watchdog",
        cause_id=pending.event_id,
        at=pending.detected_ts,
        culprit=culprit,
        reason=reason,
        detect_s=pending.stalled_s,
    )


# --------------------------------------------------------------------------- outputs


def _interruption(
    run: RunState,
    *,
    cause: InterruptionCause,
    detected_by: str,
    cause_id: str,
    at: float,
    culprit: int,
    reason: Reason,
    detect_s: float = 0.0,
    checkpoint: int | None = None,
) -> Interruption:
    """Declare an interruption (id derived from the event that revealed it). Its step is
    the newest any rank completed; its lost steps, those after the checkpoint it resumes
    from: `checkpoint` when known (the next attempt started), else the newest the core knows."""
    if checkpoint is None:
        checkpoint = max(run.last_validated_step, run.resumed_from_step)
    completed = completed_step(run)
    lost = lost_steps(completed, checkpoint)
    event_id = derived_id("interruption", cause_id)
    run.pending_crash = None  # whatever ended the attempt, the wait for a culprit is over
    run.move_to(RunPhase.INTERRUPTED)
    run.interruptions += 1
    step_s = statistics.median(run.step_times) if run.step_times else 0.0
    run.open_interruption = OpenInterruption(
        event_id, event_id, at, detect_s, lost, step=completed, checkpoint_step=checkpoint, step_s=step_s
    )
    return Interruption(
        event_id=event_id,
        run_id=run.run_id,
        attempt=run.attempt,
        rank=culprit,
        node=node_of(run, culprit),
        step=completed,
        ts=at,
        reason=reason,
        caused_by=[cause_id],
        interruption_id=event_id,
        cause=cause,
        detected_by=detected_by,
        lost_steps=lost,
        last_checkpoint_step=checkpoint,
    )


def lost_steps(completed: int, checkpoint: int) -> int:
    """The steps re-done after resuming from `checkpoint` (-1: none, start over)."""
    return max(0, completed - checkpoint if checkpoint >= 0 else completed + 1)


def _resumes_from(run: RunState, checkpoint: int) -> None:
    """The open interruption's restart resumes from `checkpoint` (the launcher's choice, or
    the one left after a rejection): its lost work is counted back to it, not to the newest
    validated checkpoint the core knew at detection (a validation can land after the crash
    that ends its attempt), so that the recovery and the goodput charge what was re-done."""
    opened = run.open_interruption
    if opened is None or opened.step < 0 or checkpoint == opened.checkpoint_step:
        return
    lost = lost_steps(opened.step, checkpoint)
    accounting.recharge_lost(run.goodput, opened.detected_ts, opened.step_s, opened.lost_steps, lost)
    opened.lost_steps, opened.checkpoint_step = lost, checkpoint


def completed_step(run: RunState) -> int:
    """The newest step any rank completed in this attempt: the StepTimings seen, or what
    the exits report (the launcher reads the ranks' progress files) when newer."""
    return max(run.job_step, run.exit_step)


# --------------------------------------------------------------------------- views


def step_time_summary(run: RunState) -> tuple[float, float, int]:
    """(p50 total step seconds, max total step seconds, slowest rank by compute time)
    over the ranks' latest steps; the slowest rank is a value, never a metric label."""
    # Refreshed every second over up to 16,384 ranks: tuples compared in C, no key function.
    live = [(s.compute_s, -r, s.total_s) for r, s in run.ranks.items() if s.last_step >= 0]
    if not live:
        return 0.0, 0.0, -1
    totals = [total for _, _, total in live]
    slowest = -max(live)[1]  # the most compute time; of equals, the lowest rank
    return statistics.median(totals), max(totals), slowest


def goodput(run: RunState) -> float:
    """The run's measured goodput over everything the accounting keeps (up to its longest
    window, 7 days by default): (1 - overhead) x ideal/actual (processors/core/accounting/goodput.py)."""
    return accounting.total(run.goodput).goodput
