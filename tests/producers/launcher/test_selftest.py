"""The node self-test: known-answer GEMMs exact in every dtype, a real two-process gloo
all-reduce, the chaos knob's wrong device failing it, and `trainguard selftest`."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from trainguard.cli import app
from trainguard.producers.chaos.device_fault import (
    ENV_WRONG_DEVICE,
    install_wrong_device,
    uninstall_wrong_device,
)
from trainguard.producers.launcher import node_selftest as selftest
from trainguard.producers.launcher.config import PRELOAD
from trainguard.producers.launcher.fork_server import ForkServers
from trainguard.producers.launcher.node_selftest import (
    GEMM_SHAPES,
    CheckResult,
    NodeSelfTestReport,
    gemm_check,
    known_operands,
    run_node_self_test,
)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("bound", "exact_to"), [(3, 2**24), (1, 2**8)])  # fp32, bf16 (fp16: 2**11)
def test_every_partial_sum_of_the_known_products_is_exactly_representable(bound: int, exact_to: int) -> None:
    for i, (m, k, n) in enumerate(GEMM_SHAPES):
        a, b = known_operands(m, k, n, bound, seed=i)
        assert np.abs(a).max() <= bound and np.abs(b).max() <= bound
        # Whatever the kernel's order, a partial sum adds at most k terms of |a||b| <= bound^2.
        assert k * bound * bound <= exact_to


def test_gemm_is_exact_on_a_right_device_and_fails_on_a_deterministically_wrong_one() -> None:
    right = gemm_check(torch.device("cpu"), ["float32", "bfloat16"])
    assert right.passed and right.detail == "6 products exact (float32, bfloat16)"
    install_wrong_device(1e-3)  # the wrong device is the same every time: a replay would agree
    try:
        wrong = gemm_check(torch.device("cpu"), ["float32"], local_rank=1)
    finally:
        uninstall_wrong_device()
    assert not wrong.passed and wrong.local_rank == 1
    assert wrong.detail.startswith("float32 64x64x64: ") and "entries wrong, max error" in wrong.detail


@pytest.mark.parametrize("started", ["new", "forked"])
def test_two_workers_one_struck_by_the_chaos_knob_fail_gemm_there_only(started: str) -> None:
    """Real worker processes, as the launcher starts them (new interpreters, or forked from
    the ranks' fork server, the launcher's default): gloo all-reduce across both."""
    knob = {ENV_WRONG_DEVICE: "node=node-0001,local_rank=1,from_step=40,bias=1e-3"}
    if started == "new":
        report = run_node_self_test("node-0001", 2, env=knob, timeout_s=240)
    else:
        servers = ForkServers(PRELOAD, [sys.executable, "-m", "json.tool"], dict(os.environ))
        forked: list[Any] = []

        def fork(argv: list[str], env: dict[str, str]) -> Any:
            forked.append(servers.popen(argv, env))
            return forked[-1]

        try:
            server = servers.get({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            assert server is not None
            report = run_node_self_test("node-0001", 2, env=knob, timeout_s=240, fork=fork)
        finally:
            servers.close()
        assert len(forked) == 2 and all(w is not None and w.process.server is server for w in forked)
    by = {(r.test, r.local_rank): r for r in report.results}
    assert set(by) == {("gemm", 0), ("gemm", 1), ("collective", 0), ("collective", 1)}, report.errors
    assert by[("gemm", 0)].passed and not by[("gemm", 1)].passed
    assert by[("collective", 0)].passed and by[("collective", 1)].passed  # reductions are not products
    assert "over 2 rank(s) exact" in by[("collective", 1)].detail
    assert not report.passed and report.failed_tests == ["gemm"] and report.errors == []
    assert report.summary().startswith("node node-0001 failed: gemm on local rank 1 (float32 64x64x64")
    data = report.to_json()
    assert data["passed"] is False and data["failed_tests"] == ["gemm"] and len(data["results"]) == 4


def test_a_worker_that_cannot_start_fails_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    report = run_node_self_test("node-0000", 2, ["gemm"], timeout_s=30)
    assert not report.passed and report.results == [] and report.failed_tests == ["gemm"]
    assert report.errors == [f"local rank {r}: worker exited 1: no output" for r in (0, 1)]
    with pytest.raises(ValueError, match="tests must be some of"):
        run_node_self_test("node-0000", 2, ["memtest"])


def _report(passed: bool) -> NodeSelfTestReport:
    report = NodeSelfTestReport("n7", ["gemm"], wall_s=1.5)
    detail = "6 products exact (float32, bfloat16)" if passed else "float32 64x64x64: 9 of 4096 entries wrong"
    report.results = [CheckResult("gemm", 0, "cpu", passed, detail, 0.01)]
    return report


def test_cli_exit_status_and_json_follow_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    def fake(node: str, nproc: int, tests: list[str], timeout_s: float) -> NodeSelfTestReport:
        calls.append((node, nproc, tests, timeout_s))
        return _report(passed=node == "good")

    monkeypatch.setattr(selftest, "run_node_self_test", fake)
    runner = CliRunner()
    ok = runner.invoke(app, ["selftest", "--node", "good", "--nproc-per-node", "3", "--tests", "gemm"])
    assert ok.exit_code == 0, ok.output
    assert "node n7 passed gemm on 1 device(s)" in ok.output
    bad = runner.invoke(app, ["selftest", "--node", "bad", "--json"])
    assert bad.exit_code == 1
    data = json.loads(bad.output)
    assert data["passed"] is False and data["failed_tests"] == ["gemm"]
    assert calls[0] == ("good", 3, ["gemm"], 120.0) and calls[1][2] == ["gemm", "collective"]
    assert calls[1][1] >= 1  # LOCAL_WORLD_SIZE, the GPUs, else 2
