"""Elastic training across hosts (issue 45): the survivors' roll call that lets the hosts
still there go on at once in a smaller world (producers/launcher/roll_call.py), and the
rule that readmits a host lost without a fault of its own (shared_quarantine.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainguard.producers.launcher.config import LauncherConfig
from trainguard.producers.launcher.rendezvous import Proposal, RendezvousSpec
from trainguard.producers.launcher.roll_call import RollCall, roll_call, shrunk_plan
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine, refused_at_start
from trainguard.producers.launcher.world import HostWorld

dist = pytest.importorskip("torch.distributed")

HOSTS = ("host-a", "host-b", "host-c")


def answer(node: str, attempt: int = 1, resume: int = 99, port: int = 1000, *out: str) -> Proposal:
    return Proposal(node, attempt, resume, tuple(out), addr=f"{node}.addr", port=port, hosts=HOSTS)


def test_the_hosts_that_answered_go_on_in_their_order_when_at_least_min_are_left() -> None:
    call = RollCall(0, HOSTS, min_nodes=2, nproc_per_node=2, wait_s=1.0)
    plan = shrunk_plan(
        call, {"host-c": answer("host-c", resume=109, port=3), "host-a": answer("host-a", port=1)}
    )
    assert plan is not None
    assert (plan.hosts, plan.attempt, plan.resume, plan.world_size) == (("host-a", "host-c"), 1, 99, 4)
    assert (plan.master_addr, plan.master_port) == ("host-a.addr", 1)  # rank 0 on the first host
    assert plan.ranks_of("host-c") == [2, 3]
    assert shrunk_plan(call, {h: answer(h) for h in HOSTS}) is None  # nobody lost: a round as before
    assert shrunk_plan(call, {"host-a": answer("host-a")}) is None  # below MIN: a round waits for hosts
    quarantined = {"host-a": answer("host-a", 1, 99, 1, "host-c"), "host-c": answer("host-c")}
    assert shrunk_plan(call, quarantined) is None  # the quarantined do not count


def store() -> object:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    return dist.PrefixStore("torch.rendezvous.run.0", server)


def test_every_survivor_reads_the_one_decision_the_first_to_know_wrote() -> None:
    shared = store()
    call = RollCall(0, HOSTS, min_nodes=1, nproc_per_node=2, wait_s=0.5)
    plans: dict[str, object] = {}

    def survivor(node: str) -> None:
        plans[node] = roll_call(shared, call, answer(node))

    threads = [threading.Thread(target=survivor, args=(n,)) for n in ("host-a", "host-c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert plans["host-a"] == plans["host-c"]
    plan = plans["host-a"]
    assert plan is not None and plan.hosts == ("host-a", "host-c")  # type: ignore[attr-defined]
    # host-b answers late (slow, not lost): it reads the decision that left it out
    late = roll_call(shared, call, answer("host-b"))
    assert late == plan
    # every host answering is no loss: the restart goes through a round, as is a "wait"
    call = RollCall(1, HOSTS, min_nodes=1, nproc_per_node=2, wait_s=5.0)
    done = [threading.Thread(target=roll_call, args=(shared, call, answer(n))) for n in HOSTS[1:]]
    for thread in done:
        thread.start()
    assert roll_call(shared, call, answer("host-a")) is None
    for thread in done:
        thread.join(10)
    assert roll_call(shared, RollCall(2, HOSTS, 1, 2, 5.0), answer("host-a"), wait=True) is None


def test_a_lost_hosts_quarantine_is_lifted_by_its_readmission_and_later_ones_stand(tmp_path: Path) -> None:
    listed = SharedQuarantine(tmp_path)
    listed.add("host-b", "host lost: its agent did not answer the survivors of attempt 0 within 1 s", by="a")
    listed.add("host-c", "node host-c caused interruption 1234 (hang: ...)", by="host-a")
    state, ckpt = tmp_path.parent / tmp_path.name, None
    # an elastic run's agent on a lost host is not refused at start; a culprit's always is
    assert refused_at_start(state, ckpt, "host-b", "run", elastic=True) is None
    assert refused_at_start(state, ckpt, "host-b", "run", elastic=False) is not None
    assert refused_at_start(state, ckpt, "host-c", "run", elastic=True) is not None
    assert listed.release("host-b", by="host-b", readmitted_in=1, reason="readmitted: passed its self-test")
    assert "host-b" not in listed.nodes() and listed.readmitted() == {"host-b": 1}
    assert not listed.add("host-c", "again", by="host-a")  # already out: the first reason stands
    assert listed.add("host-c", "failed its self-test: gemm", by="host-c", again=True)
    assert listed.nodes()["host-c"] == "failed its self-test: gemm"
    listed.add("host-b", "host lost: its beat stopped 3.0 s ago, in attempt 4", by="host-a")
    assert listed.readmitted() == {} and "host-b" in listed.nodes()  # lost again: out again


def test_across_hosts_in_process_restart_with_a_range_of_hosts_is_elastic() -> None:
    def config(nnodes: tuple[int, int], restart: str = "in-process") -> LauncherConfig:
        spec = RendezvousSpec("127.0.0.1:1", "run", *nnodes)
        return LauncherConfig(("true",), 4, 2, "run", Path("ckpt"), rendezvous=spec, restart=restart)  # type: ignore[arg-type]

    assert config((1, 2)).elastic
    assert not config((2, 2)).elastic and not config((1, 2), restart="full").elastic


def test_a_spare_takes_the_place_of_a_lost_host_the_world_went_on_without() -> None:
    def needed(nnodes: tuple[int, int], nodes: tuple[str, ...], listed: dict[str, str]) -> list[str]:
        spec = RendezvousSpec("127.0.0.1:1", "run", *nnodes)
        cfg = LauncherConfig(("true",), 4, 2, "run", Path("ckpt"), rendezvous=spec, restart="in-process")
        return HostWorld._shrunk_without(SimpleNamespace(config=cfg), nodes, listed)  # type: ignore[arg-type]

    lost = {"host-b": "host lost: its agent did not answer the survivors of attempt 0 within 1 s"}
    assert needed((1, 2), ("host-a",), lost) == ["host-b"]  # the world shrank without it
    assert needed((1, 2), ("host-a", "spare-1"), lost) == []  # full again
    assert needed((1, 2), ("host-a",), {"host-b": "node host-b caused interruption 1 (hang)"}) == []
    assert needed((2, 2), ("host-a",), lost) == []  # not elastic: only a beat or the list of its world
