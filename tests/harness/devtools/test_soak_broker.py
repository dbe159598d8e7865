"""The chaos soak, shortened for CI (issue 7 scenario 6): simulated runs through two
processor workers and the archive writer at 8 kills a minute, then the oracle over every
run: 75 s of three runs. The full soak is one command: `trainguard soak --minutes 5`.

Seed 1 plans worker, archive, rank kills in the first 13 s, then again, so every victim
kind is hit while the runs still have half a minute to go."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.devtools.soak import run_soak
from harness.devtools.soak_plan import SoakConfig, Victim
from harness.devtools.soak_report import markdown

pytestmark = pytest.mark.broker


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("minutes", "runs"), [(1.25, 3)], ids=lambda v: str(v))
def test_random_kills_of_workers_the_archive_writer_and_ranks_lose_nothing(
    bootstrap: str, tmp_path: Path, minutes: float, runs: int
) -> None:
    config = SoakConfig(minutes=minutes, kill_rate_per_min=8, workers=2, runs=runs, seed=1)
    report = run_soak(config, bootstrap, tmp_path / "soak")
    text = markdown(report)
    assert report.ok, text
    for victim in Victim:
        assert report.kills[victim.value] >= 1, text
    for victim in (Victim.WORKER, Victim.ARCHIVE):  # every killed process came back
        assert report.restarts[victim.value] == report.kills[victim.value], text
    assert report.skipped == 0, text
    for run in report.runs:
        assert run.lost == 0 and run.survived, text
    # The generated faults struck too (a run set back by restarts may not reach its hang).
    assert sum(run.faults.get("hang", 0) for run in report.runs) >= 1, text
    assert sum(run.executions for run in report.runs) > 0, text  # commands flowed and were acked
