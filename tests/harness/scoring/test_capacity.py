"""Elastic training scored (harness/scoring/capacity.py, issue 45): the library's node-lost runs
(elastic-1k, elastic-16k: a replacement 30 minutes away) through the pure core, waiting
and shrinking, with their goodput; and the capacity decisions a live core makes replayed
from its records, decision for decision."""

from __future__ import annotations

import pytest

from harness.devtools.stack import builtin_policy
from harness.scoring.capacity import compare_capacity, elastic_off
from harness.scoring.evaluate import closed_loop, score_loop
from trainguard.processors.core.policy import load_policy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.rank.shipper import pack
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.producers.simulator.cluster import CommandRefused
from trainguard.replay.backtest import backtest
from trainguard.replay.log import Recording
from trainguard.replay.replay import REPLAY_SECRET, compare, replay, replayed_decisions
from trainguard.schemas import Command, Derived, InterruptionDecided, RunStarted, decode_batch, encode

from ...simulated import gc_paused
from ...variants import with_slow

POLICY = load_policy(str(builtin_policy("evaluate")))
LIBRARY = Scenario.library()


def check(name: str) -> None:
    """Both runs finish clean (the crash found on its node, nothing else, no harm); the
    wait idles ~30 minutes, the shrink trains on at W' and its goodput is far higher."""
    scenario = LIBRARY[name]
    w = scenario.world_size
    with gc_paused():
        result = compare_capacity(scenario, POLICY)
    wait, shrink = result.wait, result.shrink
    for run in (wait, shrink):
        assert run.finished and not run.failed, (run.policy, run.score.violations, run.score.false_alarms)
        assert [d.detector for d in run.score.detections] == ["crash"]
        (decision,) = run.decisions
        assert f"{w - 8:,} of {w:,} ranks" in decision and "a replacement expected in 1,800 s" in decision
    assert wait.decisions[0].startswith("wait: wait: elastic training is off")
    assert shrink.decisions[0].startswith("shrink: shrink (")
    assert wait.restart_s > 1800 and wait.narrow_s == 0
    assert shrink.restart_s < 200 and 0 < shrink.narrow_s < 1900 * 8 / w
    assert shrink.elapsed_s < wait.elapsed_s - 1500  # the same steps, ~30 minutes sooner
    assert result.gain > 0.3 and shrink.goodput > 0.9
    # what each run lost to the crash, by the harms' accounting: the wait's ~30 minutes
    (wait_lost,) = wait.score.harms.lost_s.values()
    (shrink_lost,) = shrink.score.harms.lost_s.values()
    assert wait_lost > 1800 and shrink_lost < 400


#: The 16,384-rank comparison takes minutes of CPU: a slow variant (tests/variants.py).
SLOW = [pytest.param("elastic-16k", marks=pytest.mark.timeout(1800))]


@pytest.mark.parametrize("name", with_slow(["elastic-1k"], SLOW))
def test_shrinking_beats_waiting_for_the_replacement(name: str) -> None:
    check(name)


def test_elastic_16k_decides_to_shrink_at_scale() -> None:
    """The suite's look at 16,384 ranks (the whole comparison is the slow variant above):
    the first 12 steps, the loss at step 10 shrunk to 16,376 ranks at once, nothing else."""
    scenario = LIBRARY["elastic-16k"].model_copy(update={"steps": 12})
    loop = closed_loop(scenario, POLICY)
    score = score_loop(scenario, loop)
    assert not score.failed and [d.detector for d in score.detections] == ["crash"]
    (decided,) = [o for o in loop.outputs if isinstance(o, InterruptionDecided) and o.capacity]
    assert (decided.capacity, decided.world_size) == ("shrink", 16_376)
    assert "16,376 of 16,384 ranks (99.95%)" in decided.reason.text
    assert loop.cluster.world_size == 16_376 and loop.cluster.phase.value == "finished"


#: A small node-lost run for the replay: 64 ranks, the replacement 10 minutes away.
SMALL = Scenario.parse(
    dict(
        name="elastic-small",
        world_size=64,
        ranks_per_node=8,
        nodes_per_rack=4,
        step_time_s=2.0,
        steps=500,
        checkpoint_every=25,
        restart_delay_s=10.0,
        heartbeat_interval_s=5.0,
        replacement_s=600.0,
        noise={"gc_pause_prob": 0.05},
        faults=[{"kind": "crash", "rank": 13, "at_step": 60}],
    )
)


_LIVE: dict[tuple[str, bool], tuple[Recording, list[Derived | Command]]] = {}


def live(scenario: Scenario, elastic: bool = True) -> tuple[Recording, list[Derived | Command]]:
    """The run as the live processor decides it (elastic training on or off): the shipper's
    records, one flush a simulated second, folded by a CoreDriver, its commands executed by
    the simulated job; its decisions as the log holds them (derived events, then commands)."""
    if (scenario.name, elastic) in _LIVE:
        return _LIVE[scenario.name, elastic]
    run_id = "live-elastic"
    cluster = SimulatedCluster(scenario, 1_000.0, run_id=run_id, id_prefix="l")
    driver = CoreDriver(POLICY if elastic else elastic_off(POLICY), REPLAY_SECRET)
    recording, seq, t = Recording(run_id), 0, 1_000.0
    while not cluster.done and t < 10_000.0:
        t += 1.0
        events = cluster.advance(t)
        while events:
            records, events = pack(events, run_id, scenario.world_size, 0, "p", seq), []
            for record in records:
                seq = record.seq + 1
                recording.records.append((0, len(recording.records), record.value))
                result = driver.handle(record.value)
                recording.derived += result.derived
                recording.commands += result.commands
                for command in result.commands:
                    try:
                        events += cluster.apply(command).events
                    except CommandRefused:
                        continue
    assert cluster.phase.value == "finished"
    _LIVE[scenario.name, elastic] = recording, [*recording.derived, *recording.commands]
    return _LIVE[scenario.name, elastic]


def test_a_replay_of_the_live_run_makes_the_same_capacity_decisions() -> None:
    recording, decided = live(SMALL)
    replayed = replayed_decisions(replay(recording, POLICY))
    assert compare(decided, replayed).identical
    assert [encode(d) for d in replayed] == [encode(d) for d in decided]
    capacity = [d for d in decided if isinstance(d, InterruptionDecided) and d.capacity]
    assert [(d.capacity, d.world_size) for d in capacity] == [("shrink", 56)]
    kinds = [d.KIND for d in decided]
    assert kinds.count("interruption") == 2  # the loss, and the planned grow-back
    assert any(isinstance(d, Derived) and d.KIND == "goodput_report" and d.narrow_s > 0 for d in decided)  # type: ignore[attr-defined]


def test_the_shrunk_and_grown_worlds_are_announced() -> None:
    recording, _ = live(SMALL)
    worlds = [
        e.world_size
        for _, _, value in recording.records
        for e in decode_batch(value, world_size=64).events
        if isinstance(e, RunStarted)
    ]
    assert worlds == [64, 56, 64]


def test_a_backtest_prices_shrinking_a_loss_the_recording_waited_out() -> None:
    """The run recorded with elastic training off (it waited ~10 minutes for the replacement)
    backtested against elastic on: one capacity row, wait against shrink to 56 ranks, the
    saving the rule's terms give with the wait the recording measured; and the other way
    round on the run recorded shrinking."""
    waited, _ = live(SMALL, elastic=False)
    result = backtest(waited, [("wait", elastic_off(POLICY)), ("shrink", POLICY)], processes=1)
    shrink = result.runs[1]
    (row,) = [r for r in shrink.rows if r.decision == "capacity"]
    assert row.baseline is not None and row.candidate is not None
    assert row.baseline.text.startswith("wait: ") and row.candidate.text.startswith("shrink: ")
    # the ~610 s wait measured; R the policy's 600 s (no other restart in the recording): the
    # replacement came ~10 s after the loss, shrinking would still have gone on at once
    assert row.rule.startswith("capacity: waited 6") and "(R 600 s)" in row.rule
    assert row.saving_s is not None and 0 < row.saving_s < 610, row.rule
    assert shrink.goodput is not None and result.baseline.goodput is not None
    assert shrink.goodput > result.baseline.goodput

    shrank, _ = live(SMALL)
    back = backtest(shrank, [("shrink", POLICY), ("wait", elastic_off(POLICY))], processes=1)
    (row,) = [r for r in back.runs[1].rows if r.decision == "capacity"]
    assert row.saving_s is not None and row.saving_s < -300, row.rule  # waiting loses the ~10 minutes
