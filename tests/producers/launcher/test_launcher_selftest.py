"""The launcher runs node self-tests (issue 15 item 6): on a quarantined node once its ranks
have left it and the restart is done, on every idle spare from the start of the run (and
again when its pass is older than the freshness bound), so a restart waits for none; a
node that fails stays out (quarantined, never released), and each result goes out as
NodeSelfTestResult with its reason. The fake ranks of test_launcher; the self-test is a
double at its boundary (producers/launcher/node_selftest.py has the real one's tests)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from trainguard.producers.launcher.launcher import Launcher
from trainguard.producers.launcher.node_selftest import CheckResult, NodeSelfTestReport
from trainguard.producers.launcher.spare_selftest import NodeTester
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.rank.gate import CommandGate, GateOutcome, GateVerdict
from trainguard.schemas import (
    RUN_LEVEL_RANK,
    NodeSelfTestResult,
    QuarantineNode,
    Reason,
    ReasonCode,
    ReleaseNode,
    RunNodeSelfTest,
    RunStarted,
    auth,
    encode,
)
from trainguard.schemas import RestartPhases as RestartPhasesEvent

from .test_launcher import make_launcher, passing_self_test

REASON = Reason(code=ReasonCode.OPERATOR, text="test")


class FakeSelfTest:
    """Fails the nodes in `bad`; records which nodes held ranks when each test ran."""

    def __init__(self, bad: set[str]) -> None:
        self.bad = bad
        self.launcher: Launcher | None = None
        self.calls: list[tuple[str, int, list[str], tuple[str, ...], bool]] = []
        self.lock = threading.Lock()

    def __call__(self, node: str, devices: int, tests: Sequence[str]) -> NodeSelfTestReport:
        assert self.launcher is not None
        busy = tuple(sorted(self.launcher._busy))  # nodes with live (or about to start) ranks
        with self.lock:
            self.calls.append((node, devices, list(tests), busy, self.launcher._ended.is_set()))
        report = NodeSelfTestReport(node, list(tests), wall_s=0.5)
        for local_rank in range(devices):
            wrong = node in self.bad and local_rank == 1
            detail = "float32 64x64x64: 4052 of 4096 entries wrong" if wrong else "6 products exact"
            report.results.append(CheckResult("gemm", local_rank, "cpu", not wrong, detail, 0.01))
        return report


def launcher_with(
    tmp_path: Path, sink: MemorySink, bad: set[str], **env: str
) -> tuple[Launcher, FakeSelfTest]:
    fake = FakeSelfTest(bad)
    launcher = make_launcher(tmp_path, sink, env)
    launcher.tester.runner = fake
    fake.launcher = launcher
    return launcher, fake


def quarantine_and_test(launcher: Launcher, node: str, ranks: list[int]) -> list[str]:
    """What the core sends on a wrong answer from `node` (sdc_checks.quarantine)."""
    quarantine = QuarantineNode(
        command_id="q1", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node=node
    )
    test = RunNodeSelfTest(
        command_id="t1", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node=node, ranks=ranks
    )
    return [launcher.handle_quarantine(quarantine, -1), launcher.handle_self_test(test, -1)]


def test_the_command_reaches_the_launchers_actuator_not_the_ranks_it_names() -> None:
    key = auth.run_key(b"s" * 32, "r1")
    test = RunNodeSelfTest(
        command_id="t", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node="node-0001", ranks=[2, 3]
    )
    raw = encode(auth.sign(test, key))
    launcher_side = CommandGate("r1", 0, (RUN_LEVEL_RANK,), key)
    rank_side = CommandGate("r1", 0, (2, 3), key)  # the node's own ranks: no handler there
    assert launcher_side.admit(raw)[1] == {RUN_LEVEL_RANK: GateVerdict.EXECUTE}
    decision, verdicts = rank_side.admit(raw)
    assert decision.outcome is GateOutcome.ACCEPTED and verdicts == {} and rank_side.counters.untargeted == 1


def test_a_quarantined_node_is_tested_once_its_ranks_left_and_stays_out_when_it_fails(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher, fake = launcher_with(tmp_path, sink, {"node-0001"}, FAKE_KILL="2:4:0")
    launcher.config = type(launcher.config)(**{**launcher.config.__dict__, "self_test_spares": "on-demand"})
    details: list[str] = []
    launcher.on_attempt = lambda attempt: details.extend(
        quarantine_and_test(launcher, "node-0001", [2, 3]) if attempt == 0 else []
    )
    result = launcher.run()
    assert result.status == "ok", result.reason
    want = (
        "node-0001: gemm, collective self-test once its ranks have left it and the restart is done; "
        "its result: node_self_test_result"
    )
    assert details[1] == want
    # The spare was tested before it joined (on demand: from the quarantine on); node-0001
    # only once no rank of the job was on it.
    tested = {call[0]: call for call in fake.calls}
    assert set(tested) == {"spare-0000", "node-0001"}
    events = list(sink.events)
    spare_tested = next(
        i for i, e in enumerate(events) if isinstance(e, NodeSelfTestResult) and e.node == "spare-0000"
    )
    spare_joined = next(i for i, e in enumerate(events) if isinstance(e, RunStarted) and e.attempt == 1)
    assert spare_tested < spare_joined
    node, devices, tests, busy, ended = tested["node-0001"]
    assert (devices, tests) == (2, ["gemm", "collective"])
    assert ended or "node-0001" not in busy  # after attempt 0's ranks were gone
    # ...and after the restart it would only have slowed: attempt 1's first steps came first.
    restarted = next(i for i, e in enumerate(events) if isinstance(e, RestartPhasesEvent))
    suspect_tested = next(
        i for i, e in enumerate(events) if isinstance(e, NodeSelfTestResult) and e.node == "node-0001"
    )
    assert restarted < suspect_tested
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"], ["node-0000", "spare-0000"]]
    results = {r.node: r for r in sink.of(NodeSelfTestResult)}
    spare, suspect = results["spare-0000"], results["node-0001"]
    assert (spare.passed, spare.purpose, spare.command_id, spare.rank) == (True, "spare", "", -1)
    assert spare.reason.code == ReasonCode.NODE_SELF_TEST_PASSED and spare.devices == 2
    assert (suspect.passed, suspect.purpose, suspect.command_id) == (False, "quarantine", "t1")
    assert suspect.failed_tests == ["gemm"] and suspect.reason.code == ReasonCode.NODE_SELF_TEST_FAILED
    assert suspect.reason.text == (
        "node node-0001 failed: gemm on local rank 1 (float32 64x64x64: 4052 of 4096 entries wrong)"
    )
    # It stays out: a release (e.g. a repeat-step pattern) is refused.
    release = ReleaseNode(
        command_id="rel", run_id="r1", attempt=1, issued_ts=2.0, reason=REASON, node="node-0001"
    )
    with pytest.raises(ValueError, match="node-0001 stays out of the pool: it failed its self-test"):
        launcher.handle_release(release, -1)
    assert "node-0001" in launcher.quarantined


def test_a_spare_that_fails_its_self_test_never_joins(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher, fake = launcher_with(tmp_path, sink, {"spare-0000"}, FAKE_KILL="2:4:0")
    launcher.on_attempt = lambda attempt: (
        launcher.handle_quarantine(
            QuarantineNode(
                command_id="q1", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node="node-0001"
            ),
            -1,
        )
        if attempt == 0
        else None
    )
    result = launcher.run()
    assert result.status == "ok", result.reason
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"], ["node-0000", "spare-0001"]]
    assert [c[0] for c in fake.calls] == ["spare-0000", "spare-0001"]  # each once, in pool order
    assert {"node-0001", "spare-0000"} <= launcher.quarantined
    assert sorted((r.node, r.passed, r.purpose) for r in sink.of(NodeSelfTestResult)) == [
        ("spare-0000", False, "spare"),
        ("spare-0001", True, "spare"),
    ]


def test_spares_join_untested_when_the_self_test_is_off(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher, fake = launcher_with(tmp_path, sink, set(), FAKE_KILL="2:4:0")
    launcher.config = type(launcher.config)(**{**launcher.config.__dict__, "self_test_spares": "off"})
    launcher.on_attempt = lambda attempt: (
        launcher.handle_quarantine(
            QuarantineNode(
                command_id="q1", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node="node-0001"
            ),
            -1,
        )
        if attempt == 0
        else None
    )
    assert launcher.run().status == "ok"
    assert fake.calls == [] and sink.of(NodeSelfTestResult) == []


def test_by_default_every_spare_is_tested_from_the_start_one_at_a_time(tmp_path: Path) -> None:
    sink = MemorySink()
    launcher, fake = launcher_with(tmp_path, sink, {"spare-0001"})
    assert launcher.config.self_test_spares == "ahead"  # the default: restarts wait for no test
    assert launcher.run().status == "ok"
    assert [c[0] for c in fake.calls] == ["spare-0000", "spare-0001"]  # no quarantine needed
    assert [(r.node, r.passed) for r in sink.of(NodeSelfTestResult)] == [
        ("spare-0000", True),
        ("spare-0001", False),
    ]
    assert "spare-0001" in launcher.quarantined and "spare-0000" not in launcher.quarantined


def test_a_restart_onto_a_spare_proven_ahead_waits_for_no_test(tmp_path: Path) -> None:
    """The default: the spare passed its test while the run trained, so the restart after a
    quarantine spawns on it at once (its one test came before the quarantine)."""
    sink = MemorySink()
    launcher, fake = launcher_with(tmp_path, sink, set(), FAKE_KILL="2:4:0", FAKE_KILL_AFTER_CKPT="0")
    quarantined: list[str] = []

    def on_attempt(attempt: int) -> None:
        if attempt == 0:
            assert launcher.tester.wait("spare-0000", 30) is not None  # proven while training
            quarantined.append(launcher.handle_quarantine(quarantine("node-0001"), -1))

    launcher.on_attempt = on_attempt
    assert launcher.run().status == "ok"
    assert quarantined and [c[0] for c in fake.calls].count("spare-0000") == 1
    assert [s.nodes for s in sink.of(RunStarted)] == [["node-0000", "node-0001"], ["node-0000", "spare-0000"]]


def test_a_pass_goes_stale_after_its_freshness_bound_and_is_renewed() -> None:
    now = [0.0]
    calls: list[str] = []

    def runner(node: str, devices: int, tests: Sequence[str]) -> NodeSelfTestReport:
        calls.append(node)
        return passing_self_test(node, devices, tests)

    tester = NodeTester(runner, 2, lambda *a: None, lambda node: None, fresh_s=600.0, clock=lambda: now[0])
    assert not tester.fresh("spare-0000")
    assert tester.start("spare-0000", ["gemm"], "spare") and tester.wait("spare-0000", 10) is not None
    assert tester.fresh("spare-0000") and tester.age_s("spare-0000") == 0.0
    now[0] = 599.0
    assert tester.fresh("spare-0000") and not tester.start("spare-0000", ["gemm"], "spare")  # still good
    now[0] = 601.0
    assert not tester.fresh("spare-0000")  # a spare needed now is tested again before it joins
    assert tester.start("spare-0000", ["gemm"], "spare") and tester.wait("spare-0000", 10) is not None
    assert calls == ["spare-0000", "spare-0000"] and tester.fresh("spare-0000")


def quarantine(node: str) -> QuarantineNode:
    return QuarantineNode(command_id="q1", run_id="r1", attempt=0, issued_ts=1.0, reason=REASON, node=node)
