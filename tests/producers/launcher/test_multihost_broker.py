"""Issue 17's end-to-end test: `trainguard launch` across hosts on this one machine, host
agents as separate process trees with their own --node-name, torch's c10d rendezvous on
localhost, the README's example with dropout and AdamW on real gloo ranks, supervised
through the real broker by a real processor (one for the module):

- a whole host lost (its agent and ranks SIGKILLed) while a spare agent waits (--spare,
  with room below MAX: it must not grow the world): the spare takes its ranks, the
  processor names the lost host (never a survivor, whose ranks died of the lost peer
  first) and quarantines it alone, the host is refused when it comes back, and the run
  ends bitwise equal to an uninterrupted run of the same world size;
- the same loss under --restart in-process: the survivors keep their processes.

The same loss followed by a hang with no spare left: test_multihost_hang_broker.py.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.devtools.stack import PROCESSOR_GROUP
from harness.hosts import agent, attempted, clean_run, environment, journal, kill_tree, log_tail
from trainguard.kafka.lag import wait_caught_up
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine
from trainguard.replay.log import read_topic
from trainguard.schemas import (
    Interruption,
    InterruptionCause,
    Quarantine,
    QuarantineNode,
    RankExit,
    ReasonCode,
    decode,
)
from trainguard.schemas.codec import COMMANDS, DERIVED, decode_batch

from ...pipeline import Processor, running_processor
from ..test_inprocess_restart import assert_same_tensors

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

POLICY = Path(__file__).with_name("multihost_policy.yaml")  # the tiny example's timings, a 5 s hang floor
SECRET = "multihost-broker-test-secret-0123456789"
STEPS = 160


def module_processor(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    """The module's processor, with the tiny example's policy and the run's secret."""
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    yield from module_processor(bootstrap, tmp_path_factory)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the same world (6 ranks, 2 per node) on one host: its run
    dir holds the final weights and optimizer state a faulted run must end with."""
    return clean_run(tmp_path_factory.mktemp("clean"), 6, STEPS, "multihost-clean")


def final_state(ckpt: Path) -> tuple[Any, Any]:
    """The final weights and optimizer state rank 0 wrote (its host's run dir)."""
    weights = next(ckpt.glob(".trainguard/**/final.pt"))
    return torch.load(weights), torch.load(weights.with_name("final_optimizer.pt"))


def supervised(pipeline: Processor, steps: int, **extra: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The agents' environment and flags for a run through the pipeline."""
    env = environment(steps, TRAINGUARD_SECRET=SECRET, **extra)
    # A tiny step takes ~15 ms: ship and beat often enough for decisions to land in time.
    env |= {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    return env, ("--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix, "--grace-s", "5")


def outputs(pipeline: Processor, run_id: str) -> tuple[list[object], list[object], list[RankExit]]:
    """The processor's derived events and commands for the run, and the run's RankExits."""
    group = pipeline.prefix + PROCESSOR_GROUP
    assert wait_caught_up(pipeline.bootstrap, group, [pipeline.names.telemetry], 60)
    found = []
    for topic, kinds in ((pipeline.names.events, DERIVED), (pipeline.names.commands, COMMANDS)):
        values = [value for _, _, value in read_topic(pipeline.bootstrap, topic)]
        found.append([r for r in (decode(v, kinds) for v in values) if r.run_id == run_id])
    records = read_topic(pipeline.bootstrap, pipeline.names.telemetry)
    exits = [
        e
        for _, _, value in records
        for e in decode_batch(value).events
        if e.run_id == run_id and isinstance(e, RankExit)
    ]
    return found[0], found[1], exits


def starter(
    ckpt: Path, workdir: Path, env: dict[str, str], nnodes: str, run_id: str, *flags: str
) -> Callable[..., subprocess.Popen[str]]:
    """start(node, log="", *more): one host's agent of this run (one rendezvous endpoint)."""
    endpoint = f"127.0.0.1:{free_port()}"

    def start(node: str, log: str = "", *more: str) -> subprocess.Popen[str]:
        return agent(node, endpoint, ckpt, workdir, env, nnodes, run_id, log, (*flags, *more))

    return start


def lose_host_b_with_a_spare_waiting(
    agents: dict[str, subprocess.Popen[str]],
    start: Callable[..., subprocess.Popen[str]],
    ckpt: Path,
    workdir: Path,
    *spare_flags: str,
) -> float:
    """Hosts a, b and c form the world, spare-1 waits; once step 49 is validated, host-b's
    agent and ranks are SIGKILLed. Returns the deadline the caller's waits share."""
    agents["host-a"] = start("host-a")
    time.sleep(2)  # host-a hosts the rendezvous store
    agents |= {name: start(name) for name in ("host-b", "host-c")}
    deadline = time.monotonic() + 240
    while not all(attempted(ckpt, name) for name in agents):  # the world of three formed
        assert time.monotonic() < deadline, "the first round never completed"
        time.sleep(0.1)
    agents["spare-1"] = start("spare-1", "", *spare_flags)
    while not (ckpt / "step-000000049" / "VALIDATED").exists():
        assert time.monotonic() < deadline, "no checkpoint at step 49"
        assert agents["host-a"].poll() is None, log_tail(workdir, "host-a")
        time.sleep(0.1)
    kill_tree(agents["host-b"])
    return deadline


def test_a_lost_host_is_replaced_by_a_spare_named_by_the_processor_and_the_run_ends_bitwise(
    pipeline: Processor, clean: Path, tmp_path: Path
) -> None:
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    env, flags = supervised(pipeline, STEPS)
    ckpt = tmp_path / "ckpt"
    start = starter(ckpt, tmp_path, env, "3:4", run_id, *flags)

    agents: dict[str, subprocess.Popen[str]] = {}
    try:
        deadline = lose_host_b_with_a_spare_waiting(agents, start, ckpt, tmp_path, "--spare")  # MAX is 4
        listed = SharedQuarantine(ckpt / ".trainguard")
        while "host-b" not in listed.nodes():  # the survivors found it lost: out of the run
            assert time.monotonic() < deadline, "host-b was never quarantined"
            time.sleep(0.1)
        assert "host lost" in listed.nodes()["host-b"]
        # The host comes back (its agent restarted with the same name): it is not readmitted,
        # and says why in one line, writing nothing (no journal record, no restart record).
        back = start("host-b", log="host-b-again")
        assert back.wait(120) == 1
        (refused,) = log_tail(tmp_path, "host-b-again").splitlines()
        assert refused.startswith(f"host-b is quarantined for run {run_id} ("), refused
        for name in ("host-a", "host-c", "spare-1"):
            assert agents[name].wait(300) == 0, log_tail(tmp_path, name)
    finally:
        for proc in agents.values():
            kill_tree(proc)

    for name in ("host-a", "host-c"):  # each survivor recorded its ranks' crash, a lost peer's
        restarts = ckpt / ".trainguard" / "hosts" / name / "restarts.jsonl"
        (restart,) = [json.loads(line) for line in restarts.open()]
        assert restart["cause"] == "crash" and restart["resumed_from_step"] >= 49, restart
        assert "(lost a peer: " in restart["detail"], restart
        assert (restart["hosts_lost"], restart["replaced_by"]) == (["host-b"], {"host-b": "spare-1"})
    # The spare recorded its share too; host-b's relaunch recorded nothing. One decision on
    # the shared list, whichever agents saw host-b lost or executed its QuarantineNode.
    (taken,) = [
        json.loads(line) for line in (ckpt / ".trainguard" / "hosts" / "spare-1" / "restarts.jsonl").open()
    ]
    assert (taken["cause"], taken["node"], taken["complete"]) == ("host_lost", "host-b", True), taken
    assert not (ckpt / ".trainguard" / "hosts" / "host-b" / "restarts.jsonl").exists()
    assert len(SharedQuarantine(ckpt / ".trainguard").path.read_text().splitlines()) == 1
    (spare_attempt,) = [r for r in journal(ckpt, "spare-1") if r["op"] == "attempt"]
    assert "host-b" not in spare_attempt["nodes"] and spare_attempt["resume"] >= 49
    # The spare proved its host while it waited (self-test "ahead", the default), once.
    assert (tmp_path / "spare-1.log").read_text().count("self-test (spare): node spare-1 passed") == 1
    # The spare never grew the world: two attempts of three hosts, host-b's then its own.
    worlds = [sorted(r["nodes"]) for r in journal(ckpt, "host-a") if r["op"] == "attempt"]
    assert worlds == [["host-a", "host-b", "host-c"], ["host-a", "host-c", "spare-1"]]
    expected, got = final_state(clean)[0], final_state(ckpt)[0]
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights diverged"

    derived, commands, exits = outputs(pipeline, run_id)
    # Every survivor's rank that ended on its own said it lost a peer; host-b's said nothing.
    crashed = [e for e in exits if e.attempt == 0 and not e.requested and e.exit_code not in (0, None)]
    assert crashed and all(e.peer_lost for e in crashed), [(e.node, e.rank, e.exit_code) for e in crashed]
    # host-b's only exits are its relaunched agent's, ending the lost attempt's ranks by pid
    assert all(e.requested for e in exits if e.node == "host-b")
    (interruption,) = [d for d in derived if isinstance(d, Interruption)]
    assert (interruption.cause, interruption.node, interruption.detected_by) == (
        InterruptionCause.CRASH, "host-b", "peer_loss",
    )  # fmt: skip
    assert interruption.reason.code == ReasonCode.HOST_LOST
    assert {q.node for q in derived if isinstance(q, Quarantine)} == {"host-b"}  # no innocent host
    assert {c.node for c in commands if isinstance(c, QuarantineNode)} == {"host-b"}


def test_in_process_across_hosts_the_survivors_keep_their_processes_and_a_spare_host_takes_the_lost_ranks(
    pipeline: Processor, clean: Path, tmp_path: Path
) -> None:
    """Issue 18 across hosts: the same whole-host loss under --restart in-process with a
    warm spare per host. host-a's and host-c's ranks leave the attempt alive (their
    collectives fail on the lost peer) and wait in their processes; their agents report
    each leaving as a RankExit of a lost peer, so the processor names host-b, not them;
    spare-1, its workers imported while it waited, takes host-b's place and ranks 2 and 3
    (torch numbers the round's hosts afresh: the plan keeps the survivors' group ranks),
    restoring them from their holders' memory on host-a and host-c. The run ends bitwise
    equal to the uninterrupted one."""
    run_id = f"hot-hosts-{uuid.uuid4().hex[:8]}"
    env, flags = supervised(pipeline, STEPS, TRAIN_EVENTS_FILE=str(tmp_path / "events.jsonl"))
    ckpt = tmp_path / "ckpt"
    start = starter(ckpt, tmp_path, env, "3:4", run_id, *flags, "--warm-spares", "1")

    agents: dict[str, subprocess.Popen[str]] = {}
    try:
        lose_host_b_with_a_spare_waiting(agents, start, ckpt, tmp_path, "--spare")
        for name in ("host-a", "host-c", "spare-1"):
            assert agents[name].wait(300) == 0, log_tail(tmp_path, name)
    finally:
        for proc in agents.values():
            kill_tree(proc)

    for name in ("host-a", "host-c"):
        restarts = ckpt / ".trainguard" / "hosts" / name / "restarts.jsonl"
        (restart,) = [json.loads(line) for line in restarts.open()]
        assert (restart["cause"], restart["path"]) == ("crash", "in-process"), restart
        assert "left the attempt alive (lost a peer: " in restart["detail"], restart
        assert restart["restore_from"] == {"own": 2} and restart["complete"], restart
    (taken,) = [r for r in journal(ckpt, "spare-1") if r["op"] == "attempt"]
    assert taken["ranks"] == [2, 3] and taken["nodes"] == ["host-a", "spare-1", "host-c"], taken

    first_steps: dict[int, dict[int, int]] = {}  # attempt -> rank -> pid, by the script's account
    for line in (tmp_path / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "first_step":
            first_steps.setdefault(event["attempt"], {})[event["rank"]] = event["pid"]
    before, after = first_steps[0], first_steps[max(first_steps)]
    assert all(before[r] == after[r] for r in (0, 1, 4, 5)), (before, after)
    assert not {before[2], before[3]} & {after[2], after[3]}

    (weights, optimizer), (clean_weights, clean_optimizer) = final_state(ckpt), final_state(clean)
    assert_same_tensors(clean_weights, weights)
    assert_same_tensors(clean_optimizer, optimizer)

    derived, commands, exits = outputs(pipeline, run_id)
    left = [e for e in exits if e.attempt == 0 and not e.requested and e.exit_code is None]
    assert left and all(e.peer_lost and e.node in ("host-a", "host-c") for e in left), left
    (interruption,) = [d for d in derived if isinstance(d, Interruption)]
    assert (interruption.node, interruption.reason.code) == ("host-b", ReasonCode.HOST_LOST)
    assert {q.node for q in derived if isinstance(q, Quarantine)} == {"host-b"}
