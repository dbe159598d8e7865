"""The rank side's command handlers, called with real signed commands (no broker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.rank.gate import CommandGate, GateVerdict
from trainguard.producers.rank.handlers import REQUESTED_EXIT_CODE, TooLate, stack_signature
from trainguard.producers.training.supervisor import Supervisor, SupervisorConfig
from trainguard.schemas import (
    CheckpointNow,
    Command,
    RankExit,
    Reason,
    ReasonCode,
    Rollback,
    RunSelfCheck,
    SetCheckpointInterval,
    SkipUpdate,
    auth,
    encode,
)

SECRET = b"s" * 32
RUN = "run-h"
KEY = auth.run_key(SECRET, RUN)


def signed(cls: type[Command], command_id: str, **fields: Any) -> Any:
    """A command as the processors send it, passed through the actuator's gate."""
    command = auth.sign(
        cls(command_id=command_id, run_id=RUN, attempt=0, issued_ts=1.0,
            reason=Reason(code=ReasonCode.OPERATOR, text="test"), **fields),
        KEY,
    )  # fmt: skip
    gate = CommandGate(RUN, 0, [0], KEY)
    decision, verdicts = gate.admit(encode(command))
    assert verdicts == {0: GateVerdict.EXECUTE}
    return decision.command


class Manager:
    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, step: int) -> str:
        self.saved.append(step)
        return f"handle-{step}"


def supervisor(tmp_path: Path, **kw: Any) -> tuple[Supervisor, MemorySink]:
    sink = MemorySink()
    model = torch.nn.Linear(4, 1)
    sup = Supervisor(RUN, sink=sink, model=model, run_dir=tmp_path, gpu_reader=None, **kw)
    return sup, sink


def one_step(sup: Supervisor, step: int, batch: torch.Tensor | None = None) -> bool:
    model = sup.model
    assert model is not None
    with sup.step(step, batch if batch is not None else torch.ones(2, 4)) as s:
        loss = model(s.batch).sum()
        loss.backward()
        s.compute_done()
        applied = s.check(loss)
        model.zero_grad()
    return applied


def test_checkpoint_now_and_interval(tmp_path: Path) -> None:
    manager = Manager()
    sup, _ = supervisor(tmp_path, checkpoint=manager)
    one_step(sup, 0)
    detail = sup.handlers.checkpoint_now(signed(CheckpointNow, "c1"), 0)
    assert detail.startswith("checkpoint at the next step boundary")
    one_step(sup, 1)
    one_step(sup, 2)
    assert manager.saved == [1]
    assert sup.handlers.set_interval(signed(SetCheckpointInterval, "c2", interval_s=60.0), 0) == (
        "checkpoint every 60s"
    )
    now = time.monotonic()
    assert not sup.should_checkpoint(3, now=now)
    assert sup.should_checkpoint(3, now=now + 61)
    sup.close()


def test_a_loop_that_saves_itself_asks_should_checkpoint_after_the_step(tmp_path: Path) -> None:
    """No manager given: the answer agreed in check() for that step, once; the interval in
    force counts in steps of the measured step time (here ~1 ms a step: 0.02 s is many)."""
    sup, _ = supervisor(tmp_path, config=SupervisorConfig(checkpoint_interval_s=3600.0))
    saved = []
    for step in range(8):
        one_step(sup, step)
        if sup.should_checkpoint(step):
            saved.append(step)
            sup.checkpoint_saved(step)
        assert not sup.should_checkpoint(step)  # saved, or agreed not due: asking again changes nothing
    assert saved == [] and sup.cadence.interval_s == 3600.0  # the launcher's interval, not passed yet
    sup.handlers.checkpoint_now(signed(CheckpointNow, "c1"), 0)
    one_step(sup, 8)
    assert sup.should_checkpoint(8)
    sup.checkpoint_saved(8)
    sup.handlers.set_interval(signed(SetCheckpointInterval, "c2", interval_s=1e-9), 0)
    one_step(sup, 9)
    assert sup.should_checkpoint(9) and sup.cadence.steps_per_checkpoint() == 1
    assert sup.counters.checkpoints == 1
    sup.close()


def test_a_fixed_cadence_replaces_the_interval(tmp_path: Path) -> None:
    manager = Manager()
    sup, _ = supervisor(tmp_path, checkpoint=manager, checkpoint_every_steps=5)
    sup.handlers.set_interval(signed(SetCheckpointInterval, "c3", interval_s=1e-9), 0)
    for step in range(12):
        one_step(sup, step)
    assert manager.saved == [4, 9] and sup.config.checkpoint_every_steps == 5
    sup.close()


def test_skip_update_before_and_after_the_step(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path)
    one_step(sup, 0)
    assert sup.handlers.skip_update(signed(SkipUpdate, "s1", step=2), 0) == "update of step 2 will be skipped"
    assert one_step(sup, 1)
    assert not one_step(sup, 2)
    assert sup.counters.commanded_skips == 1
    with pytest.raises(TooLate, match="step 1 was already applied"):
        sup.handlers.skip_update(signed(SkipUpdate, "s2", step=1), 0)
    assert "already skipped" in sup.handlers.skip_update(signed(SkipUpdate, "s3", step=2), 0)
    sup.close()


def test_run_self_check_needs_a_replay_function(tmp_path: Path) -> None:
    sup, sink = supervisor(tmp_path)
    one_step(sup, 0)
    with pytest.raises(RuntimeError, match="no replay function"):
        sup.handlers.run_self_check(signed(RunSelfCheck, "r1", step=0), 0)
    model = sup.model
    assert model is not None
    sup.replay_fn = lambda batch: model(batch).sum().backward()
    assert sup.handlers.run_self_check(signed(RunSelfCheck, "r2", step=0), 0) == (
        "self-check at the first step >= 1"
    )
    one_step(sup, 1)
    assert [r.passed for r in sup.self_check_results] == [True]
    sup.close()


def test_rollback_reports_the_exit_and_terminates(tmp_path: Path) -> None:
    codes: list[int] = []
    sup, sink = supervisor(tmp_path, config=SupervisorConfig(exit_grace_s=0.05), terminate=codes.append)
    one_step(sup, 0)
    command = signed(Rollback, "rb", checkpoint_step=100, uri="file:///ck/100")
    assert "restarts from checkpoint 100" in sup.handlers.restart_from(command, 0)
    assert sup.handlers.restart_from(command, 0) == "already exiting"
    assert sup.handlers.exit_thread is not None
    sup.handlers.exit_thread.join(5)
    assert codes == [REQUESTED_EXIT_CODE]
    (exit_event,) = sink.of(RankExit)
    assert exit_event.requested and exit_event.exit_code == REQUESTED_EXIT_CODE


def test_stack_signature_names_the_innermost_frames() -> None:
    def inner() -> str:
        return stack_signature(sys._getframe(), depth=2)

    assert inner() == "test_rank_handlers.py:test_stack_signature_names_the_innermost_frames>" + (
        "test_rank_handlers.py:inner"
    )


ABORT_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    import torch
    from trainguard.producers.training.supervisor import Supervisor, SupervisorConfig
    from trainguard.schemas import Abort, Reason, ReasonCode, auth

    out = Path(sys.argv[1])

    class FileSink:  # every event to a file at once: the process dies abruptly
        def submit(self, event):
            with open(out / "events.jsonl", "a") as fh:
                fh.write(json.dumps({"kind": event.KIND, **event.model_dump(mode="json")}) + "\\n")
            return True

    sup = Supervisor("run-h", sink=FileSink(), model=torch.nn.Linear(2, 1), run_dir=out,
                     gpu_reader=None, config=SupervisorConfig(exit_grace_s=0.2))

    def spin_forever():
        x = 0
        while True:
            x += 1

    def wait_in_collective():  # the training thread, stuck
        while True:
            time.sleep(0.01)

    threading.Thread(target=spin_forever, name="stuck-worker", daemon=True).start()
    key = auth.run_key(b"s" * 32, "run-h")
    abort = auth.sign(Abort(command_id="a1", run_id="run-h", attempt=0, issued_ts=1.0,
                            reason=Reason(code=ReasonCode.NO_PROGRESS, text="hang")), key)

    def actuator():  # the handler runs on the actuator's thread, as in production
        time.sleep(0.3)
        detail = sup.handlers.abort(abort, 0)
        (out / "detail.txt").write_text(detail)

    threading.Thread(target=actuator, name="trainguard-actuator", daemon=True).start()
    with sup.step(0):
        wait_in_collective()
    """
)


def test_abort_dumps_every_thread_reports_and_exits(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(ABORT_SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], timeout=60, capture_output=True, text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": ""},
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode == REQUESTED_EXIT_CODE, proc.stderr
    assert elapsed < 15  # interpreter and torch import included; the exit itself is ~0.2 s
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (exit_event,) = [e for e in events if e["kind"] == "rank_exit"]
    assert exit_event["requested"] and exit_event["exit_code"] == REQUESTED_EXIT_CODE
    assert exit_event["stack_signature"].endswith("rank.py:wait_in_collective")
    dump = Path(exit_event["stack_dump_ref"])
    assert dump == (tmp_path / "attempt-0" / "stacks" / "rank-00000.txt").resolve()
    text = dump.read_text()
    for name in ("MainThread", "stuck-worker", "trainguard-actuator"):
        assert name in text
    assert "spin_forever" in text and "wait_in_collective" in text
    assert "Current thread" in text or "Thread 0x" in text  # faulthandler's part
    assert "signature" in (tmp_path / "detail.txt").read_text()
