"""The rendezvous stage across hosts: torchrun's flags, and the plan the hosts agree on."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.devtools.broker_config import port_open
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.rendezvous import (
    HostRendezvous,
    Proposal,
    RendezvousSpec,
    WorldPlan,
    decide,
    host_order,
    parse_conf,
    parse_nnodes,
)
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine


def test_nnodes_reads_as_torchrun_reads_it() -> None:
    assert parse_nnodes("4") == (4, 4)
    assert parse_nnodes("2:8") == (2, 8)
    for bad in ("0", "3:2", "a:b", "", "2:"):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)


def test_rdzv_conf_reads_key_value_pairs() -> None:
    assert parse_conf("keep_alive_interval=2, join_timeout=60,") == {
        "keep_alive_interval": "2",
        "join_timeout": "60",
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_conf("join_timeout")


def test_a_spec_refuses_an_empty_range() -> None:
    with pytest.raises(ValueError, match="MIN:MAX"):
        RendezvousSpec("h:1", "r", 3, 2)


def test_the_plan_takes_the_newest_attempt_and_the_oldest_resume_of_the_informed_hosts() -> None:
    proposals = [
        Proposal("host-a", next_attempt=3, resume=120, quarantined=("host-x",), addr="10.0.0.1", port=29555),
        Proposal("host-c", next_attempt=4, resume=110),  # saw 120 validated a moment later
        Proposal("spare-1", next_attempt=0, resume=None, quarantined=("host-b",)),  # never ran
    ]
    plan = decide(proposals, nproc_per_node=2)
    assert (plan.attempt, plan.resume) == (4, 110)
    assert plan.hosts == ("host-a", "host-c", "spare-1")
    assert (plan.master_addr, plan.master_port) == ("10.0.0.1", 29555)
    assert plan.quarantined == ("host-b", "host-x")
    assert plan.world_size == 6
    assert [plan.ranks_of(h) for h in plan.hosts] == [[0, 1], [2, 3], [4, 5]]
    assert WorldPlan.from_json(plan.to_json()) == plan
    assert Proposal.from_json(proposals[0].to_json()) == proposals[0]


def test_only_uninformed_hosts_start_from_scratch_and_one_name_twice_is_refused() -> None:
    fresh = [Proposal("a", 0, None), Proposal("b", 0, None)]
    assert decide(fresh, 1).resume == -1
    with pytest.raises(ValueError, match="--node-name"):
        decide([Proposal("a", 0, 5), Proposal("a", 0, 5)], 1)


def test_a_host_taking_a_lost_ones_place_takes_its_group_rank_and_the_survivors_keep_theirs() -> None:
    """torch numbers the round's hosts afresh (here the spare joined before host-c): in a
    world of the same size the survivors keep their ranks (their processes hold them)."""
    last = ("host-a", "host-b", "host-c")
    joined = [
        Proposal("host-a", 2, 49, addr="10.0.0.1", port=1001, hosts=last),
        Proposal("spare-1", 0, None, addr="10.0.0.9", port=1009),
        Proposal("host-c", 2, 49, addr="10.0.0.3", port=1003, hosts=last),
    ]
    plan = decide(joined, nproc_per_node=2)
    assert plan.hosts == ("host-a", "spare-1", "host-c")
    assert plan.ranks_of("host-c") == [4, 5] and plan.ranks_of("spare-1") == [2, 3]
    # host-a's group rank lost: the newcomer takes rank 0, and rank 0's store is on its host
    lost_a = decide([joined[2], joined[1], Proposal("host-b", 2, 49, hosts=last)], 2)
    assert lost_a.hosts == ("spare-1", "host-b", "host-c")
    assert (lost_a.master_addr, lost_a.master_port) == ("10.0.0.9", 1009)
    # a world of another size (MIN:MAX): torch's order, every rank placed afresh
    assert host_order(["host-c", "host-a"], last) == ("host-c", "host-a")


# --------------------------------------------------------------------------- real rounds

AGENT = Path(__file__).with_name("rdzv_agent.py")


class Agent:
    """One rdzv_agent.py process (its own session, as a host's agent is), its plans read
    from its stdout on a thread."""

    def __init__(self, node: str, endpoint: str, nnodes: str, directory: Path) -> None:
        self.node = node
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), node, endpoint, nnodes, "0", str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def plan(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.lines.get(timeout=timeout_s)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def test_a_spare_host_takes_the_place_of_a_lost_one_within_seconds(tmp_path: Path) -> None:
    """Three host agents form a world on torch's c10d rendezvous and agree on one plan; a
    fourth waits as a spare (the job is at MAX); one host's process group is killed; the
    survivors' next round completes with the spare in its place, within seconds, and
    every host gets the same plan."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents: dict[str, Agent] = {}
    try:
        agents["host-a"] = Agent("host-a", endpoint, "3:3", tmp_path)  # binds the store first
        host, port = endpoint.split(":")
        deadline = time.monotonic() + 60
        while not port_open(int(port), host):
            assert time.monotonic() < deadline, "the rendezvous store never listened"
            time.sleep(0.1)
        for name in ("host-b", "host-c"):
            agents[name] = Agent(name, endpoint, "3:3", tmp_path)
        first = {name: agents[name].plan() for name in ("host-a", "host-b", "host-c")}
        plans = {json.dumps(line["plan"], sort_keys=True) for line in first.values()}
        assert len(plans) == 1  # one plan, the same on every host
        plan = next(iter(first.values()))["plan"]
        assert sorted(plan["hosts"]) == ["host-a", "host-b", "host-c"] and plan["nproc_per_node"] == 2
        assert sorted(line["group_rank"] for line in first.values()) == [0, 1, 2]

        agents["spare-1"] = Agent("spare-1", endpoint, "3:3", tmp_path)
        with pytest.raises(queue.Empty):  # at MAX: the spare waits, it does not break the round
            agents["spare-1"].plan(timeout_s=4)

        agents["host-b"].kill()
        killed = time.time()
        (tmp_path / "again-0").touch()  # the survivors' ranks died with host-b's: next round
        second = {name: agents[name].plan() for name in ("host-a", "host-c")}
        second["spare-1"] = agents["spare-1"].plan()
        plans = {json.dumps(line["plan"], sort_keys=True) for line in second.values()}
        assert len(plans) == 1
        plan = next(iter(second.values()))["plan"]
        assert sorted(plan["hosts"]) == ["host-a", "host-c", "spare-1"]
        assert plan["attempt"] == 1  # the survivors' next attempt, not the spare's first
        took = max(line["ts"] for line in second.values()) - killed
        assert took < 15.0, f"the spare took the lost host's place after {took:.1f} s"
    finally:
        for agent in agents.values():
            agent.kill()


def test_the_shared_quarantine_list_keeps_the_last_word_per_host_and_skips_a_torn_line(
    tmp_path: Path,
) -> None:
    listed = SharedQuarantine(tmp_path)
    listed.add("host-b", "host lost", by="host-a")
    listed.add("host-c", "wrong answers", by="host-a")
    listed.release("host-c", by="host-a")
    with listed.path.open("ab") as fh:
        fh.write(b'{"node": "host-d", "out": tr')  # a writer killed mid-line
    assert SharedQuarantine(tmp_path).nodes() == {"host-b": "host lost"}


def test_a_store_gone_at_the_end_of_a_run_counts_no_host_waiting() -> None:
    """The store's host ends its run first (its launcher exits, the store with it) while
    another host's launcher still polls for hosts waiting to join: torch raises, and that
    host's finished run once exited 1 (seen in test_multihost_broker). The poll is only a
    chance to grow the world; the attempt's own end decides."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    port = free_port("127.0.0.1")
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    host = HostRendezvous(RendezvousSpec(f"127.0.0.1:{port}", "store-gone", 1, 2), 1)
    assert host.nodes_waiting() == 0
    del server  # the store's host is gone
    deadline = time.monotonic() + 30
    while True:  # torch answers from its last state for a moment, then asks the store
        try:
            host.handler.num_nodes_waiting()
        except RendezvousConnectionError:
            break
        assert time.monotonic() < deadline, "the store's loss never reached the rendezvous"
        time.sleep(0.2)
    assert host.nodes_waiting() == 0
