"""Issue 7 scenario 5: the launcher (or a rank's supervisor) SIGKILLed in the middle of a
restart action, then started again on the same run dir.

`trainguard launch` runs as its own process; TRAINGUARD_LAUNCHER_FAULT makes it SIGKILL
itself at a named point of the action (producers/chaos/kill_points.py, FAULT_POINTS), so the kill
lands deterministically mid-action. The successor must not repeat what was executed
(one record per interruption and per command id, one EXECUTED ack per command), keep
the attempt numbering continuous, find none of the dead launcher's ranks left running
(they die with it: issue 44, producers/launcher/agent_bound.py), and finish the run from
the right validated checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from harness.scoring.oracle import executed_once
from trainguard.kafka.topics import TopicNames
from trainguard.producers.launcher.journal import (
    JOURNAL_NAME,
    ActionJournal,
    alive,
    rank_processes,
    replay,
)
from trainguard.schemas import (
    Ack,
    AckStatus,
    Command,
    QuarantineNode,
    Reason,
    ReasonCode,
    Rollback,
    SkipUpdate,
    auth,
    decode,
    encode,
)
from trainguard.schemas.codec import ACKS

from ...readers import Seen, TopicReader

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"
SECRET = "launcher-restart-test-secret-0123456789"
STEPS = 20

#: A fake rank (no torch): steps of 20 ms; rank 0 checkpoints every 5 steps, each
#: checkpoint holding the list of steps applied so far (the "weights"), and writes it to
#: final.json at the end. FAKE_CRASH="rank:step:attempt" SIGKILLs that rank at that step
#: (once checkpoint 10 is validated) and blocks the others at their next step, as a
#: collective whose peer died would. FAKE_HANG=attempt: every rank hangs at its second step.
#: A rank whose launcher died would go on "training" (sleeps) until someone ended it, as a
#: long run's ranks would; it is bound to die with its launcher instead (issue 44).
FAKE_RANK = textwrap.dedent(
    """
    import json, os, signal, time
    from pathlib import Path
    env = os.environ
    parent = os.getppid()
    start = time.time()
    rank, attempt = int(env["RANK"]), int(env["TRAINGUARD_ATTEMPT"])
    resume = int(env["TRAINGUARD_RESUME_STEP"])
    ckpt, out = Path(env["TRAINGUARD_CHECKPOINT_DIR"]), Path(env["FAKE_OUT"])
    phases_file = Path(env["TRAINGUARD_PHASES_FILE"])
    seen = {k: env[k] for k in env if k.startswith("TRAINGUARD_") or k == "RANK"}
    seen_file = out / f"env-{attempt}-{rank}.json"  # whole or absent: a rank may be ended mid-write
    seen_file.with_suffix(".tmp").write_text(json.dumps({**seen, "PID": os.getpid()}))
    os.replace(seen_file.with_suffix(".tmp"), seen_file)
    phases = {"start_ts": start, "checkpoint_load_s": 0.01, "pg_init_s": 0.01}
    def write_phases():
        tmp = phases_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(phases))
        os.replace(tmp, phases_file)
    write_phases()
    applied = json.loads((ckpt / ("step-%09d" % resume) / "state.json").read_text()) if resume >= 0 else []
    crash = env.get("FAKE_CRASH", "").split(":")
    for step in range(resume + 1, int(env.get("FAKE_STEPS", "20"))):
        time.sleep(0.02)
        while os.getppid() != parent:  # orphaned
            time.sleep(1)
        if env.get("FAKE_HANG") == str(attempt) and step == resume + 2:
            time.sleep(3600)
        if len(crash) == 3 and int(crash[2]) == attempt and step >= int(crash[1]):
            if int(crash[0]) == rank:
                while not (ckpt / ("step-%09d" % 10) / "VALIDATED").exists():
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # blocked in the collective
        applied.append(step)
        if rank == 0 and step % 5 == 0:
            d = ckpt / ("step-%09d" % step)
            d.mkdir(parents=True, exist_ok=True)
            (d / "state.json").write_text(json.dumps(applied))
            (d / "MANIFEST.json").write_text("{}")
            (d / "VALIDATED").write_text("ok")
        phases["last_step"] = step
        phases.setdefault("first_step_ts", time.time())
        write_phases()
    if rank == 0:
        (out / "final.json").write_text(json.dumps(applied))
    """
)


@dataclass
class Run:
    workdir: Path
    run_id: str

    @property
    def ckpt(self) -> Path:
        return self.workdir / "ckpt"

    @property
    def run_dir(self) -> Path:
        return self.ckpt / ".trainguard"

    @property
    def out(self) -> Path:
        return self.workdir / "out"

    def restarts(self) -> list[dict[str, Any]]:
        path = self.run_dir / "restarts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def journal(self, op: str) -> list[dict[str, Any]]:
        records = [json.loads(line) for line in (self.run_dir / JOURNAL_NAME).read_text().splitlines()]
        return [r for r in records if r["op"] == op]

    def rank_pids(self) -> list[int]:
        return [json.loads(p.read_text())["PID"] for p in self.out.glob("env-*.json")]

    def attempts(self) -> list[int]:
        """Every attempt number the launchers journaled (an intent to spawn)."""
        return sorted({r["attempt"] for r in self.journal("attempt")})


def make_run(tmp_path: Path) -> Run:
    (tmp_path / "out").mkdir(parents=True)
    (tmp_path / "rank.py").write_text(FAKE_RANK)
    return Run(tmp_path, f"restart-{uuid.uuid4().hex[:8]}")


def launch(
    run: Run,
    fault: str = "",
    env: dict[str, str] | None = None,
    broker: tuple[str, str] | None = None,
    decision_wait_s: float = 0.2,
    script: Path | None = None,
) -> subprocess.Popen[str]:
    """`trainguard launch` as its own process (output to a file: ranks a killed launcher
    leaves behind would hold a pipe open)."""
    argv = [sys.executable, "-m", "trainguard", "launch", "--nproc", "4", "--ranks-per-node", "2"]
    argv += ["--run-id", run.run_id, "--checkpoint-dir", str(run.ckpt), "--max-restarts", "3"]
    argv += ["--decision-wait-s", str(decision_wait_s), "--grace-s", "1"]
    argv += ["--self-test", "off"]  # spares join untested: the restart's timing is what is tested here
    argv += ["--bootstrap", broker[0], "--topic-prefix", broker[1]] if broker else ["--offline"]
    if script is None:  # the fake ranks import nothing: a fork server importing torch is all cost
        argv += ["--preload", "none"]  # (the example's are forked, the default: recovery meets them)
    argv += ["--", sys.executable, str(script or run.workdir / "rank.py")]
    full = {**os.environ, "FAKE_OUT": str(run.out), "FAKE_STEPS": str(STEPS), "TRAINGUARD_SECRET": SECRET}
    full.pop("TRAINGUARD_SECRET_FILE", None)
    full.pop("TRAINGUARD_LAUNCHER_FAULT", None)
    full |= env or {}
    if fault:
        full["TRAINGUARD_LAUNCHER_FAULT"] = fault
    log = (run.workdir / f"launcher-{time.monotonic_ns()}.log").open("w")
    return subprocess.Popen(argv, env=full, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def logs(run: Run) -> str:
    return "\n".join(p.read_text()[-2500:] for p in sorted(run.workdir.glob("launcher-*.log")))


def killed(proc: subprocess.Popen[str], run: Run, timeout_s: float = 60) -> None:
    assert proc.wait(timeout_s) == -signal.SIGKILL, logs(run)


def finished(proc: subprocess.Popen[str], run: Run, timeout_s: float = 90) -> None:
    assert proc.wait(timeout_s) == 0, logs(run)


def assert_restarted_once_each(run: Run, causes: list[str]) -> None:
    """restarts.jsonl: one line per interruption, in order, attempts chained without a gap;
    the journal: one interruption per index and key; every spawned attempt numbered in turn."""
    restarts = run.restarts()
    assert [r["cause"] for r in restarts] == causes, restarts
    assert [r["interruption"] for r in restarts] == list(range(len(causes)))
    assert [r["from_attempt"] for r in restarts] == list(range(len(causes)))
    assert [r["to_attempt"] for r in restarts] == list(range(1, len(causes) + 1))
    journaled = run.journal("interruption")
    assert sorted(r["index"] for r in journaled) == list(range(len(causes)))
    assert len({r["key"] for r in journaled}) == len(causes)
    assert run.attempts() == list(range(len(causes) + 1))


def assert_no_orphans(run: Run) -> None:
    assert [p for p in run.rank_pids() if alive(p)] == []
    assert rank_processes(run.run_dir) == {}


def final_state(run: Run) -> list[int]:
    state: list[int] = json.loads((run.out / "final.json").read_text())
    return state


def test_journal_drops_a_torn_last_line_and_appends_after_it(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_NAME
    journal = ActionJournal(path)
    journal.append("attempt", attempt=0, resume=-1, nodes=["node-0000"], interruption=None)
    journal.close()
    with path.open("ab") as fh:
        fh.write(b'{"op":"ended","attempt":0,"en')  # killed mid-write: its fsync never returned
    again = ActionJournal(path)
    assert [r["op"] for r in again.records] == ["run", "attempt"]
    assert again.nonce == journal.nonce
    again.append("ended", attempt=0, end="ok", exits=[])
    again.close()
    state = replay(ActionJournal(path).records)
    assert state.attempts[0].ended == "ok" and not state.clean


def test_a_journaled_pause_holds_until_a_clean_end_and_a_release_undoes_a_quarantine(tmp_path: Path) -> None:
    journal = ActionJournal(tmp_path / JOURNAL_NAME)
    journal.append("command", key="q1", kind="quarantine_node", attempt=0, ok=True, quarantine="node-0001")
    journal.append("command", key="q2", kind="quarantine_node", attempt=0, ok=True, quarantine="node-0002")
    journal.append("command", key="rel", kind="release_node", attempt=0, ok=True, release="node-0001")
    pause = {"step": 80, "reason": "step 80 failed on 2 nodes"}
    journal.append("command", key="p", kind="pause_run", attempt=1, ok=True, pause=pause)
    state = replay(journal.records)
    assert state.quarantined == ["node-0002"]
    assert state.paused is not None and state.paused["pause"] == pause  # killed before its clean end
    journal.append("session", status="paused", reason="")
    assert replay(journal.records).paused is None  # relaunched by a human after the paused end


# --------------------------------------------------------------------------- offline: a crash


@pytest.mark.parametrize(
    ("faults", "causes"),
    [
        # Killed with the crashed attempt's survivors still running (blocked): they die with
        # it (issue 44: ranks never outlive their agent); the successor finishes the same
        # interruption.
        (["after-interruption:0"], ["crash"]),
        # Killed between the teardown and the next spawn.
        (["after-teardown:0"], ["crash"]),
        # Killed with the next attempt journaled, nothing spawned: spawned under its number.
        (["before-spawn:1"], ["crash"]),
        # Killed with the next attempt's ranks spawned and their pids journaled: that attempt
        # is lost, a restart of cause "launcher".
        (["after-spawn:1"], ["crash", "launcher"]),
        # The same with the pids not journaled yet: the ranks died with the launcher (issue
        # 44), so nothing says they ran: the attempt is taken for never spawned and spawned
        # again under its number. (Before issue 44 the successor found them running by their
        # environment, a restart of cause "launcher".)
        (["mid-spawn:1"], ["crash"]),
        # The successor killed too, in its own recovery: a third launcher finishes it.
        (["after-interruption:0", "before-spawn:1"], ["crash"]),
    ],
)
def test_launcher_killed_mid_restart_after_a_crash(
    tmp_path: Path, faults: list[str], causes: list[str]
) -> None:
    run = make_run(tmp_path)
    crash = {"FAKE_CRASH": "1:12:0"}  # after checkpoint 10; ranks 0, 2, 3 block at step 12
    for fault in faults:
        killed(launch(run, fault, crash), run)
    finished(launch(run, env=crash), run)
    assert_restarted_once_each(run, causes)
    assert run.restarts()[0]["rank"] == 1 and run.restarts()[0]["signal"] == 9
    assert [r["resumed_from_step"] for r in run.restarts()][:1] == [10]
    assert_no_orphans(run)
    assert final_state(run) == list(range(STEPS))  # resumed from a consistent validated checkpoint
    if faults[0] == "after-interruption:0":
        # The survivors died with the launcher that left them (issue 44; before it, its
        # successor found attempt 0's three survivors running and ended them): the
        # successor's recovery had nothing left to end.
        assert run.journal("orphans") == []


# --------------------------------------------------------------------------- commands, real broker


def send(bootstrap: str, topic: str, command: Command) -> None:
    signed = auth.sign(command, auth.run_key(SECRET.encode(), command.run_id))
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, key=command.run_id.encode(), value=encode(signed))
    assert producer.flush(30) == 0


def acks_of(
    bootstrap: str, topics: TopicNames, command_id: str, wait_s: float = 60.0, settle_s: float = 2.0
) -> list[Ack]:
    """The acks of `command_id`: waits up to `wait_s` for the first, then `settle_s` more
    so that an unexpected second ack would be seen too."""

    def of_command(seen: list[Seen]) -> list[Ack]:
        acks = [a for a in (decode(s.value, ACKS) for s in seen) if isinstance(a, Ack)]
        return [a for a in acks if a.command_id == command_id]

    reader = TopicReader(bootstrap, topics.acks)
    try:
        reader.until(lambda seen: bool(of_command(seen)), wait_s)
        return of_command(reader.settle(settle_s))
    finally:
        reader.close()


def wait_for(path: Path, proc: subprocess.Popen[str], run: Run, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, logs(run)
        time.sleep(0.05)


def checkpoint(run: Run, step: int) -> None:
    d = run.ckpt / f"step-{step:09d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps(list(range(step + 1))))
    (d / "MANIFEST.json").write_text("{}")
    (d / "VALIDATED").write_text("ok")


def reason() -> Reason:
    return Reason(code=ReasonCode.OPERATOR, text="launcher restart test")


@pytest.mark.broker
@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        # The QuarantineNode's effect journaled, the launcher killed before the ack: the
        # successor keeps the node out (no un-quarantine) and does not execute it again.
        ("after-command:quarantine_node", "quarantine"),
        # The actuator claimed the Rollback, the launcher died before executing it: the
        # successor executes it once (it was not executed) and resumes from its step.
        ("before-command:rollback", "rollback"),
        # The Rollback executed and journaled, not acked, not acted upon: acted upon once.
        ("after-command:rollback", "rollback"),
    ],
)
def test_launcher_killed_mid_command(
    bootstrap: str, topics: TopicNames, tmp_path: Path, fault: str, kind: str
) -> None:
    run = make_run(tmp_path)
    for step in (5, 10):
        checkpoint(run, step)
    prefix = topics.commands.removesuffix("trainguard.commands")
    hang = {"FAKE_HANG": "0"}  # attempt 0 resumes from 10 and hangs: only a command ends it
    first = launch(run, fault, hang, broker=(bootstrap, prefix), decision_wait_s=2)
    wait_for(run.out / "env-0-3.json", first, run)  # spawned, so the actuator is ready
    if kind == "quarantine":
        command: Command = QuarantineNode(
            command_id=f"q-{uuid.uuid4().hex[:8]}", run_id=run.run_id, attempt=0, issued_ts=time.time(),
            reason=reason(), node="node-0001",
        )  # fmt: skip
    else:
        command = Rollback(
            command_id=f"rb-{uuid.uuid4().hex[:8]}", run_id=run.run_id, attempt=0, issued_ts=time.time(),
            reason=reason(), checkpoint_step=5, uri="",
        )  # fmt: skip
    send(bootstrap, topics.commands, command)
    killed(first, run)
    started = time.monotonic()
    finished(launch(run, env=hang, broker=(bootstrap, prefix), decision_wait_s=2), run)
    assert time.monotonic() - started < 45, "the successor waited out the dead launcher's group session"
    acks = acks_of(bootstrap, topics, command.command_id)
    assert executed_once(acks).held
    if fault.startswith("before-command"):  # never executed before the kill: executed now, once
        assert [a.status for a in acks] == [AckStatus.EXECUTED]
    else:  # executed and journaled before the kill (its ack died with it): not again
        assert [a.status for a in acks] == [AckStatus.DUPLICATE]
    records = [r for r in run.journal("command") if r["key"] == command.command_id]
    assert len(records) == 1 and records[0]["ok"]
    assert_no_orphans(run)
    if kind == "quarantine":
        # Attempt 0's ranks were running when the launcher died (and died with it): its death
        # is the restart.
        assert_restarted_once_each(run, ["launcher"])
        nodes = [json.loads((run.out / f"env-1-{r}.json").read_text())["TRAINGUARD_NODE"] for r in range(4)]
        assert nodes == ["node-0000", "node-0000", "spare-0000", "spare-0000"]
        assert final_state(run) == list(range(STEPS))
    else:
        # The accepted Rollback is the restart, once, from its step.
        assert_restarted_once_each(run, ["rollback"])
        (restart,) = run.restarts()
        assert (restart["command_id"], restart["resumed_from_step"]) == (command.command_id, 5)
        assert len([r for r in run.journal("take") if r["key"] == command.command_id]) == 1
        assert final_state(run) == list(range(STEPS))


# --------------------------------------------------------------------------- the rank side

#: A rank's Supervisor (no model: its actuator and handlers are what is tested) whose
#: SkipUpdate handler, once executed, records the execution and, with KILL_BEFORE_ACK,
#: SIGKILLs the process before the actuator can ack it or commit its offset.
SUPERVISED_RANK = textwrap.dedent(
    """
    import os, signal, time
    from pathlib import Path
    from trainguard.producers.training.supervisor import Supervisor
    from trainguard.schemas import SkipUpdate
    sup = Supervisor.from_env()
    out = Path(os.environ["FAKE_OUT"])
    def executed_then_killed(command, rank):
        detail = sup.handlers.skip_update(command, rank)
        with (out / "executed.txt").open("a") as fh:
            fh.write(f"{command.command_id} {rank}\\n")
        if os.environ.get("KILL_BEFORE_ACK"):
            os.kill(os.getpid(), signal.SIGKILL)
        return detail
    sup.actuator.register(SkipUpdate, executed_then_killed)
    assert sup.actuator.wait_ready(120)
    (out / f"ready-{os.getpid()}").write_text("")
    while not (out / "stop").exists():
        time.sleep(0.05)
    sup.close()
    """
)


@pytest.mark.broker
@pytest.mark.timeout(420)
def test_rank_supervisor_killed_between_executing_and_acking(
    bootstrap: str, topics: TopicNames, tmp_path: Path
) -> None:
    run = make_run(tmp_path)
    (tmp_path / "sup.py").write_text(SUPERVISED_RANK)
    env = {
        **os.environ, "FAKE_OUT": str(run.out), "TRAINGUARD_SECRET": SECRET, "RANK": "1", "WORLD_SIZE": "2",
        "TRAINGUARD_RUN_ID": run.run_id, "TRAINGUARD_ATTEMPT": "0", "TRAINGUARD_NODE": "node-0000",
        "TRAINGUARD_BOOTSTRAP": bootstrap, "TRAINGUARD_TOPIC_PREFIX": topics.commands.removesuffix(
            "trainguard.commands"), "TRAINGUARD_RUN_DIR": str(run.run_dir),
    }  # fmt: skip
    env.pop("TRAINGUARD_SECRET_FILE", None)

    def start(**extra: str) -> subprocess.Popen[str]:
        log = (run.workdir / f"launcher-{time.monotonic_ns()}.log").open("w")
        argv = [sys.executable, str(tmp_path / "sup.py")]
        proc = subprocess.Popen(argv, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT, text=True)
        wait_for(run.out / f"ready-{proc.pid}", proc, run, 150)
        return proc

    first = start(KILL_BEFORE_ACK="1")
    skip = SkipUpdate(
        command_id=f"skip-{uuid.uuid4().hex[:8]}", run_id=run.run_id, attempt=0, ranks=[1], issued_ts=1.0,
        step=10**6, reason=reason(),
    )  # fmt: skip
    send(bootstrap, topics.commands, skip)
    killed(first, run)
    # The same rank restarted in the same attempt (same actuator instance, group and journal):
    # the command comes back (its offset was never committed) and is answered DUPLICATE.
    started = time.monotonic()
    second = start()
    acks = acks_of(bootstrap, topics, skip.command_id, wait_s=120)
    (run.out / "stop").write_text("")
    assert second.wait(30) == 0, logs(run)
    assert [(a.status, a.rank) for a in acks] == [(AckStatus.DUPLICATE, 1)], acks
    assert (run.out / "executed.txt").read_text().splitlines() == [f"{skip.command_id} 1"]
    # The actuator assigns its partitions itself (no group membership), so the restarted
    # rank reads the command at once (~2 s here) rather than after the dead member's
    # session expired and its group rebalanced (45-250 s when it subscribed).
    assert time.monotonic() - started < 40


# --------------------------------------------------------------------------- real torch ranks


def test_torch_run_with_its_launcher_killed_mid_restart_ends_bitwise(tmp_path: Path) -> None:
    """The README's example on 4 gloo ranks: rank 3 SIGKILLed at step 27, the launcher
    SIGKILLed with the interruption journaled and the survivors still up (they die with
    it); its successor resumes from the newest validated checkpoint (19) and the run ends
    with the uninterrupted run's weights, bit for bit."""
    env = {"TRAIN_STEPS": "40", "TRAIN_CHECKPOINT_EVERY": "10", "OMP_NUM_THREADS": "1"}
    clean = make_run(tmp_path / "clean")
    finished(launch(clean, env=env, script=EXAMPLE), clean, 120)
    run = make_run(tmp_path / "faulted")
    faulted = {**env, "TRAINGUARD_EXAMPLE_FAULT": "kill:3:27:0"}
    killed(launch(run, "after-interruption:0", faulted, script=EXAMPLE), run, 120)
    finished(launch(run, env=faulted, script=EXAMPLE), run, 120)
    assert_restarted_once_each(run, ["crash"])
    assert run.restarts()[0]["resumed_from_step"] == 19
    assert_no_orphans(run)
    expected = torch.load(clean.run_dir / "final.pt")
    got = torch.load(run.run_dir / "final.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights diverged"
