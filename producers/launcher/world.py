"""The stage before every attempt: which ranks run where, from which checkpoint.

Two ways to form a world, one interface (:class:`WorldFormation`):

- :class:`LocalWorld`, on one host: every rank runs here; nodes are modelled (groups of
  ``ranks_per_node`` local ranks, :mod:`.plan`), a quarantined node's ranks move to a
  spare, and a spare joins only after its self-test (:mod:`.spares`).
- :class:`HostWorld`, one agent per host (docs/multihost.md): a round of torch elastic's
  rendezvous forms the world and the hosts agree on one plan in it
  (:mod:`.rendezvous`); this agent runs its host's share of the ranks.

Either returns a :class:`World`, or raises :class:`NoWorld` with why the run cannot go
on (the pool is exhausted, every checkpoint was rejected, this host is quarantined).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from .config import LauncherConfig, free_port
from .journal import AttemptRecord
from .liveness import HostBeat, Liveness, newest_world
from .node_selftest import SELF_TESTS
from .plan import NodePool, Placement, PoolExhausted, plan
from .rendezvous import HostRendezvous, NoRound, Proposal, WorldPlan
from .resume import ResumeChoice
from .roll_call import RollCall, roll_call
from .run_state import LauncherState
from .shared_quarantine import SharedQuarantine, lost_without_fault, refusal
from .spare_selftest import NodeTester
from .spares import SpareAdmission
from .story import Story, gone

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpareCall:
    """Why a spare agent (--spare) joined the run: the world it saw lose hosts."""

    attempt: int  # that world's attempt
    hosts: tuple[str, ...]  # its hosts, in group-rank order
    lost: Mapping[str, str]  # host -> why it is out (its beat stopped, or quarantined)
    #: Wall clock: the last beat of the host found lost (a quarantine's: when it was seen).
    fault_ts: float
    detected_ts: float


@dataclass(frozen=True)
class World:
    """One attempt as this launcher runs it."""

    attempt: int
    placement: Placement  # every rank's node
    resume: int  # the checkpoint step every rank resumes from (-1: none)
    local_ranks: tuple[int, ...]  # the ranks this launcher spawns
    master_addr: str
    master_port: int | None  # None: a free port of this host, picked at spawn
    #: Across hosts: how many hosts wait to join (the watch restarts the world for them);
    #: the RunStarted of the attempt is the same event from every host (one id).
    nodes_waiting: Callable[[], int] | None = None
    #: Across hosts: seconds this host spent in the round that formed this world.
    rendezvous_s: float | None = None
    #: Across hosts: the store of that round, shared by every host of the attempt.
    shared_store: Any = None
    #: Across hosts: the world this one follows (this host's last one; for a spare, the
    #: one it joins), and its hosts this one has not, with why (story.py tells them).
    before: Placement | None = None
    left: Mapping[str, str] = field(default_factory=dict)
    #: A spare's first world: why it came (its share of the interruption: launcher.py).
    called: SpareCall | None = None


class NoWorld(Exception):
    """No attempt can start: `reason` says why. `after_interruption`: the interruption
    that ended the last attempt is recorded (its restart never came). `status`: the run's
    for this launcher ("ok" for a spare the run finished without)."""

    def __init__(
        self,
        reason: str,
        after_interruption: bool = True,
        status: Literal["ok", "failed", "stopped"] = "failed",
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after_interruption = after_interruption
        self.status = status


class WorldFormation(Protocol):
    config: LauncherConfig
    #: Elastic training: the size of the next world (None: the run's full size).
    size: int | None

    def form(self, first: bool, reuse: AttemptRecord | None) -> World:
        """The next attempt's world (`first`: this launcher's first attempt; `reuse`: the
        attempt a predecessor journaled but never spawned, which starts again as it was)."""
        ...

    def close(self, clean: bool) -> None:
        """The run is over for this launcher (`clean`: every rank exited 0)."""
        ...


def resume_step(state: LauncherState, resume: ResumeChoice, reuse: AttemptRecord | None) -> int:
    """Under the lock: the next attempt's resume step: a Rollback/ResumeFrom's (one that
    came between attempts is taken now), else the step of the attempt a predecessor
    journaled but never spawned, else the newest eligible checkpoint."""
    late = state.request
    if late is not None and late.resume_step is not None:
        resume.take(late)
    state.request, state.evict, state.drain = None, None, None
    if state.forced_resume is not None:
        step = state.forced_resume
    elif reuse is not None:
        step = reuse.resume
    else:
        step = resume.newest()
    state.forced_resume = None
    return step


class LocalWorld:
    def __init__(
        self,
        config: LauncherConfig,
        pool: NodePool,
        state: LauncherState,
        resume: ResumeChoice,
        spares: SpareAdmission,
    ) -> None:
        self.config, self.pool, self.state, self.resume, self.spares = config, pool, state, resume, spares
        self.size: int | None = None

    def form(self, first: bool, reuse: AttemptRecord | None) -> World:
        state = self.state
        if not first:
            state.attempt += 1
        self.spares.admit()
        with state.lock:
            try:
                size = self.config.nproc if first or self.size is None else self.size
                state.placement = plan(self.pool, state.quarantined, size, state.placement)
            except PoolExhausted as exc:
                raise NoWorld(str(exc), after_interruption=False) from None
            state.busy = frozenset(state.placement.nodes)  # until the attempt's ranks are gone
            placement = state.placement
            step = resume_step(state, self.resume, reuse)
            left = self.resume.none_left(step)
        if left:
            raise NoWorld(left)
        ranks = tuple(range(placement.world_size))
        return World(state.attempt, placement, step, ranks, self.config.master_addr, None)

    def close(self, clean: bool) -> None:
        pass


class HostWorld:
    def __init__(
        self,
        config: LauncherConfig,
        node: str,
        state: LauncherState,
        resume: ResumeChoice,
        rendezvous: HostRendezvous,
        tester: NodeTester | None = None,
    ) -> None:
        self.config, self.node, self.state, self.resume = config, node, state, resume
        self.size: int | None = None  # across hosts the rendezvous round sizes the world
        self.rendezvous = rendezvous
        #: A spare agent proves its own host with it while it waits (self_test_spares).
        self.tester = tester if config.self_test_spares != "off" else None
        self.shared = SharedQuarantine(config.shared_dir)
        self.reasons: dict[str, str] = {}
        self.beat = HostBeat(config.shared_dir, node).start()
        self.waiting_as_spare = config.spare
        self.story = Story(node)
        self.called: SpareCall | None = None  # set when a spare joins, taken by its first world
        #: Elastic training: the smaller world the survivors' roll call agreed on, taken by
        #: the next form (instead of a round), and the seconds the roll call took.
        self.shrunk: WorldPlan | None = None
        self.roll_s = 0.0
        #: The resume step this agent proposed in a roll call that decided on a round.
        self.proposed_step: int | None = None
        #: The port this host proposes for the attempt's store, given its address: a free
        #: one (rank 0 serves it), or under in-process restart one its agent already serves.
        self.port_for: Callable[[str], int] = free_port
        #: Under in-process restart: until this host's first workers have imported everything.
        self.warm: Callable[[], object] | None = None

    def _learn(self, listed: dict[str, str]) -> None:
        """Quarantines decided elsewhere, journaled here too (a relaunched agent keeps them);
        and lost hosts readmitted since (their agent back and self-tested: elastic training)."""
        state = self.state
        back = self.shared.readmitted()
        with state.lock:
            for node, why in sorted(listed.items()):
                if node not in state.quarantined and node not in back:
                    state.record(None, f"{node} is out of the run: {why}", quarantine=node)
                    state.quarantined.add(node)
                    self.reasons[node] = why
            for node in sorted(state.quarantined & back.keys()):
                if node not in listed:
                    state.record(None, f"{node} was lost and is readmitted", release=node)
                    state.quarantined.discard(node)

    def _quarantine(self, node: str, why: str) -> None:
        """A host this agent found lost: out of the run, on shared storage and here."""
        if node not in self.state.quarantined:
            self.shared.add(node, why, by=self.node)
            self._learn({node: why})

    def _no_round(self, why: str) -> str:
        """Why the run stops without a world: the hosts out of it and their causes, and
        the spare that did not come."""
        with self.state.lock:
            out = sorted(self.state.quarantined)
        listed = self.shared.nodes()
        causes = (
            "; ".join(f"{n}: {self.reasons.get(n) or listed.get(n, 'quarantined')}" for n in out) or "none"
        )
        return (
            f"{why}. Out of the run: {causes}. No spare host joined to take their ranks "
            f"(start an agent on a spare host with the same flags and its own --node-name)"
        )

    def _refusal(self) -> str:
        why = self.reasons.get(self.node) or self.shared.nodes().get(self.node, "quarantined")
        return refusal(self.node, self.config.run_id, why)

    def _wait_until_needed(self) -> None:
        """A spare (--spare) stays out of the rendezvous, where it would grow a world below
        MAX, until the run needs a host: one of the newest world's hosts stopped beating
        or is on the quarantine list (elastic training: or that world went on without a
        lost host). The run finished without it: NoWorld, status ok."""
        live = Liveness(self.config.shared_dir)
        self.story.say(
            f"waits as a spare for run {self.config.run_id}: it joins when one of its hosts is lost"
        )
        ahead = self.config.self_test_spares == "ahead"
        while not self.state.stop.wait(0.5):
            if self.tester is not None and ahead and not self.tester.fresh(self.node):
                self.tester.start(self.node, SELF_TESTS, "spare")  # in the background; renewed when stale
            self._refuse_if_failed()
            attempt, nodes, finished = newest_world(self.config.shared_dir)
            if finished:
                raise NoWorld(
                    f"spare {self.node} not needed: run {self.config.run_id} finished", False, status="ok"
                )
            quiet = live.gone(nodes, self.config.host_stale_s)
            listed = self.shared.nodes()
            out = [n for n in nodes if n in listed and n not in quiet] + self._shrunk_without(nodes, listed)
            if attempt >= 0 and (quiet or out):
                now = time.time()
                lost = {
                    n: f"host lost: its beat stopped {s:.1f} s ago, in attempt {attempt}"
                    for n, s in quiet.items()
                }
                lost |= {n: listed[n] for n in out}
                self.called = SpareCall(attempt, nodes, lost, now - max(quiet.values(), default=0.0), now)
                self._prove_now()
                for host, why in sorted(lost.items()):
                    self.story.say(f"{gone(host, why)}; {self.node} takes its place")
                self.waiting_as_spare = False
                return
        raise NoWorld(f"spare {self.node} stopped while waiting", False, status="stopped")

    def _shrunk_without(self, nodes: tuple[str, ...], listed: Mapping[str, str]) -> list[str]:
        """Elastic training: the newest world went on without hosts lost (on the list for
        it, not in that world), below MAX: this spare takes their place (the world grows
        back to it at a checkpoint boundary)."""
        spec = self.config.rendezvous
        if not self.config.elastic or spec is None or not nodes or len(nodes) >= spec.max_nodes:
            return []
        return sorted(n for n, why in listed.items() if lost_without_fault(why) and n not in nodes)

    def _prove_now(self) -> None:
        """Needed: join with a fresh pass (proven while waiting, or tested now)."""
        if self.tester is None or self.tester.fresh(self.node):
            return
        self.tester.start(self.node, SELF_TESTS, "spare")
        if self.tester.wait(self.node, self.config.self_test_timeout_s + 30) is None:
            self.tester.failed.setdefault(self.node, "its self-test never finished")
        self._refuse_if_failed()

    def _refuse_if_failed(self) -> None:
        """This spare host failed its self-test: out of the run for every agent, and it stops."""
        if self.tester is not None and (why := self.tester.failed.get(self.node)) is not None:
            self._quarantine(self.node, f"failed its self-test: {why}")
            raise NoWorld(f"spare {self.node} failed its self-test and does not join: {why}")

    def _readmit(self) -> None:
        """This host is on the run's list. Under elastic training a host lost without a
        fault of its own (its agent gone) comes back as a spare would: once it passes the
        node self-test (untested with --self-test off), it is off the list for every agent
        and rejoins; otherwise, or when the test fails, it does not."""
        why = self.shared.nodes().get(self.node) or self.reasons.get(self.node, "quarantined")
        if not (self.config.elastic and lost_without_fault(why)):
            raise NoWorld(self._refusal())
        if self.tester is not None:
            self.tester.start(self.node, SELF_TESTS, "quarantine")  # a suspect back: its test
            report = self.tester.wait(self.node, self.config.self_test_timeout_s + 30)
            failed = self.tester.failed.get(self.node) or (None if report else "its self-test never finished")
            if failed is not None:
                self.shared.add(self.node, f"failed its self-test: {failed}", by=self.node, again=True)
                raise NoWorld(f"{self.node} failed its self-test and does not rejoin: {failed}")
        newest, _, _ = newest_world(self.config.shared_dir)
        tested = "passed its self-test" if self.tester is not None else "untested (--self-test off)"
        self.shared.release(self.node, self.node, readmitted_in=newest, reason=f"readmitted: {tested}")
        with self.state.lock:
            self.state.record(None, f"{self.node} is back in the run: {tested}", release=self.node)
            self.state.quarantined.discard(self.node)
        lost = why.removeprefix("host lost: ")
        self.story.say(f"{self.node} was lost ({lost}); back: {tested}, it rejoins")

    def _joins_a_running_world(self) -> bool:
        """The run's newest world is running without this host (it joins, or comes back)."""
        attempt, nodes, finished = newest_world(self.config.shared_dir)
        return attempt >= 0 and not finished and self.node not in nodes

    def _proposal(self, first: bool, reuse: AttemptRecord | None) -> Proposal:
        """What this host knows now, for a round's plan or the survivors' roll call."""
        state = self.state
        with state.lock:
            step = resume_step(state, self.resume, reuse)
            if self.proposed_step is not None:  # a roll call already took the step
                step, self.proposed_step = self.proposed_step, None
            quarantined = tuple(sorted(state.quarantined))
            last = state.placement
        hosts = last.nodes if last is not None and self.node in last.nodes else ()
        next_attempt = state.attempt if first else state.attempt + 1
        return Proposal(self.node, next_attempt, step, quarantined, hosts=hosts)

    def roll_call(self, attempt: int, wait: bool) -> bool:
        """Elastic training, after this host's ranks lost a peer in `attempt` (they wait in
        their processes): the survivors' roll call (roll_call.py). True when the hosts that
        answered go on without the others in a smaller world (the next form takes it)."""
        self._learn(self.shared.nodes())
        state, spec = self.state, self.config.rendezvous
        with state.lock:
            last = state.placement
            out = self.node in state.quarantined
        if spec is None or last is None or out or self.rendezvous.store is None:
            return False
        cfg = self.config
        call = RollCall(attempt, last.nodes, spec.min_nodes, cfg.ranks_per_node, cfg.survivors_wait_s)
        started = time.monotonic()
        mine = self._proposal(False, None)
        addr = spec.local_addr or socket.getfqdn()
        answer = replace(mine, addr=addr, port=self.port_for(addr))
        try:
            plan = roll_call(self.rendezvous.store, call, answer, wait)
        except Exception as exc:  # the store's host may be the one lost: a round tells
            log.warning("the survivors' roll call failed (%s): the world re-forms in a round", exc)
            plan = None
        self.roll_s = time.monotonic() - started
        if plan is None or self.node not in plan.hosts:
            self.proposed_step = mine.resume
            return False
        self.shrunk = plan
        return True

    def form(self, first: bool, reuse: AttemptRecord | None) -> World:
        state = self.state
        if self.waiting_as_spare:
            self._wait_until_needed()
        self._learn(self.shared.nodes())  # what other hosts' agents put on shared storage
        with state.lock:
            listed_here = self.node in state.quarantined
        if listed_here:
            self._readmit()  # or NoWorld
        if first and self.warm is not None and self.config.elastic and self._joins_a_running_world():
            self.warm()  # the world grows to it at a boundary: its ranks wait for no import

        joined = time.monotonic()
        shrunk, self.shrunk = self.shrunk, None
        try:
            agreed = shrunk or self.rendezvous.next_world(lambda: self._proposal(first, reuse), self.port_for)
        except NoRound as exc:
            raise NoWorld(self._no_round(str(exc))) from None
        self._learn({node: "quarantined by another host" for node in agreed.quarantined})
        with state.lock:
            previous = state.placement
        survivor = previous is not None and self.node in previous.nodes
        called, self.called = self.called, None
        before = previous if survivor or called is None else self._placement(called.hosts)
        gone_hosts = [h for h in before.nodes if h not in agreed.hosts and h != self.node] if before else []
        if survivor:
            for lost in gone_hosts:
                why = f"host lost: its agent left the rendezvous during attempt {state.attempt}"
                if shrunk is not None:
                    why = (
                        f"host lost: its agent did not answer the survivors of attempt {state.attempt} "
                        f"within {self.config.survivors_wait_s:g} s"
                    )
                self._quarantine(lost, why)
        listed = self.shared.nodes()  # the decision's reason, whoever made it
        reasons = dict(called.lost) if called is not None else {}
        out = {
            h: listed.get(h) or reasons.get(h) or self.reasons.get(h, "left the rendezvous")
            for h in gone_hosts
        }
        with state.lock:
            if self.node in state.quarantined:
                raise NoWorld(self._refusal())
            state.attempt = agreed.attempt
            placement = self._placement(agreed.hosts, before)
            state.placement = placement
            state.busy = frozenset({self.node})
        left = self.resume.none_left(agreed.resume)
        if left:
            raise NoWorld(left)
        ranks = tuple(agreed.ranks_of(self.node))
        return World(
            agreed.attempt,
            placement,
            agreed.resume,
            ranks,
            agreed.master_addr,
            agreed.master_port,
            nodes_waiting=self.rendezvous.nodes_waiting,
            rendezvous_s=self.roll_s if shrunk is not None else time.monotonic() - joined,
            shared_store=self.rendezvous.store,
            before=before,
            left=out,
            called=called,
        )

    def _placement(self, hosts: tuple[str, ...], before: Placement | None = None) -> Placement:
        """`hosts` in group-rank order, each with `ranks_per_node` ranks; with `before` of
        the same size, the slots whose host changed (a lost host's ranks, to its replacement)."""
        rpn = self.config.ranks_per_node
        moved: dict[int, tuple[str, str]] = {}
        if before is not None and len(before.nodes) == len(hosts):
            moved = {
                i: (old, new)
                for i, (old, new) in enumerate(zip(before.nodes, hosts, strict=True))
                if old != new
            }
        return Placement(hosts, rpn, len(hosts) * rpn, moved)

    def close(self, clean: bool) -> None:
        """The run is over for this host: its beat stops. After a clean end the rendezvous
        is closed for every host (as torchrun does); otherwise this host only stops its
        keep-alives and is dropped from the rendezvous when they lapse."""
        self.beat.stop()
        if clean and not self.waiting_as_spare:  # a spare that never joined closes nothing
            self.rendezvous.close()
