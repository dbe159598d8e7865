"""The launcher with real rank processes (a tiny non-torch script; one gloo smoke test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from trainguard.kafka.topics import TopicNames
from trainguard.producers.launcher.checkpoints import rejected_steps, validated_steps
from trainguard.producers.launcher.config import LauncherConfig, python_command
from trainguard.producers.launcher.launcher import Launcher
from trainguard.producers.launcher.node_selftest import CheckResult, NodeSelfTestReport
from trainguard.producers.launcher.records import LaunchResult, RestartCause
from trainguard.producers.launcher.wiring import make_actuator
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.rank.shipper import ShipperConfig, TelemetryShipper
from trainguard.schemas import (
    Abort,
    Ack,
    AckStatus,
    Envelope,
    PauseRun,
    QuarantineNode,
    RankExit,
    Reason,
    ReasonCode,
    ReleaseNode,
    Rollback,
    RunStarted,
    SetCheckpointInterval,
    SkipUpdate,
    auth,
    decode,
    encode,
)
from trainguard.schemas import RestartPhases as RestartPhasesEvent
from trainguard.schemas.codec import ACKS, decode_batch

from ...readers import TopicReader

#: A fake rank: steps with progress files; rank 0 writes a VALIDATED checkpoint every
#: CKPT_EVERY steps; FAKE_KILL="rank:step:attempt" SIGKILLs that rank at that step (once
#: checkpoint FAKE_KILL_AFTER_CKPT is validated); FAKE_HANG=attempt makes every rank hang
#: at its second step of that attempt; FAKE_LOCKSTEP=1 keeps every rank within a step of
#: the slowest (a collective's lockstep: none runs past a dead rank);
#: FAKE_REJECT_ALL=attempt makes rank 0 mark every checkpoint REJECTED at its third step
#: of that attempt and exit 1 (what ranks that find nothing valid left to resume from
#: do). FAKE_ABORT_AT_EXIT=rank makes that rank abort (SIGABRT) after its last step, having
#: noted the Supervisor's close with FAKE_CLOSED's exit code if set. FAKE_PEER_LOST=
#: "rank:attempt" makes that rank note a lost peer at its second step and take its time to
#: exit (a flush at exit). It writes the phases and progress files the Supervisor would write.
FAKE_RANK = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    start = time.time()
    env = os.environ
    rank, attempt = int(env["RANK"]), int(env["TRAINGUARD_ATTEMPT"])
    resume = int(env["TRAINGUARD_RESUME_STEP"])
    ckpt = Path(env["TRAINGUARD_CHECKPOINT_DIR"])
    phases_file = Path(env["TRAINGUARD_PHASES_FILE"])
    out = Path(env["FAKE_OUT"])
    keys = [k for k in env if k.startswith("TRAINGUARD_") or k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]
    seen = {**{k: env[k] for k in keys}, "PID": os.getpid()}
    seen_file = out / f"env-{attempt}-{rank}.json"  # whole or absent: a rank may be ended mid-write
    seen_file.with_suffix(".tmp").write_text(json.dumps(seen))
    os.replace(seen_file.with_suffix(".tmp"), seen_file)
    phases = {"start_ts": start, "checkpoint_load_s": 0.01, "pg_init_s": 0.02}
    def write_phases():
        tmp = phases_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(phases))
        os.replace(tmp, phases_file)
    time.sleep(0.03)
    write_phases()
    kill = env.get("FAKE_KILL", "")
    steps, every = int(env.get("FAKE_STEPS", "20")), int(env.get("CKPT_EVERY", "5"))
    progress = Path(env["TRAINGUARD_PROGRESS_FILE"])
    def done(r):
        try:
            return int((progress.parent / ("rank-%d.progress" % r)).read_text())
        except (OSError, ValueError):
            return resume
    for step in range(resume + 1, steps):
        time.sleep(0.02)
        while env.get("FAKE_LOCKSTEP") and min(map(done, range(int(env["WORLD_SIZE"])))) < step - 1:
            time.sleep(0.005)  # as in a collective: no rank runs ahead of a dead one
        if env.get("FAKE_PEER_LOST") == "%d:%d" % (rank, attempt) and step == resume + 2:
            phases["peer_lost"] = "Read error [127.0.0.1]:6061: Connection reset by peer"
            write_phases()
            time.sleep(3600)
        if env.get("FAKE_HANG") == str(attempt) and step == resume + 2:
            time.sleep(3600)
        if kill and kill.split(":") == [str(rank), str(step), str(attempt)]:
            wait_for = ckpt / ("step-%09d" % int(env.get("FAKE_KILL_AFTER_CKPT", "0"))) / "VALIDATED"
            while env.get("FAKE_KILL_AFTER_CKPT") and not wait_for.exists():
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and step % every == 0:
            d = ckpt / ("step-%09d" % step)
            d.mkdir(parents=True, exist_ok=True)
            (d / "MANIFEST.json").write_text("{}")
            (d / "VALIDATED").write_text("ok")
        if rank == 0 and env.get("FAKE_REJECT_ALL") == str(attempt) and step == resume + 3:
            for d in ckpt.glob("step-*"):
                (d / "REJECTED").write_text(json.dumps({"reason": "digest mismatch in shard __0_0.distcp"}))
            sys.exit(1)
        phases["last_step"] = step
        if "first_step_ts" not in phases:
            phases["first_step_ts"] = time.time()
        write_phases()
        progress.with_suffix(".tmp").write_text(str(step))
        os.replace(progress.with_suffix(".tmp"), progress)
    if env.get("FAKE_ABORT_AT_EXIT") == str(rank):
        if env.get("FAKE_CLOSED"):
            phases["closed"] = int(env["FAKE_CLOSED"])
            write_phases()
        os.abort()
    """
)


def make_launcher(tmp_path: Path, sink: Any, env: dict[str, str], **overrides: Any) -> Launcher:
    script = tmp_path / "rank.py"
    script.write_text(FAKE_RANK)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    fields: dict[str, Any] = dict(
        command=python_command(str(script)),
        nproc=4,
        ranks_per_node=2,
        run_id="r1",
        checkpoint_dir=tmp_path / "ckpt",
        max_restarts=2,
        grace_s=0.5,
        term_timeout_s=2,
        decision_wait_s=0.1,
        env={"FAKE_OUT": str(out), **env},
        preload=(),  # the fake ranks import nothing: a fork server importing torch is all cost
    )
    fields.update(overrides)
    # Spares pass their self-test here (the real one spawns torch workers: test_selftest.py).
    return Launcher(LauncherConfig(**fields), sink, self_test=passing_self_test)


def passing_self_test(node: str, devices: int, tests: Sequence[str]) -> NodeSelfTestReport:
    report = NodeSelfTestReport(node, list(tests))
    report.results = [CheckResult(t, r, "cpu", True, "exact", 0.0) for t in tests for r in range(devices)]
    return report


def seen_env(tmp_path: Path, attempt: int, rank: int) -> dict[str, str]:
    data: dict[str, str] = json.loads((tmp_path / "out" / f"env-{attempt}-{rank}.json").read_text())
    return data


def test_sigkill_ends_the_attempt_and_the_group_restarts_from_the_newest_validated(tmp_path: Path) -> None:
    sink = MemorySink()
    # In lockstep, as ranks in a collective: none passes step 12 (no checkpoint 15 to race).
    kill = {"FAKE_KILL": "1:12:0", "FAKE_KILL_AFTER_CKPT": "10", "FAKE_LOCKSTEP": "1"}
    launcher = make_launcher(tmp_path, sink, kill)
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert result.attempts == 2
    started = sink.of(RunStarted)
    assert [(s.attempt, s.resumed_from_step) for s in started] == [(0, -1), (1, 10)]
    assert started[0].nodes == ["node-0000", "node-0001"] and started[0].rank == -1
    exits = {(e.attempt, e.rank): e for e in sink.of(RankExit)}
    assert len(exits) == 8
    culprit = exits[(0, 1)]
    assert (culprit.signal, culprit.exit_code, culprit.requested, culprit.node) == (9, -9, False, "node-0000")
    assert all(exits[(0, r)].requested for r in (0, 2, 3))
    # Each exit: the rank's own newest completed step, and the newest any rank had completed
    # when it was seen (these fake ranks do not wait for each other), from the progress files.
    assert culprit.step == 11 and culprit.job_step >= 11
    progress = [
        int((tmp_path / "ckpt" / ".trainguard" / "attempt-0" / f"rank-{r}.progress").read_text())
        for r in range(4)
    ]
    assert [exits[(0, r)].step for r in range(4)] == progress
    assert all(exits[(0, r)].job_step == max(progress) for r in (0, 2, 3))
    assert all(exits[(1, r)].exit_code == 0 and not exits[(1, r)].requested for r in range(4))
    env = seen_env(tmp_path, 1, 3)
    assert env["TRAINGUARD_RESUME_STEP"] == "10" and env["TRAINGUARD_ATTEMPT"] == "1"
    # LOCAL_RANK is the real host's (torchrun's, test_rank_env.py); the modelled node's own:
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "3", "4")
    assert (env["TRAINGUARD_NODE"], env["TRAINGUARD_NODE_LOCAL_RANK"]) == ("node-0001", "1")
    assert env["TRAINGUARD_RUN_ID"] == "r1" and env["TRAINGUARD_BOOTSTRAP"] == ""
    [phases] = result.restarts
    assert phases.cause is RestartCause.CRASH and (phases.rank, phases.signal) == (1, 9)
    assert (phases.from_attempt, phases.to_attempt, phases.resumed_from_step) == (0, 1, 10)
    assert phases.complete and phases.ranks_reported == 4
    for name in ("reschedule_s", "process_start_s", "first_step_s", "restart_s"):
        value = getattr(phases, name)
        assert value is not None and 0 <= value < 10, name
    assert phases.checkpoint_load_s == 0.01 and phases.pg_init_s == 0.02
    assert phases.detect_s < 1
    lines = (tmp_path / "ckpt" / ".trainguard" / "restarts.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["cause"] == "crash"
    # ...and as telemetry, once, for the archive's restart_phase view
    (event,) = sink.of(RestartPhasesEvent)
    assert (event.interrupted_attempt, event.attempt, event.cause) == (0, 1, "crash")
    assert list(event.phases) == [
        "detect",
        "reschedule",
        "process_start",
        "checkpoint_load",
        "pg_init",
        "first_step",
    ]
    assert event.phases["checkpoint_load"] == 0.01 and event.phases["reschedule"] == phases.reschedule_s


def test_quarantine_moves_the_nodes_ranks_to_a_spare_at_the_next_attempt(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_KILL": "2:4:0"})
    command = QuarantineNode(
        command_id="q1", run_id="r1", attempt=0, issued_ts=1.0,
        reason=Reason(code=ReasonCode.OPERATOR, text="test"), node="node-0001",
    )  # fmt: skip
    details: list[str] = []

    def on_attempt(attempt: int) -> None:
        if attempt == 0:  # during attempt 0: takes effect at the next restart
            details.append(launcher.handle_quarantine(command, -1))

    launcher.on_attempt = on_attempt
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert details == ["node-0001 leaves the pool at the next restart (node-0001->spare-0000)"]
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"], ["node-0000", "spare-0000"]]
    assert seen_env(tmp_path, 1, 2)["TRAINGUARD_NODE"] == "spare-0000"
    assert seen_env(tmp_path, 1, 1)["TRAINGUARD_NODE"] == "node-0000"
    assert {e.node for e in sink.of(RankExit) if e.attempt == 1} == {"node-0000", "spare-0000"}


def test_rollback_stops_the_group_and_resumes_from_the_named_step(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_HANG": "0"})
    ckpt = tmp_path / "ckpt"
    for step in (5, 10):
        (ckpt / f"step-{step:09d}").mkdir(parents=True)
        (ckpt / f"step-{step:09d}" / "MANIFEST.json").write_text("{}")
        (ckpt / f"step-{step:09d}" / "VALIDATED").write_text("ok")
    rollback = Rollback(
        command_id="rb", run_id="r1", attempt=0, issued_ts=time.time(),
        reason=Reason(code=ReasonCode.ROLLBACK, text="sdc"), checkpoint_step=5, uri="",
    )  # fmt: skip
    details: list[str] = []

    def on_attempt(attempt: int) -> None:
        if attempt == 0:
            time.sleep(0.3)  # let the ranks get going
            details.append(launcher.handle_resume(rollback, -1))

    # Attempt 0 (resumed from 10) hangs; the rollback stops it; attempt 1 resumes from 5.
    launcher.on_attempt = lambda a: threading.Thread(target=on_attempt, args=(a,)).start()
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert details == ["stopping attempt 0; restarting from checkpoint 5"]
    assert [s.resumed_from_step for s in sink.of(RunStarted)] == [10, 5]
    assert [r.cause for r in result.restarts] == [RestartCause.ROLLBACK]
    assert result.restarts[0].command_id == "rb" and result.restarts[0].complete
    assert all(e.requested for e in sink.of(RankExit) if e.attempt == 0)
    assert seen_env(tmp_path, 1, 0)["TRAINGUARD_RESUME_STEP"] == "5"


def test_max_restarts_bounds_a_crash_loop(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_KILL": "0:2:0"}, max_restarts=0)
    result = launcher.run()
    assert result.status == "failed" and "max_restarts" in result.reason and "crash" in result.reason
    assert [(r.cause, r.to_attempt) for r in result.restarts] == [(RestartCause.CRASH, None)]


@pytest.mark.parametrize("closed", ["0", "1", None])
def test_a_rank_that_aborts_after_its_supervisor_closed_cleanly_ended_cleanly(
    tmp_path: Path, closed: str | None
) -> None:
    """After the Supervisor's close with 0 the run is over in that process: a signal in the
    interpreter's teardown (a backend thread releasing a collective's tensors at
    finalization aborts it) is a clean end, not a crash to restart. Without the close, or
    after a close with an error, the same abort is a crash."""
    sink = MemorySink()
    env = {"FAKE_ABORT_AT_EXIT": "2", "FAKE_STEPS": "8", **({"FAKE_CLOSED": closed} if closed else {})}
    result = make_launcher(tmp_path, sink, env, max_restarts=0).run()
    exits = {(e.attempt, e.rank): e for e in sink.of(RankExit)}
    if closed == "0":
        assert result.status == "ok" and result.attempts == 1 and not result.restarts, result.reason
        assert (exits[(0, 2)].exit_code, exits[(0, 2)].signal) == (0, None)
        (end,) = [e for e in result.exits if e.rank == 2]
        assert (end.returncode, end.teardown_signal) == (0, signal.SIGABRT)
    else:
        assert result.status == "failed" and "crash" in result.reason
        assert (exits[(0, 2)].exit_code, exits[(0, 2)].signal) == (-signal.SIGABRT, signal.SIGABRT)


def test_launcher_stop_tears_the_group_down(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_HANG": "0"})
    threading.Timer(1.0, launcher.stop).start()
    started = time.monotonic()
    result = launcher.run()
    assert result.status == "stopped" and time.monotonic() - started < 8
    exits = sink.of(RankExit)
    assert len(exits) == 4 and all(e.requested and e.signal == signal.SIGTERM for e in exits)


def pause_run(step: int = 3) -> PauseRun:
    reason = Reason(code=ReasonCode.PAUSE_RUN, text=f"step {step} failed 2 times on 2 different nodes")
    return PauseRun(
        command_id="pause", run_id="r1", attempt=0, issued_ts=time.time(), reason=reason, step=step
    )


def test_pause_run_stops_the_running_group_and_nothing_restarts(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_HANG": "0"})
    details: list[str] = []

    def on_attempt(attempt: int) -> None:
        time.sleep(0.3)
        details.append(launcher.handle_pause(pause_run(), -1))

    launcher.on_attempt = lambda a: threading.Thread(target=on_attempt, args=(a,)).start()
    result = launcher.run()
    assert result.status == "paused" and result.attempts == 1
    assert result.reason == "paused at step 3 by pause: step 3 failed 2 times on 2 different nodes"
    assert details[0].startswith("run paused at step 3: attempt 0 stops and nothing restarts")
    assert [(r.cause, r.to_attempt) for r in result.restarts] == [(RestartCause.PAUSE, None)]
    assert len(sink.of(RankExit)) == 4 and all(e.requested for e in sink.of(RankExit))
    assert [s.attempt for s in sink.of(RunStarted)] == [0]
    # A human relaunches after the clean paused end: the pause is over.
    assert make_launcher(tmp_path, MemorySink(), {})._pause is None


def test_pause_run_during_the_decision_wait_after_a_crash_restarts_nothing(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_KILL": "1:3:0"}, decision_wait_s=2.0)

    def pause_after_the_crash() -> None:
        while not [e for e in sink.of(RankExit) if not e.requested]:
            time.sleep(0.02)
        launcher.handle_pause(pause_run(), -1)

    threading.Thread(target=pause_after_the_crash, daemon=True).start()
    result = launcher.run()
    assert result.status == "paused" and result.attempts == 1
    assert [(r.cause, r.to_attempt) for r in result.restarts] == [(RestartCause.CRASH, None)]


def test_skip_update_makes_every_later_attempt_skip_that_batch(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_KILL": "1:3:0"}, decision_wait_s=2.0)
    reason = Reason(code=ReasonCode.SKIP_BATCH, text="step 3 failed on 2 nodes; skipping its batch")
    skip = SkipUpdate(command_id="skip", run_id="r1", attempt=0, issued_ts=1.0, reason=reason, step=3)
    details: list[str] = []

    def skip_after_the_crash() -> None:  # the core decides while the launcher waits for it
        while not [e for e in sink.of(RankExit) if not e.requested]:
            time.sleep(0.02)
        details.append(launcher.handle_skip(skip, -1))

    threading.Thread(target=skip_after_the_crash, daemon=True).start()
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert details == ["the batch of step 3 is skipped from the next attempt on"]
    assert seen_env(tmp_path, 0, 0)["TRAINGUARD_SKIP_BATCHES"] == ""
    assert seen_env(tmp_path, 1, 0)["TRAINGUARD_SKIP_BATCHES"] == "3"
    assert make_launcher(tmp_path, MemorySink(), {}).skip_batches == {3}  # journaled


def test_every_later_attempt_starts_with_the_last_checkpoint_interval_sent(tmp_path: Path) -> None:
    """Issue 15: a SetCheckpointInterval carries its attempt, so a restarted rank would
    refuse it; the launcher journals it and hands it to every later attempt's ranks."""
    sink = MemorySink()
    operator = {"FAKE_KILL": "1:3:0", "TRAINGUARD_CHECKPOINT_INTERVAL_S": "1800"}
    launcher = make_launcher(tmp_path, sink, operator, decision_wait_s=2.0)
    reason = Reason(code=ReasonCode.CHECKPOINT_INTERVAL, text="checkpoint every 2.0 min (young)")
    interval = SetCheckpointInterval(
        command_id="int1", run_id="r1", attempt=0, issued_ts=1.0, reason=reason, interval_s=120.0
    )
    details: list[str] = []

    def send_after_the_crash() -> None:
        while not [e for e in sink.of(RankExit) if not e.requested]:
            time.sleep(0.02)
        details.append(launcher.handle_interval(interval, -1))

    threading.Thread(target=send_after_the_crash, daemon=True).start()
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert details == ["checkpoint every 120s from the next attempt on too"]
    assert seen_env(tmp_path, 0, 0)["TRAINGUARD_CHECKPOINT_INTERVAL_S"] == "1800"  # the operator's
    assert seen_env(tmp_path, 1, 3)["TRAINGUARD_CHECKPOINT_INTERVAL_S"] == "120"
    assert make_launcher(tmp_path, MemorySink(), {}).checkpoint_interval_s == 120.0  # journaled


def test_release_node_returns_a_quarantined_node_to_the_next_placement(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_KILL": "2:4:0"})
    reason = Reason(code=ReasonCode.QUARANTINE_RELEASED, text="data or code, not node-0001")
    quarantine = QuarantineNode(
        command_id="q1", run_id="r1", attempt=0, issued_ts=1.0, reason=reason, node="node-0001"
    )
    release = ReleaseNode(
        command_id="rel1", run_id="r1", attempt=0, issued_ts=1.0, reason=reason, node="node-0001"
    )
    details: list[str] = []

    def on_attempt(attempt: int) -> None:
        if attempt == 0:
            details.append(launcher.handle_quarantine(quarantine, -1))
            details.append(launcher.handle_release(release, -1))
            details.append(launcher.handle_release(release.model_copy(update={"command_id": "rel2"}), -1))

    launcher.on_attempt = on_attempt
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert details[1:] == [
        "node-0001 is back in the pool from the next restart on",
        "node-0001 is not quarantined: nothing to release",
    ]
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"]] * 2
    with pytest.raises(ValueError, match="not in the pool"):
        launcher.handle_release(release.model_copy(update={"node": "node-9999"}), -1)
    # The journal keeps the release: a relaunch does not quarantine the node again.
    assert make_launcher(tmp_path, MemorySink(), {}).quarantined == set()


GLOO_RANK = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == sum(range(1, dist.get_world_size() + 1)), t
    dist.destroy_process_group()
    """
)


def test_gloo_smoke_two_real_torch_ranks(tmp_path: Path) -> None:
    script = tmp_path / "gloo_rank.py"
    script.write_text(GLOO_RANK)
    config = LauncherConfig(
        command=python_command(str(script)),
        nproc=2,
        ranks_per_node=1,
        run_id="gloo",
        checkpoint_dir=tmp_path / "ckpt",
        max_restarts=0,
        env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    sink = MemorySink()
    result = Launcher(config, sink).run()
    assert result.status == "ok", result.reason
    assert [e.exit_code for e in sink.of(RankExit)] == [0, 0]


@pytest.mark.broker
@pytest.mark.parametrize("dying", [False, True], ids=["hang", "a rank dying of a lost peer"])
def test_real_broker_events_reach_telemetry_and_a_signed_abort_restarts_the_group(
    bootstrap: str, topics: TopicNames, tmp_path: Path, dying: bool
) -> None:
    """The ranks hang and the processor's Abort ends the attempt. With `dying`, rank 1 had
    already noted a lost peer and is slow to exit when the Abort comes (a whole host lost
    elsewhere, seen as a hang first): the crash is the cause, and rank 1's end is its own,
    a lost peer's (the processor's evidence), not one the launcher asked for."""
    secret = b"s" * 32
    shipper = TelemetryShipper(ShipperConfig(bootstrap, topics.telemetry, flush_interval_s=0.2), "rb1", 4)
    env = {"FAKE_HANG": "0"} | ({"FAKE_PEER_LOST": "1:0"} if dying else {})
    launcher = make_launcher(tmp_path, shipper, env, run_id="rb1")
    actuator = make_actuator(launcher, bootstrap, topics.commands, topics.acks, secret)
    acks = TopicReader(bootstrap, topics.acks)
    telemetry = TopicReader(bootstrap, topics.telemetry)
    outcome: list[LaunchResult] = []
    with actuator:
        assert actuator.wait_ready(30)
        runner = threading.Thread(target=lambda: outcome.append(launcher.run()))
        runner.start()
        deadline = time.monotonic() + 30
        started = [tmp_path / "out" / f"env-0-{r}.json" for r in range(4)]  # each rank writes its own
        while not all(p.exists() for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        phases = Path(json.loads(started[1].read_text())["TRAINGUARD_PHASES_FILE"])
        while dying and "peer_lost" not in (phases.read_text() if phases.exists() else ""):
            assert time.monotonic() < deadline, "rank 1 never noted its lost peer"
            time.sleep(0.05)
        abort = Abort(
            command_id="abort-1", run_id="rb1", attempt=0, issued_ts=time.time(),
            reason=Reason(code=ReasonCode.OPERATOR, text="hang"),
        )  # fmt: skip
        producer = Producer({"bootstrap.servers": bootstrap})
        producer.produce(
            topics.commands, key=b"rb1", value=encode(auth.sign(abort, auth.run_key(secret, "rb1")))
        )
        assert producer.flush(30) == 0
        runner.join(60)
    shipper.close()
    assert outcome and outcome[0].status == "ok", outcome
    (restart,) = outcome[0].restarts
    if dying:
        assert (restart.cause, restart.rank) == (RestartCause.CRASH, 1), restart
        assert "rank 1 is ending (lost a peer: Read error" in restart.detail, restart.detail
    else:
        assert restart.cause == RestartCause.ABORT
    seen = acks.until(lambda s: len(s) >= 1, 30)
    ack = decode(seen[0].value, ACKS)
    assert isinstance(ack, Ack)
    assert (ack.command_id, ack.status, ack.rank, ack.attempt) == ("abort-1", AckStatus.EXECUTED, -1, 0)

    def events() -> list[Envelope]:
        return [e for s in telemetry.seen for e in decode_batch(s.value).events]

    telemetry.until(lambda _: len([e for e in events() if isinstance(e, RankExit)]) >= 8, 30)
    got = events()
    assert sorted(e.attempt for e in got if isinstance(e, RunStarted)) == [0, 1]
    exits = [e for e in got if isinstance(e, RankExit)]
    assert len(exits) == 8
    ended = {e.rank: (e.requested, e.peer_lost) for e in exits if e.attempt == 0}
    assert ended == {r: (False, True) if dying and r == 1 else (True, False) for r in range(4)}, ended
    assert all(e.exit_code == 0 and not e.requested for e in exits if e.attempt == 1)
    acks.close()
    telemetry.close()


def test_cli_sigterm_tears_the_group_down_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(FAKE_RANK)
    (tmp_path / "out").mkdir()
    # torchrun's --nproc-per-node alone sizes a one-host world too (rank 1's file below)
    argv = [sys.executable, "-m", "trainguard", "launch", "--nproc-per-node", "2", "--run-id", "cli"]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--offline", "--", sys.executable, str(script)]
    env = {**os.environ, "FAKE_OUT": str(tmp_path / "out"), "FAKE_HANG": "0"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / "out" / f"env-0-{r}.json").exists() for r in range(2)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "stopped: the launcher was stopped (1 attempts)" in out
    for r in range(2):  # the ranks are gone (reaped), not orphaned
        pid = json.loads((tmp_path / "out" / f"env-0-{r}.json").read_text())["PID"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_checkpoint_the_ranks_rejected_is_never_chosen_again(tmp_path: Path) -> None:
    sink = MemorySink()
    ckpt = tmp_path / "ckpt"
    for step in (5, 10):
        (ckpt / f"step-{step:09d}").mkdir(parents=True)
        (ckpt / f"step-{step:09d}" / "MANIFEST.json").write_text("{}")
        (ckpt / f"step-{step:09d}" / "VALIDATED").write_text("ok")
    (ckpt / "step-000000010" / "REJECTED").write_text(json.dumps({"reason": "missing shard __1_0.distcp"}))
    assert validated_steps(ckpt).keys() == {5}
    assert rejected_steps(ckpt) == {10: "missing shard __1_0.distcp"}
    result = make_launcher(tmp_path, sink, {"FAKE_STEPS": "8"}).run()
    assert result.status == "ok", result.reason
    assert [s.resumed_from_step for s in sink.of(RunStarted)] == [5]


def test_with_every_checkpoint_rejected_the_run_stops_and_says_so(tmp_path: Path) -> None:
    sink = MemorySink()
    env = {"FAKE_REJECT_ALL": "0", "FAKE_STEPS": "14"}
    (tmp_path / "ckpt" / "step-000000005").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-000000005" / "MANIFEST.json").write_text("{}")
    (tmp_path / "ckpt" / "step-000000005" / "VALIDATED").write_text("ok")
    result = make_launcher(tmp_path, sink, env).run()
    assert result.status == "failed" and result.attempts == 1
    assert (
        result.reason.startswith("no valid checkpoint left in ")
        and "step 5: digest mismatch" in result.reason
    )
    assert "--restart-from-scratch" in result.reason
    assert [(r.cause, r.to_attempt) for r in result.restarts] == [(RestartCause.CRASH, None)]


def test_with_every_checkpoint_rejected_the_policy_may_start_from_step_0(tmp_path: Path) -> None:
    sink = MemorySink()
    env = {"FAKE_REJECT_ALL": "0", "FAKE_STEPS": "14"}
    (tmp_path / "ckpt" / "step-000000005").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-000000005" / "MANIFEST.json").write_text("{}")
    (tmp_path / "ckpt" / "step-000000005" / "VALIDATED").write_text("ok")
    result = make_launcher(tmp_path, sink, env, restart_from_scratch=True).run()
    assert result.status == "ok", result.reason
    assert [s.resumed_from_step for s in sink.of(RunStarted)] == [5, -1]
