"""After test_multihost_broker.py's loss (the spare took a lost host's ranks), a hang on
another host with no spare left. The processor names the hung host from the stacks and
quarantines it, and the run stops with a message naming the host, the cause and the
missing spare."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.hosts import journal, kill_tree, log_tail
from trainguard.schemas import HangDetected, Interruption, InterruptionCause, QuarantineNode, ReasonCode

from ...pipeline import Processor
from .test_multihost_broker import (
    STEPS,
    lose_host_b_with_a_spare_waiting,
    module_processor,
    outputs,
    starter,
    supervised,
)

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    yield from module_processor(bootstrap, tmp_path_factory)


def test_then_a_hang_on_another_host_with_no_spare_left_stops_the_run_naming_it(
    pipeline: Processor, tmp_path: Path
) -> None:
    """The spare took host-b's ranks; then a rank of the new world hangs (the example's
    fault plan: rank 5 sleeps in step 90 of attempt 1). The processor names its host from
    the stacks and quarantines it; the two hosts left cannot form a world of three, and
    the run stops naming the hosts out, their causes and the missing spare."""
    run_id = f"hang-{uuid.uuid4().hex[:8]}"
    env, flags = supervised(pipeline, STEPS, TRAINGUARD_EXAMPLE_FAULT="hang:5:90:1")
    ckpt = tmp_path / "ckpt"
    start = starter(ckpt, tmp_path, env, "3:3", run_id, *flags, "--rdzv-conf", "join_timeout=20")

    agents: dict[str, subprocess.Popen[str]] = {}
    try:
        lose_host_b_with_a_spare_waiting(agents, start, ckpt, tmp_path)  # at MAX: it waits inside
        codes = {name: agents[name].wait(300) for name in ("host-a", "host-c", "spare-1")}
    finally:
        for proc in agents.values():
            kill_tree(proc)
    attempts = {n: [r for r in journal(ckpt, n) if r["op"] == "attempt" and r["attempt"] == 1] for n in codes}
    (hung,) = [n for n, records in attempts.items() if any(5 in (r.get("ranks") or []) for r in records)]
    assert codes == {"host-a": 1, "host-c": 1, "spare-1": 1}, [log_tail(tmp_path, n) for n in codes]

    derived, commands, _ = outputs(pipeline, run_id)
    assert [d for d in derived if isinstance(d, HangDetected)]
    lost, hang = [d for d in derived if isinstance(d, Interruption)]
    assert (lost.node, lost.reason.code) == ("host-b", ReasonCode.HOST_LOST)
    assert (hang.cause, hang.rank, hang.node, hang.attempt) == (InterruptionCause.HANG, 5, hung, 1)
    assert {c.node for c in commands if isinstance(c, QuarantineNode)} == {"host-b", hung}

    for other in set(codes) - {hung}:
        stopped = log_tail(tmp_path, other)
        # no world of three forms; or, when the hung host served the rendezvous store and left
        # first (a loaded machine: before the others' 20 s were up), its store is gone
        formed = "no round of 3 to 3 hosts formed within 20 s" in stopped
        assert formed or "is unreachable (its host is gone?)" in stopped, stopped
        assert f"{hung}: node {hung} caused interruption" in stopped and "(hang:" in stopped
        assert "host-b: " in stopped and "No spare host joined" in stopped
    assert f"{hung} is quarantined for run {run_id}" in log_tail(tmp_path, hung)
