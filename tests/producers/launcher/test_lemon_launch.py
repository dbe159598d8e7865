"""Issue 46's acceptance for lemon nodes: "a node with three failures across runs in the
archive is kept out of the next `trainguard launch` with the reason, and paged once".

The archive is real: three past runs on node-0000 and node-0001, each simulated and driven
by the pure policy core, archived by the archive's own store (tests/sinks/lemon_runs.py):
node-0001 crashed in all three (a lemon), node-0000 in two (not one). Then the README's
example (docs/examples/train_tiny.py) on 4 real gloo ranks, 2 per modelled node, under
`trainguard launch --archive`, supervised through the real broker by a real processor:
node-0001 is kept out (its ranks go to spare-0000), the console and the NodeExcluded say
why, and the core pages once, for that node, though the launch is run twice (a relaunch of
the same run, without the archive: its journal keeps the node out and sends the same
NodeExcluded again). Across hosts, the agent of a lemon host refuses to join, with the
reason, and the run's shared quarantine list names it. In process: every node a lemon, the
rule turned off, an archive that cannot be read.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.producers.launcher.config import LauncherConfig, python_command
from trainguard.producers.launcher.launcher import Launcher
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine
from trainguard.producers.rank.agent import MemorySink
from trainguard.schemas import NodeExcluded, Page, ReasonCode, RunStarted

from ...pipeline import Processor, running_processor
from ...sinks.lemon_runs import LEMON, TWICE, past_runs, write_lemon_archive
from ..supervised_runs import decisions, launch_env, telemetry

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
POLICY = ROOT / "tests" / "producers" / "supervised_policy.yaml"
SECRET = "lemon-launch-test-secret-0123456789"


@pytest.fixture(scope="module")
def now() -> float:
    return time.time()


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory, now: float) -> Path:
    return write_lemon_archive(tmp_path_factory.mktemp("lemons") / "archive", now)


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def expected_reason(now: float) -> str:
    """The rule's sentence for node-0001, from the faults the past runs fired."""
    crashes = [
        f"crash in {run.run_id} on {time.strftime('%Y-%m-%d', time.gmtime(f.ts))} "
        f"(rank {f.rank} on {LEMON} died (signal 9) after step {f.step - 1})"
        for run in past_runs(now)
        for f in run.fired
        if f.node == LEMON
    ]
    return f"{LEMON}: 3 failures in 30 days across runs lemon-a, lemon-b, lemon-c: " + "; ".join(crashes)


def launch(pipeline: Processor, workdir: Path, run_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = launch_env(SECRET, steps=12, checkpoint_every=5)
    env.pop("TRAINGUARD_ARCHIVE", None)  # the default: none in the working directory
    command = [
        sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2",
        "--run-id", run_id, "--checkpoint-dir", str(workdir / "ckpt"),
        "--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix,
        "--max-restarts", "1", "--decision-wait-s", "2", "--self-test", "off", *extra,
        "--", sys.executable, str(EXAMPLE),
    ]  # fmt: skip
    return subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=400)


def kept_out_lines(done: subprocess.CompletedProcess[str], run_id: str) -> list[str]:
    return [
        line for line in done.stderr.splitlines() if line.startswith(f"trainguard: kept out of run {run_id}")
    ]


@pytest.mark.broker
def test_a_lemon_is_kept_out_of_the_launch_with_its_reason_and_paged_once(
    pipeline: Processor, archive: Path, now: float, tmp_path: Path
) -> None:
    run_id = f"lemon-{uuid.uuid4().hex[:8]}"
    reason = expected_reason(now)
    first = launch(pipeline, tmp_path, run_id, "--archive", str(archive))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # The console says which node is out and why; node-0000 (two failures) is not.
    assert kept_out_lines(first, run_id) == [f"trainguard: kept out of run {run_id}, {reason}"]

    # Journaled, and the world placed without it: its ranks on the first spare.
    journal = [
        json.loads(line) for line in (tmp_path / "ckpt" / ".trainguard" / "launcher.actions.jsonl").open()
    ]
    (kept,) = [r for r in journal if r["op"] == "command" and r["key"] == f"lemon:{LEMON}"]
    assert (kept["quarantine"], kept["detail"], kept["lemon"]["runs"]) == (
        LEMON,
        reason,
        ["lemon-a", "lemon-b", "lemon-c"],
    )
    assert [r["nodes"] for r in journal if r["op"] == "attempt"] == [[TWICE, "spare-0000"]]

    # The relaunch of the same run, without the archive: the journal keeps node-0001 out.
    second = launch(pipeline, tmp_path, run_id)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert kept_out_lines(second, run_id) == [f"trainguard: kept out of run {run_id}, {reason}"]

    events = telemetry(pipeline, run_id)
    started = [e for e in events if isinstance(e, RunStarted)]
    assert sorted({(e.attempt, tuple(e.nodes)) for e in started}) == [
        (0, (TWICE, "spare-0000")),
        (1, (TWICE, "spare-0000")),
    ]
    assert not [e for e in events if e.node == LEMON and not isinstance(e, NodeExcluded)]  # no rank there
    excluded = [e for e in events if isinstance(e, NodeExcluded)]
    assert len(excluded) == 2 and len({e.event_id for e in excluded}) == 1  # each launch sent the same one
    event = excluded[0]
    assert (event.node, event.rank, event.attempt, event.failures, event.window_days, event.runs) == (
        LEMON, -1, 0, 3, 30.0, ["lemon-a", "lemon-b", "lemon-c"],
    )  # fmt: skip
    assert event.reason.code is ReasonCode.LEMON_NODE
    assert event.reason.text == (
        f"{reason}; kept out of run {run_id} (a lemon node: --lemon-failures 3, --lemon-days 30)"
    )

    # Paged once, for node-0001 (the core's: processors/core).
    derived, _ = decisions(pipeline, run_id)
    pages = [d for d in derived if isinstance(d, Page) and d.rule == "lemon_node"]
    assert [(p.node, p.rule) for p in pages] == [(LEMON, "lemon_node")], derived
    assert pages[0].reason.code is ReasonCode.LEMON_NODE and event.event_id in pages[0].evidence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_agent_of_a_lemon_host_does_not_join_and_the_runs_list_says_why(
    archive: Path, now: float, tmp_path: Path
) -> None:
    """Across hosts: the agent on node-0001 puts its host on the run's shared quarantine list
    with the reason and ends (exit 1) before any rendezvous; started again, it is refused at
    once by the list. The agent on node-0000 (two failures) is not refused for its history."""
    state = tmp_path / "state"
    env = {**launch_env(SECRET, steps=12, checkpoint_every=5), "TRAINGUARD_OFFLINE": "1"}

    def agent(node: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable, "-m", "trainguard", "launch", "--offline", "--nnodes", "2:2",
            "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
            "--rdzv-id", "lemon-hosts",
            "--rdzv-conf", "join_timeout=5", "--local-addr", "127.0.0.1", "--node-name", node,
            "--state-dir", str(state), "--checkpoint-dir", str(tmp_path / "ckpt"), "--archive", str(archive),
            str(EXAMPLE),
        ]  # fmt: skip
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    reason = expected_reason(now)
    refused = agent(LEMON)
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert f"trainguard {LEMON}: kept out of run lemon-hosts, {reason}" in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    why = f"{LEMON} is kept out of run lemon-hosts for its failure history ({reason}): it does not join"
    assert last == f"failed: {why} (0 attempts)"
    assert SharedQuarantine(state).nodes() == {LEMON: f"kept out for its failure history: {reason}"}
    assert not (state / "hosts" / LEMON / "launcher.actions.jsonl").read_text().count('"op":"attempt"')

    again = agent(LEMON)  # refused by the list, before torch is imported
    assert again.returncode == 1
    listed = f"kept out for its failure history: {reason}"
    assert again.stderr.strip().splitlines()[-1] == (
        f"{LEMON} is quarantined for run lemon-hosts ({listed}): it does not rejoin"
    )
    # node-0000's agent is not refused for its history; alone, its round of 2 times out, and
    # its last line names the host out of the run and why, from the run's list.
    alone = agent(TWICE)
    assert alone.returncode == 1 and f"{TWICE}: kept out" not in alone.stderr
    assert f"Out of the run: {LEMON}: {listed}. No spare host joined" in alone.stderr.strip().splitlines()[-1]
    assert SharedQuarantine(state).nodes().keys() == {LEMON}


def in_process(tmp_path: Path, archive: Path | str, **settings: object) -> tuple[Launcher, MemorySink]:
    """A launcher of 4 ranks, 2 a modelled node, never run: its lemon gate alone."""
    config = LauncherConfig(
        command=python_command("train.py"), nproc=4, ranks_per_node=2, run_id="lemon-unit",
        checkpoint_dir=tmp_path / "ckpt", archive=str(archive), self_test_spares="off", **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    sink = MemorySink()
    return Launcher(config, sink), sink


def test_every_node_a_lemon_stops_the_launch_with_the_reason(archive: Path, tmp_path: Path) -> None:
    launcher, sink = in_process(tmp_path, archive, spares=0, lemon_failures=2)
    result = launcher.run()
    assert (result.status, result.attempts) == ("failed", 0)
    every = "every node of the pool (2) is kept out for its failure history"
    assert result.reason.startswith(f"the run cannot start: {every} ({TWICE}, {LEMON}: ")
    assert "Add spare nodes (--spares), or launch with --lemon-failures 0" in result.reason
    assert sorted(e.node for e in sink.of(NodeExcluded)) == [TWICE, LEMON]
    assert not sink.of(RunStarted)


def test_the_rule_off_readmits_what_the_journal_kept_out(archive: Path, tmp_path: Path) -> None:
    launcher, sink = in_process(tmp_path, archive)
    launcher.lemons.keep_out()
    assert launcher.state.quarantined == {LEMON}
    relaunched, again = in_process(tmp_path, archive, lemon_failures=0)
    assert relaunched.state.quarantined == {LEMON}  # the journal, replayed
    relaunched.lemons.keep_out()
    assert relaunched.state.quarantined == set() and not again.of(NodeExcluded)
    # With the rule on again and no archive at all, the journal keeps it out.
    third, sent = in_process(tmp_path, "")
    third.lemons.keep_out()
    assert third.state.quarantined == {LEMON} and [e.node for e in sent.of(NodeExcluded)] == [LEMON]


def test_an_archive_that_cannot_be_read_keeps_nobody_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "broken" / "_batches").mkdir(parents=True)  # an archive's shape, no table in it
    launcher, sink = in_process(tmp_path, tmp_path / "broken")
    launcher.lemons.keep_out()
    assert launcher.state.quarantined == set() and not sink.of(NodeExcluded)
    assert "could not be read" in caplog.text and "no node is kept out" in caplog.text
