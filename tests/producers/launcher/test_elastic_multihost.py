"""Elastic training across hosts (issue 45) end to end: docs/examples/train_elastic.py
(dropout, AdamW, a learning-rate schedule) on two host agents of two gloo ranks each on
this machine (`trainguard launch --nnodes 1:2 --nproc-per-node 2 --restart in-process`,
each with its own --node-name), no spare host, supervised through the real broker and
processor.

At step 137 host-b is lost: its agent's whole process tree is SIGKILLed (its agent and
both its ranks). host-a's ranks leave the attempt alive, its agent's roll call finds no
other host, and they go on at world 2 in their own processes from the newest checkpoint
(step 99), without waiting for the rendezvous. host-b's agent is started again with the
same flags: it was lost without a fault of its own, so it passes its node self-test, is
readmitted and waits in the rendezvous; host-a's ranks checkpoint at the next boundary
(step 199; the smaller world waits at step 190 until the grow is asked, so that the
boundary is known whatever host-b's start takes) and
leave, and the world of 4 trains to the end. Every sample of every epoch is trained
exactly once, the final weights are within floating-point tolerance of an uninterrupted
run's, and bitwise those of a second run that shrank and grew at the same steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.hosts import ROOT, kill_tree
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine

from ...pipeline import Processor, running_processor
from .elastic_checks import assert_each_sample_once, assert_like_clean, assert_weights, trained

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

EXAMPLE = ROOT / "docs" / "examples" / "train_elastic.py"
POLICY = Path(__file__).with_name("elastic_policy.yaml")
SECRET = "elastic-hosts-test-secret-0123456789abcdef"
STEPS, SAMPLES, GLOBAL_BATCH, EVERY = 300, 2048, 64, 100
TOLERANCE = 1e-6  # float32 sums of the shards' gradients in another order, through 300 steps


@pytest.fixture(scope="module")
def pipeline(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processor]:
    """The module's processor (the elastic tests' policy: the smaller world's wait for the
    grow at step 190 is no hang)."""
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    with running_processor(bootstrap, POLICY, SECRET, log) as processor:
        yield processor


def environment(workdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TRAIN_"))}
    env |= {"TRAINGUARD_SECRET": SECRET, "OMP_NUM_THREADS": "1", "TRAINGUARD_FLUSH_INTERVAL_S": "0.25"}
    env |= {"TRAIN_STEPS": str(STEPS), "TRAIN_CHECKPOINT_EVERY": str(EVERY)}
    env |= {
        "TRAIN_EVENTS_FILE": str(workdir / "events.jsonl"),
        "TRAIN_SAMPLES_FILE": str(workdir / "samples.jsonl"),
    }
    return env | extra


@dataclass
class Run:
    workdir: Path
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        return self.workdir / "ckpt" / ".trainguard"

    def restarts(self, node: str) -> list[dict[str, Any]]:
        path = self.shared / "hosts" / node / "restarts.jsonl"
        return [json.loads(line) for line in path.open()] if path.exists() else []

    def events(self, kind: str) -> list[dict[str, Any]]:
        path = self.workdir / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def first_steps(self) -> dict[int, dict[int, tuple[int, int]]]:
        """attempt -> rank -> (pid, world) of the process that trained its first step."""
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for event in self.events("first_step"):
            out.setdefault(event["attempt"], {})[event["rank"]] = (event["pid"], event["world"])
        return out

    def trained(self) -> dict[int, list[int]]:
        """step -> the sample ids of its update (elastic_checks.trained)."""
        return trained(self.workdir / "samples.jsonl")

    def final(self) -> dict[str, Any]:
        return dict(torch.load(next(self.shared.glob("**/final.pt"))))

    def explain(self) -> str:
        return "\n".join(f"--- {node}\n{text[-3000:]}" for node, text in self.logs.items())


def clean_run(workdir: Path) -> Run:
    """The same job uninterrupted, offline, on one host (4 ranks, 2 per modelled node)."""
    workdir.mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-m", "trainguard", "launch", "--offline", "--nproc", "4", "--ranks-per-node", "2",
         "--run-id", "elastic-hosts-clean", "--checkpoint-dir", str(workdir / "ckpt"), "--self-test", "off",
         str(EXAMPLE)],
        env=environment(workdir), cwd=workdir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return Run(workdir, {"clean": done.stderr})


def starter(
    pipeline: Processor, workdir: Path, self_test: str
) -> Callable[[str, str], subprocess.Popen[str]]:
    """start(node, log): one host's agent of this run, with torchrun's flags (the same each
    time). host-b only connects to the rendezvous store (is_host=false: it starts first and
    waits for host-a's); every agent has the same environment, which names host-b for the
    loss at step 137 of attempt 0."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"elastic-hosts-{uuid.uuid4().hex[:8]}"
    env = environment(workdir, TRAIN_KILL="host-b:137:0", TRAIN_GROW_AT="190")

    def start(node: str, log: str) -> subprocess.Popen[str]:
        # The first round must hold both hosts: torch completes a round of MIN (1) hosts
        # after its last call, and host-b, slower to start on a loaded machine, once came
        # after 3 s (the elastic default; then host-a started alone, and host-b's joining
        # that running world failed in the round's store: a known bug, the note).
        conf = "last_call_timeout=10" + (",is_host=false" if node == "host-b" else "")
        command = [
            sys.executable, "-m", "trainguard", "launch", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--restart", "in-process", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", conf, "--local-addr", "127.0.0.1", "--node-name", node,
            "--checkpoint-dir", str(workdir / "ckpt"), "--max-restarts", "3", "--decision-wait-s", "1",
            "--self-test", self_test,
            "--bootstrap", pipeline.bootstrap, "--topic-prefix", pipeline.prefix, str(EXAMPLE),
        ]  # fmt: skip
        out = (workdir / f"{log}.log").open("w")
        return subprocess.Popen(
            command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True
        )

    return start


def until(what: str, ok: Callable[[], object], deadline: float, run: Run, agents: dict[str, Any]) -> None:
    while not ok():
        if time.monotonic() > deadline or any(a.poll() not in (None, 0) for a in agents.values()):
            run.logs = {n: (run.workdir / f"{n}.log").read_text() for n in agents}
            raise AssertionError(f"{what}:\n{run.explain()}")
        time.sleep(0.05)


def elastic_run(pipeline: Processor, workdir: Path, self_test: str) -> Run:
    """host-b lost at step 137, started again once host-a trains at world 2."""
    workdir.mkdir(parents=True)
    run, start = Run(workdir), starter(pipeline, workdir, self_test)
    agents: dict[str, subprocess.Popen[str]] = {}
    deadline = time.monotonic() + 300
    try:
        agents["host-b"] = start("host-b", "host-b")
        agents["host-a"] = start("host-a", "host-a")
        until("host-b never reached step 137", lambda: run.events("kill"), deadline, run, agents)
        kill_tree(agents.pop("host-b"))  # the whole host: its agent and both its ranks
        until("host-a never went on", lambda: 1 in run.first_steps(), deadline, run, agents)
        agents["host-b-again"] = start("host-b", "host-b-again")
        for proc in agents.values():
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in agents.values():
            kill_tree(proc)
    run.logs = {n: (workdir / f"{n}.log").read_text() for n in ("host-a", "host-b", "host-b-again")}
    assert all(proc.returncode == 0 for proc in agents.values()), run.explain()
    return run


def test_a_lost_host_shrinks_the_world_in_process_and_it_grows_back_when_the_host_returns(
    pipeline: Processor, tmp_path: Path
) -> None:
    clean = clean_run(tmp_path / "clean")
    # host-b is self-tested before it is readmitted; in the second run untested (--self-test off)
    runs = [elastic_run(pipeline, tmp_path / f"elastic-{i}", test) for i, test in enumerate(("ahead", "off"))]
    for run, tested in zip(runs, ("passed its self-test", "untested (--self-test off)"), strict=True):
        shrink, grow = run.restarts("host-a")
        assert (shrink["cause"], shrink["path"], shrink["decision"]) == ("crash", "in-process", "shrink"), (
            shrink
        )
        assert (shrink["world_size"], shrink["resumed_from_step"], shrink["hosts_lost"]) == (
            2,
            99,
            ["host-b"],
        )
        assert shrink["new_ranks"] == [] and shrink["warm_ranks"] == [] and shrink["complete"], shrink
        assert shrink["restart_s"] < 2.0, shrink  # the survivors go on at once, in their processes
        assert (grow["cause"], grow["path"], grow["decision"]) == ("resize", "in-process", "grow"), grow
        assert (grow["world_size"], grow["resumed_from_step"], grow["complete"]) == (4, 199, True), grow
        assert grow["new_ranks"] == [] and grow["warm_ranks"] == [], grow  # host-a's ranks kept
        assert "1 host(s) waiting to join: attempt 1's world of 2 ranks grows" in run.logs["host-a"]
        # host-b was out, then readmitted (after its self-test): the list says both
        listed = SharedQuarantine(run.shared)
        assert "host-b" not in listed.nodes() and listed.readmitted() == {"host-b": 1}
        said = "host-b was lost (its agent did not answer the survivors of attempt 0 within 1 s); back: "
        assert said + tested in run.logs["host-b-again"], run.logs["host-b-again"][-3000:]

        firsts = run.first_steps()
        assert sorted(firsts) == [0, 1, 2] and {w for _, w in firsts[1].values()} == {2}, firsts
        pid_of = {a: {r: pid for r, (pid, _) in ranks.items()} for a, ranks in firsts.items()}
        host_a = [pid for r, pid in sorted(pid_of[0].items()) if pid in pid_of[1].values()]
        assert len(host_a) == 2 and sorted(host_a) == sorted(pid_of[1].values()), pid_of  # kept at world 2
        assert set(host_a) <= set(pid_of[2].values()), pid_of  # and at world 4 again
        assert len(set(pid_of[2].values()) - set(pid_of[0].values())) == 2  # host-b's are new

        trained = run.trained()
        assert_each_sample_once(trained, STEPS, SAMPLES, GLOBAL_BATCH)
        assert_like_clean(trained, clean.trained())  # the uninterrupted run's data order

    assert_weights(clean.final(), runs[0].final(), runs[1].final(), TOLERANCE)
