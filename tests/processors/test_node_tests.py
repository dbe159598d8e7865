"""The core acts on node self-test results (issue 15 item 6): a node that fails stays out
of the pool for the run (no release takes it back), a spare that fails before joining is
quarantined with the result as the reason, and a pass releases a quarantined node only
where the policy allows it."""

from __future__ import annotations

from harness.streams import Job
from trainguard.processors.core import CorePolicy, run_all
from trainguard.processors.core.accounting.baseline_state import BaselinePolicy
from trainguard.schemas import (
    NodeSelfTestResult,
    PauseRun,
    Quarantine,
    QuarantineNode,
    QuarantineReleased,
    Reason,
    ReasonCode,
    ReleaseNode,
)

POLICY = CorePolicy(baseline=BaselinePolicy(reference_world_size=16))


def of(outputs: list, kind: type) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def self_test(job: Job, node: str, passed: bool, purpose: str = "quarantine") -> NodeSelfTestResult:
    """The launcher's report, as producers/launcher/events.py sends it (rank -1, the node tested)."""
    env = job._env(-1)
    env["node"] = node
    text = (
        f"node {node} passed gemm, collective on 4 device(s) in 6.8s"
        if passed
        else f"node {node} failed: gemm on local rank 1 (float32 64x64x64: 4052 of 4096 entries wrong)"
    )
    code = ReasonCode.NODE_SELF_TEST_PASSED if passed else ReasonCode.NODE_SELF_TEST_FAILED
    result = NodeSelfTestResult(
        **env,
        passed=passed,
        tests=["gemm", "collective"],
        failed_tests=[] if passed else ["gemm"],
        purpose=purpose,
        command_id="cmd-self-test",
        devices=4,
        wall_s=6.8,
        reason=Reason(code=code, text=text),
    )
    job.events.append(result)
    return result


def crashed_on_node_001(job: Job) -> Job:
    """Rank 5 (node-001) crashes: the core quarantines node-001; the run goes on on a spare."""
    job.start().steps(126)
    job.exit(5, exit_code=1)
    job.replace("node-001")
    return job.restart(resumed_from_step=120).steps(5)


def test_a_node_that_failed_its_self_test_stays_out_when_the_step_pattern_would_release_it() -> None:
    # The bad-batch pattern of test_paging: step 126 fails on node-001, then on node-002. The
    # pattern alone gives node-001 back; not once node-001 has failed a known-answer test.
    def run(with_failed_test: bool) -> tuple:
        job = crashed_on_node_001(Job(step_s=60.0, checkpoint_every=10))
        failed = self_test(job, "node-001", passed=False) if with_failed_test else None
        job.exit(9, exit_code=1)  # node-002, the same step
        job.restart(resumed_from_step=120).steps(5)
        return failed, *run_all(job.events, POLICY)

    _, _, control = run(with_failed_test=False)
    assert [r.node for r in of(control, ReleaseNode)] == ["node-001"]
    failed, state, outputs = run(with_failed_test=True)
    assert failed is not None
    assert len(of(outputs, PauseRun)) == 1  # the step pattern is still paged and paused
    assert of(outputs, ReleaseNode) == [] and of(outputs, QuarantineReleased) == []
    assert [q.node for q in of(outputs, QuarantineNode)] == ["node-001"]  # quarantined once, not again
    assert state.runs["run-test"].paging.self_test_failed == {"node-001": failed.event_id}


def test_a_spare_that_fails_before_joining_is_quarantined_with_the_result_as_the_reason() -> None:
    job = crashed_on_node_001(Job(step_s=60.0))
    result = self_test(job, "spare-001", passed=False, purpose="spare")
    self_test(job, "spare-001", passed=False, purpose="spare")  # a second report: nothing new
    _, outputs = run_all(job.events, POLICY)
    quarantine = next(q for q in of(outputs, Quarantine) if q.node == "spare-001")
    command = next(c for c in of(outputs, QuarantineNode) if c.node == "spare-001")
    assert quarantine.reason.code == ReasonCode.NODE_SELF_TEST_FAILED == command.reason.code
    assert quarantine.reason.text.startswith(
        "node spare-001 failed its spare self-test (node spare-001 failed: gemm"
    )
    assert "out of the pool for the rest of the run" in quarantine.reason.text
    assert quarantine.caused_by == [result.event_id] and command.caused_by == [quarantine.event_id]
    assert len([q for q in of(outputs, Quarantine) if q.node == "spare-001"]) == 1


def test_a_pass_releases_a_quarantined_node_only_where_the_policy_allows_it() -> None:
    job = crashed_on_node_001(Job(step_s=60.0))
    passed = self_test(job, "node-001", passed=True)
    self_test(job, "spare-000", passed=True, purpose="spare")  # never out: nothing to release
    _, outputs = run_all(job.events, POLICY)
    assert (
        of(outputs, ReleaseNode) == [] and of(outputs, QuarantineReleased) == []
    )  # default: a human decides
    _, outputs = run_all(job.events, POLICY.model_copy(update={"release_on_self_test_pass": True}))
    (quarantine_command,) = of(outputs, QuarantineNode)
    (released,) = of(outputs, QuarantineReleased)
    (release,) = of(outputs, ReleaseNode)
    assert released.node == release.node == "node-001"
    assert released.reason.code == ReasonCode.NODE_SELF_TEST_PASSED == release.reason.code
    assert released.reason.text.startswith("node node-001 passed its self-test (node node-001 passed gemm")
    assert released.quarantine_id == quarantine_command.command_id and released.caused_by == [passed.event_id]
    assert release.caused_by == [released.event_id]


def test_a_pass_after_a_failure_does_not_bring_the_node_back() -> None:
    job = crashed_on_node_001(Job(step_s=60.0))
    self_test(job, "node-001", passed=False)
    self_test(job, "node-001", passed=True)
    _, outputs = run_all(job.events, POLICY.model_copy(update={"release_on_self_test_pass": True}))
    assert of(outputs, ReleaseNode) == [] and of(outputs, QuarantineReleased) == []
