"""DrainNode in the launcher (issue 46) with the fake ranks of test_launcher.py (full
restarts: the eviction path), the handler's refusals and its journal, and the deadline the
control store's resize key carries to the ranks (the in-process path end to end, real
torch ranks through a real broker: test_drain_broker.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from trainguard.producers.launcher.plan import plan
from trainguard.producers.launcher.records import RestartCause, RestartPhases
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.training import inprocess
from trainguard.schemas import DrainNode, RankExit, Reason, ReasonCode, RunStarted

from .test_launcher import make_launcher, seen_env


def drain(node: str, command_id: str = "d1", within_s: float = 30.0) -> DrainNode:
    reason = Reason(code=ReasonCode.DRAIN, text="P(fail within 1 h) 0.6: ecc_corrected")
    return DrainNode(
        command_id=command_id, run_id="r1", attempt=0, issued_ts=time.time(), reason=reason,
        node=node, within_s=within_s,
    )  # fmt: skip


def test_a_drain_under_full_restarts_stops_at_the_next_validated_checkpoint_on_a_spare(
    tmp_path: Path,
) -> None:
    sink = MemorySink()
    launcher = make_launcher(tmp_path, sink, {"FAKE_STEPS": "60", "FAKE_LOCKSTEP": "1"})
    handle = launcher.command_handlers()[DrainNode]  # journaled, as the actuator runs it
    details: list[str] = []
    errors: list[str] = []

    def send() -> None:
        first = tmp_path / "ckpt" / f"step-{5:09d}" / "VALIDATED"
        while not first.exists():
            time.sleep(0.005)
        details.append(handle(drain("node-0001"), -1))
        details.append(handle(drain("node-0001"), -1))  # the same command again: answered, not redone
        for node, command_id in (("node-0001", "d2"), ("node-0099", "d3")):
            try:
                handle(drain(node, command_id), -1)
            except ValueError as exc:
                errors.append(str(exc))
        details.append(handle(drain("spare-0001", "d4"), -1))  # idle: out, nothing to drain

    launcher.on_attempt = lambda a: threading.Thread(target=send).start() if a == 0 else None
    result = launcher.run()
    assert result.status == "ok", result.reason
    first, again, idle = details
    assert first == again and first.startswith("node-0001 (ranks 2, 3) drains at attempt 0's next checkpoint")
    after = int(first.split("validated after step ")[1].split(")")[0])
    assert errors == [
        "node-0001 is already draining: it leaves at attempt 0's boundary",
        "node node-0099 is not in the pool",
    ]
    assert idle == "spare-0001 holds no rank of attempt 0: it leaves the pool (nothing to drain)"

    [restart] = result.restarts
    assert (restart.cause, restart.node, restart.command_id) == (RestartCause.DRAIN, "node-0001", "d1")
    boundary = int(restart.detail.split("once the checkpoint of step ")[1].split(" ")[0])
    assert after < boundary <= restart.resumed_from_step  # the first newer one, or a newer still
    assert all(e.requested for e in sink.of(RankExit) if e.attempt == 0)
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"], ["node-0000", "spare-0000"]]
    assert seen_env(tmp_path, 1, 2)["TRAINGUARD_NODE"] == "spare-0000"
    # The journal keeps both quarantines: a relaunch does not take the drained node back.
    assert make_launcher(tmp_path, MemorySink(), {}).quarantined == {"node-0001", "spare-0001"}


def test_a_drained_nodes_live_ranks_do_not_count_toward_the_next_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic training (--min-nproc 2): after node-0001's drain its two ranks are alive but
    go on nowhere; with no warm spare ready the survivors on node-0000 go on at world 2
    (and grow back later); with two ready, the world stays 4 on spare-0000."""
    launcher = make_launcher(tmp_path, MemorySink(), {}, restart="in-process", min_nproc=2)
    try:
        hot = launcher.attempts.hot
        assert hot is not None
        monkeypatch.setattr(hot, "survivors", lambda: [0, 1, 2, 3])  # every rank left in its process
        launcher.state.placement = plan(launcher.pool, set(), 4)
        launcher.state.quarantined.add("node-0001")
        reason = "node-0001 drained and too few warm spares ready for its ranks: 2 of 4 ranks go on"
        for ready, size, decision in ((0, 2, "shrink"), (2, 4, "")):
            monkeypatch.setattr(hot, "ready", lambda ready=ready: ready)
            pending = RestartPhases(
                "r1", 0, RestartCause.DRAIN, "", 0, None, -1, "node-0001", None, None, "d1", 0, 0
            )
            pending.path = "in-process"
            assert (launcher._size(pending), pending.decision) == (size, decision)
            assert pending.decision_reason == (reason + ", 2 replaced when ready" if decision else "")
    finally:
        launcher.attempts.close()


def test_the_resize_key_carries_the_drains_deadline_to_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grow's "1" waits TRAINGUARD_GROW_WITHIN_S; a drain's value names its own deadline,
    and the earliest one asked in the attempt holds (a drain after a grow tightens it)."""
    monkeypatch.setenv(inprocess.ENV_GROW_WITHIN_S, "60")
    assert inprocess.resize_within(inprocess.resize_value()) == 60.0
    assert inprocess.resize_within(inprocess.resize_value(2.5, "drain node-0001")) == 2.5
    assert inprocess.resize_within("not json") == 60.0
    watch = inprocess._AbortWatch(None, threading.Event(), threading.Event())
    watch._note_resize("1")
    grow_by = watch.resize_by
    assert grow_by is not None and watch.resizing.is_set()
    watch._note_resize(inprocess.resize_value(0.0, "drain node-0001"))
    assert watch.resize_by is not None and watch.resize_by < grow_by - 59
    tight = watch.resize_by
    watch._note_resize("1")  # read again at the next poll: the earliest deadline stays
    assert watch.resize_by == tight
