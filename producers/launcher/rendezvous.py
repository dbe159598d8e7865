"""Across hosts, the placement stage is a rendezvous round (docs/multihost.md): torch
elastic's dynamic rendezvous forms the world, and the hosts agree, through the round's
own store, on one plan for the attempt.

torch's part (``DynamicRendezvousHandler``, the c10d backend by default: the state in a
TCPStore at the endpoint; any backend torch registers may be named): which hosts are in
this round, each host's group rank, keep-alives that drop a lost host, a redundancy list
that holds a spare while the job is at MAX, and a store private to the round.

Ours, on top: every host proposes what it knows (:class:`Proposal`: its node name, the
attempt it would start next, the newest checkpoint it may resume from, the nodes it knows
to be quarantined); the host of group rank 0 decides (:func:`decide`, pure) and writes
the :class:`WorldPlan`; every host reads the same plan. So every rank of every host
starts with the same attempt, resume step and master address, whoever restarted first.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

#: Where in the round's store the hosts' proposals and the plan live.
_PROPOSAL = "trainguard/proposal/{}"
_PLAN = "trainguard/plan"

#: Keep-alives every second, a host dropped after three missed: a lost host is noticed
#: in ~3 s (torch's defaults, 5 s x 3, take 15 s). A user's --rdzv-conf wins.
DEFAULT_CONF = {"keep_alive_interval": "1", "keep_alive_max_attempt": "3", "last_call_timeout": "1"}
#: Elastic training (docs/elastic.md): a lost host does not wait for a round (the survivors'
#: roll call, roll_call.py); a round grows the world back with a host waiting in it, and
#: must not complete before that host, which polls the state once a second, joins it.
ELASTIC_CONF = {"last_call_timeout": "3"}


class NoRound(Exception):
    """No round could form: the join timeout passed, the rendezvous closed, or its store is gone."""


@dataclass(frozen=True)
class RendezvousSpec:
    """torchrun's rendezvous flags, with torchrun's meaning."""

    endpoint: str  # HOST:PORT of the rendezvous store
    run_id: str  # --rdzv-id: the hosts of one job share it
    min_nodes: int
    max_nodes: int
    backend: str = "c10d"
    conf: Mapping[str, str] = field(default_factory=dict)  # --rdzv-conf k=v,...
    local_addr: str | None = None  # how the other hosts reach this one (default: its hostname)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}")


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's --nnodes: "N" or "MIN:MAX"."""
    lo, sep, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return low, high


def parse_conf(value: str) -> dict[str, str]:
    """torchrun's --rdzv-conf: "key=value,key=value"."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf entries are key=value, got {item!r}")
        out[key.strip()] = val.strip()
    return out


@dataclass(frozen=True)
class Proposal:
    """What one host knows when a round completes."""

    node: str
    next_attempt: int
    #: The step this host would resume from (-1: from scratch); None: no opinion (a
    #: spare that never ran this job has no journal and no rollback barriers).
    resume: int | None
    quarantined: tuple[str, ...] = ()
    addr: str = ""  # where this host's rank 0 would listen (used when it gets group rank 0)
    port: int = 0  # a free port there, for that rank 0's store
    #: The hosts of the last world this host ran in, in group-rank order (() none): a
    #: survivor of an in-process restart keeps its ranks, so its host keeps its place.
    hosts: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Proposal:
        data = json.loads(raw)
        lists = {"quarantined": tuple(data.get("quarantined", ())), "hosts": tuple(data.get("hosts", ()))}
        return cls(**{**data, **lists})


@dataclass(frozen=True)
class WorldPlan:
    """One attempt across hosts, the same on every host."""

    attempt: int
    resume: int
    hosts: tuple[str, ...]  # node names, in group-rank order
    nproc_per_node: int
    master_addr: str
    master_port: int
    quarantined: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.nproc_per_node

    def ranks_of(self, node: str) -> list[int]:
        """The global ranks `node` runs (torchrun's: group rank x nproc + local rank)."""
        group_rank = self.hosts.index(node)
        return [group_rank * self.nproc_per_node + i for i in range(self.nproc_per_node)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorldPlan:
        data = json.loads(raw)
        return cls(**{**data, "hosts": tuple(data["hosts"]), "quarantined": tuple(data["quarantined"])})


def decide(proposals: Sequence[Proposal], nproc_per_node: int) -> WorldPlan:
    """The leader's plan from every host's proposal (index: group rank). The attempt is the
    largest any host would start (a host that restarted more often, or a spare that never
    ran, must not reuse an attempt number: commands are signed for one); the resume step
    is the oldest of those the hosts with an opinion would take (with shared storage they
    agree; when a checkpoint was validated between two hosts' reads, the older one is the
    one every host saw validated; a Rollback every host executed names one step); the
    quarantine lists are merged (a host that learnt of one tells the others); the hosts'
    order is the last world's where the size is the same (:func:`host_order`); rank 0's
    store listens on the first host's address and port."""
    if not proposals:
        raise ValueError("a round has at least one host")
    names = [p.node for p in proposals]
    if len(set(names)) != len(names):
        raise ValueError(f"two hosts joined under one node name: {sorted(names)} (set --node-name)")
    last = max(proposals, key=lambda p: (bool(p.hosts), p.next_attempt)).hosts
    hosts = host_order(names, last)
    first = next(p for p in proposals if p.node == hosts[0])
    return WorldPlan(
        attempt=max(p.next_attempt for p in proposals),
        resume=min((p.resume for p in proposals if p.resume is not None), default=-1),
        hosts=hosts,
        nproc_per_node=nproc_per_node,
        master_addr=first.addr,
        master_port=first.port,
        quarantined=tuple(sorted({n for p in proposals for n in p.quarantined})),
    )


def host_order(joined: Sequence[str], last: Sequence[str]) -> tuple[str, ...]:
    """The round's hosts in group-rank order. torch numbers a round's hosts by their node
    descriptors, so a host that takes a lost one's place would shift the others' ranks;
    a rank kept in process (docs/inprocess.md) holds its own rank's state, so when the
    world keeps its size every host of the last world keeps its place and newcomers fill
    the lost hosts' places, in torch's order. Otherwise torch's order."""
    if len(last) != len(joined):
        return tuple(joined)
    newcomers = iter([n for n in joined if n not in last])
    return tuple(n if n in joined else next(newcomers) for n in last)


class HostRendezvous:
    """This host's side of the rendezvous: one round per attempt, and the plan agreed in it."""

    def __init__(self, spec: RendezvousSpec, nproc_per_node: int, elastic: bool = False) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        # torch 2.15 shares one TCPStore server across rounds, created by the first round's
        # rank 0; a spare that joins a later round then waits forever for a MASTER_ADDR no
        # one writes in that round (and, blocked on the store's one connection, stops its
        # keep-alives). Unshared, rank 0 of every round writes it. (NOTES.md: gloo restarts
        # need the same setting under torchrun.)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        self.spec = spec
        self.nproc_per_node = nproc_per_node
        self.plan_timeout_s = float(spec.conf.get("join_timeout", 600))
        self.defaults = {**DEFAULT_CONF, **(ELASTIC_CONF if elastic else {})}
        config: dict[str, Any] = {**self.defaults, **spec.conf}
        params = RendezvousParameters(
            backend=spec.backend,
            endpoint=spec.endpoint,
            run_id=spec.run_id,
            min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes,
            local_addr=spec.local_addr,
            **config,
        )
        self.handler = get_rendezvous_handler(params)
        self.group_rank = -1
        #: The last round's own store (a prefix of the rendezvous store): the hosts of
        #: that round's attempt share it (the in-process abort and stacks: hot.py).
        self.store: Any = None

    def next_world(self, propose: Callable[[], Proposal], free_port: Callable[[str], int]) -> WorldPlan:
        """Join the next round (blocks until it completes, or raises after join_timeout),
        propose, and return the plan every host of the round gets. `propose()` is called
        once the round is complete, not before: a spare may wait in the rendezvous for
        hours, and what it knew when it began waiting (the newest checkpoint) is stale.
        `free_port(addr)` picks a port of this host for rank 0's store (used if it gets group rank 0)."""
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousConnectionError,
            RendezvousTimeoutError,
        )

        spec = self.spec
        try:
            info = self.handler.next_rendezvous()
        except RendezvousTimeoutError as exc:
            timeout = {**self.defaults, **spec.conf}.get("join_timeout", "600")
            raise NoRound(
                f"no round of {spec.min_nodes} to {spec.max_nodes} hosts formed within {timeout} s"
            ) from exc
        except RendezvousClosedError as exc:
            raise NoRound("the rendezvous is closed: the run ended on the other hosts") from exc
        except RendezvousConnectionError as exc:
            raise NoRound(
                f"the rendezvous store at {spec.endpoint} is unreachable (its host is gone?): {exc}"
            ) from exc
        store, self.group_rank = info.store, info.rank
        self.store = store
        proposal = propose()
        addr = proposal.addr or self.spec.local_addr or socket.getfqdn()
        mine = replace(proposal, addr=addr, port=free_port(addr))
        store.set(_PROPOSAL.format(info.rank), mine.to_json())
        if info.rank == 0:
            raw = [self._get(store, _PROPOSAL.format(r)) for r in range(info.world_size)]
            plan = decide([Proposal.from_json(p) for p in raw], self.nproc_per_node)
            store.set(_PLAN, plan.to_json())
            log.info("rendezvous: attempt %d on %s, resume %d", plan.attempt, plan.hosts, plan.resume)
            return plan
        return WorldPlan.from_json(self._get(store, _PLAN))

    def _get(self, store: Any, key: str) -> bytes:
        """`key` once another host wrote it. Polled with check(): a blocking get would hold
        the store's one connection, and with it this host's keep-alives, until the key came."""
        deadline = time.monotonic() + self.plan_timeout_s
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rendezvous: {key} not written within {self.plan_timeout_s:g} s (a host died?)"
                )
            time.sleep(0.02)
        value: bytes = store.get(key)
        return value

    def nodes_waiting(self) -> int:
        """Hosts waiting to join below MAX (a spare at MAX waits in the redundancy list).
        0 when the store cannot be reached: its host ended (the run is over there, and this
        host's ranks end with it) or died (this host's ranks fail their collectives). Either
        way the attempt's own end decides; this poll is only a chance to grow the world."""
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return int(self.handler.num_nodes_waiting())
        except RendezvousConnectionError:
            log.debug("rendezvous: the store is unreachable; no host counted as waiting", exc_info=True)
            return 0

    def close(self) -> None:
        """This host leaves for good (the run ended, or it was quarantined)."""
        try:
            self.handler.shutdown()
        except Exception:  # the store's host may be gone: nothing left to tell
            log.debug("rendezvous: shutdown failed", exc_info=True)
