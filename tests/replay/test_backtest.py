"""The backtest: its cost model rule by rule, and two policies on the recorded demo run
(tests/replay/conftest.py), whose one hand-checkable difference is the thermal straggler
evicted 50 steps sooner under the candidate."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness.devtools.stack import builtin_policy
from trainguard.processors.core import CorePolicy
from trainguard.processors.core.policy import load_policy
from trainguard.replay import cost_model, parallel
from trainguard.replay.backtest import backtest
from trainguard.replay.cost_model import RunFacts
from trainguard.replay.log import Recording
from trainguard.replay.replay import Replayed
from trainguard.replay.report import CHARTS, write_report
from trainguard.schemas import EvictionDecision, EvictRank, IntervalUpdate, Reason, ReasonCode, encode

from .conftest import Recorded

FACTS = RunFacts(world_size=1024, start_ts=0.0, end_ts=36_000.0, step_s=2.0, checkpoint_s=30.0,
                 restart_s=600.0, mtbf_s=49.6 * 3600)  # fmt: skip


def test_an_eviction_one_hour_sooner_saves_the_straggle_of_that_hour() -> None:
    # 20% straggler cost (slowdown 1.25), both policies evict: the restart cancels out.
    saving = cost_model.eviction_saving(
        FACTS, 0.2, baseline_at=7200.0, candidate_at=3600.0, straggle_end=36_000.0
    )
    assert saving == pytest.approx(0.2 * 3600)
    # Evicting where the baseline never does: the rest of the straggle minus one restart.
    alone = cost_model.eviction_saving(
        FACTS, 0.2, baseline_at=None, candidate_at=3600.0, straggle_end=36_000.0
    )
    assert alone == pytest.approx(0.2 * (36_000 - 3600) - 600)
    # A straggle that cleared on its own before the eviction: the eviction only costs R.
    late = cost_model.eviction_saving(
        FACTS, 0.2, baseline_at=None, candidate_at=20_000.0, straggle_end=10_000.0
    )
    assert late == pytest.approx(-600)


def test_the_interval_saving_is_the_seeds_overhead_difference_over_the_run() -> None:
    reason = Reason(code=ReasonCode.CHECKPOINT_INTERVAL, text="T*")
    young = (2 * FACTS.checkpoint_s * FACTS.mtbf_s) ** 0.5  # T* = sqrt(2CM), 3,280 s
    update = IntervalUpdate(
        event_id="u", run_id="r", attempt=0, rank=-1, node="", step=0, ts=0.0, reason=reason,
        mtbf_s=FACTS.mtbf_s, checkpoint_cost_s=30.0, interval_s=young,
    )  # fmt: skip
    fixed = cost_model.interval_schedule([], 1800.0)
    auto = cost_model.interval_schedule([update], 1800.0)
    saving = cost_model.interval_saving(FACTS, fixed, auto)
    rate = cost_model.overhead_rate
    assert saving == pytest.approx((rate(FACTS, 1800) - rate(FACTS, young)) * 36_000)
    assert saving > 0  # the optimum is cheaper than 30 minutes at this MTBF
    assert cost_model.interval_saving(FACTS, auto, auto) == 0


def test_detection_and_rollback_savings() -> None:
    assert cost_model.detection_saving(100.0, 97.5) == 2.5
    assert cost_model.detection_saving(None, 97.5) == 0.0
    assert cost_model.rollback_saving(FACTS, baseline_step=900, candidate_step=1000) == 200.0


STRICT = {
    "version": 1,
    "hang": {"min_samples": 20, "floor_s": 2.0, "default_timeout_s": 30.0, "startup_timeout_s": 60.0,
             "stack_collect_s": 5.0},
    "straggler": {"consecutive_steps": 50},
    "slowdown": {"block_steps": 16},  # the windowed detector judges every 16 steps, not 32: sooner
}  # fmt: skip


@pytest.fixture
def strict_policy(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(STRICT))
    return path


@pytest.mark.broker
def test_two_policies_on_a_recorded_run_price_the_sooner_eviction(
    recorded: Recorded, strict_policy: Path, tmp_path: Path
) -> None:
    demo = builtin_policy("demo")
    result = backtest(
        recorded.recording, [("demo", load_policy(str(demo))), ("strict", load_policy(str(strict_policy)))]
    )
    base, strict = result.runs
    assert base.goodput is not None and 0 < base.goodput < 1
    evictions = [r for r in strict.rows if r.decision == "evict"]
    (row,) = evictions
    assert row.baseline is not None and row.candidate is not None and row.candidate.ts < row.baseline.ts

    # By hand: both evict rank 5, so the restarts cancel; the candidate saves the
    # straggler's throughput loss for the time it evicts sooner.
    def evicted(run_derived: list, commands: list) -> tuple[float, float]:
        (cmd,) = [c for c in commands if isinstance(c, EvictRank)]
        cost = max(
            d.straggler_cost for d in run_derived if isinstance(d, EvictionDecision) and d.rank == cmd.rank
        )
        return cmd.issued_ts, cost

    (b_ts, b_cost), (c_ts, c_cost) = (
        evicted(r.replayed.derived, r.replayed.commands) for r in (base, strict)
    )
    assert row.subject == "rank 5" and (row.baseline.ts, row.candidate.ts) == (b_ts, c_ts)
    assert row.saving_s == pytest.approx(max(b_cost, c_cost) * (b_ts - c_ts))
    assert 0 < row.saving_s < 60  # seconds of a 1.5-minute demo
    assert strict.goodput == pytest.approx(base.goodput + strict.saving_s / result.facts.elapsed_s)
    assert strict.saving_s == pytest.approx(sum(r.saving_s for r in strict.rows if r.saving_s is not None))

    report = write_report(result, tmp_path / "report")
    text = report.read_text()
    assert "| evict | rank 5 |" in text and "## Cost model" in text
    for name in CHARTS:
        png = (tmp_path / "report" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000 and f"]({name})" in text


@pytest.mark.broker
def test_the_baseline_against_itself_differs_nowhere(recorded: Recorded) -> None:
    demo = load_policy(str(builtin_policy("demo")))
    result = backtest(recorded.recording, [("a", demo), ("b", demo)])
    assert result.runs[1].rows == [] and result.runs[1].saving_s == 0
    assert result.runs[1].goodput == result.runs[0].goodput


@pytest.mark.broker
def test_the_cli_prints_the_table_and_writes_the_report(
    recorded: Recorded, strict_policy: Path, tmp_path: Path
) -> None:
    from trainguard.cli import app

    prefix = recorded.names.telemetry.removesuffix("trainguard.telemetry")
    args = [
        "--run-id",
        recorded.recording.run_id,
        "--bootstrap",
        recorded.bootstrap,
        "--topic-prefix",
        prefix,
    ]
    out = CliRunner().invoke(app, ["replay", *args, "--policy", str(builtin_policy("demo"))])
    assert out.exit_code == 0, out.output
    assert "reproduces every recorded decision" in out.output
    out = CliRunner().invoke(app, ["replay", *args, "--policy", str(strict_policy)])
    assert out.exit_code == 1 and "straggler_flagged" in out.output
    # The backtest reads the run from the archive: no broker named.
    archived = [*args[:2], "--topic-prefix", prefix, "--archive", str(recorded.archive)]
    report = tmp_path / "bt"
    out = CliRunner().invoke(app, ["backtest", *archived, "--policy", str(builtin_policy("demo")),
                                   "--policy", str(strict_policy), "--report", str(report)])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "strict against demo" in out.output and "evict" in out.output
    assert (report / "report.md").exists() and all((report / name).exists() for name in CHARTS)
    out = CliRunner().invoke(app, ["replay", "--run-id", "no-such-run", "--archive", str(recorded.archive)])
    assert out.exit_code == 2 and "no telemetry of run no-such-run in the archive" in out.output


@pytest.mark.broker
def test_policies_spread_over_processes_decide_as_in_one(recorded: Recorded, strict_policy: Path) -> None:
    """replay/parallel.py: three policies over two processes (the second forked) decide
    and price exactly as in one process; the log's facts are the same."""
    demo, strict = load_policy(str(builtin_policy("demo"))), load_policy(str(strict_policy))
    policies = [("demo", demo), ("strict", strict), ("demo again", demo)]
    spread, alone = (
        backtest(recorded.recording, policies, processes=2),
        backtest(recorded.recording, policies, processes=1),
    )
    assert spread.facts == alone.facts and list(spread.log.timings()) == list(alone.log.timings())
    for mine, theirs in zip(spread.runs, alone.runs, strict=True):
        decisions = [encode(d) for d in (*mine.replayed.derived, *mine.replayed.commands)]
        assert decisions == [encode(d) for d in (*theirs.replayed.derived, *theirs.replayed.commands)]
        assert (mine.rows, mine.goodput, mine.replayed.events) == (
            theirs.rows,
            theirs.goodput,
            theirs.replayed.events,
        )
    assert spread.runs[1].rows and not spread.runs[2].rows


def test_a_failing_child_fails_the_backtest_with_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A share that fails in its child raises here, with the child's error; a child that
    dies without an answer, with its exit code; and no child outlives a failure."""
    failure: list[Callable[[], None]] = []

    def replay_all(recording: Recording, policies: list, *args: object, **kwargs: object) -> list:
        if "observe" not in kwargs:  # the child's share (the parent's share observes the log)
            failure[0]()
        elif len(failure) > 1:  # the parent's own share
            failure[1]()
        return [Replayed() for _ in policies]

    def refuse() -> None:
        raise ValueError("the core could not take this policy")

    monkeypatch.setattr(parallel, "replay_all", replay_all)
    policies, observe = [CorePolicy(), CorePolicy()], lambda _: None
    failure[:] = [refuse]
    with pytest.raises(
        RuntimeError, match=r"(?s)policies \[1\].*ValueError: the core could not take this policy"
    ):
        parallel.replay_spread(Recording("r"), policies, observe=observe, processes=2)
    failure[:] = [lambda: os._exit(3)]
    with pytest.raises(RuntimeError, match=r"policies \[1\].*exited with code 3 before it answered"):
        parallel.replay_spread(Recording("r"), policies, observe=observe, processes=2)
    # This process failing while its child still works: the child is stopped, not left.
    failure[:] = [lambda: time.sleep(60), refuse]
    started = time.monotonic()
    with pytest.raises(ValueError, match="could not take"):
        parallel.replay_spread(Recording("r"), policies, observe=observe, processes=2)
    assert time.monotonic() - started < 30 and not multiprocessing.active_children()
