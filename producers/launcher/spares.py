"""Spares join only after a self-test: when the launcher tests a spare, and what a failed
test does (the spare is quarantined and the placement made again).

``self_test_spares`` (LauncherConfig) chooses when: "ahead" (the default), every idle
spare one at a time from the start of the run, and again whenever its pass is older than
``self_test_fresh_s``, so the restart that needs a spare finds it proven and waits for
nothing (R is what the user pays; a spare's devices are idle anyway); "on-demand", from
the moment a quarantine makes a spare the next placement's (overlapping the rest of the
attempt, its teardown and the decision wait), so a restart that needs a spare not yet
tested waits for its test; "off": untested. Whatever the mode, a spare joins only with a
fresh pass: one still stale when it is needed is tested first.

A quarantined node's own self-test (RunNodeSelfTest, to release it) waits for its ranks
to leave it and for the restart to finish (`settled`): it never competes with the
restart it would only delay. The tests run on :class:`~.spare_selftest.NodeTester`'s
threads.
"""

from __future__ import annotations

import threading
from typing import Any

from .config import LauncherConfig
from .events import LauncherEvents
from .fork_server import ForkServers
from .node_selftest import SELF_TESTS, NodeSelfTestReport, run_node_self_test
from .plan import NodePool, PoolExhausted, plan, quarantine_effect
from .run_state import LauncherState
from .spare_selftest import NodeTester, Runner


class SpareAdmission:
    def __init__(
        self,
        config: LauncherConfig,
        pool: NodePool,
        state: LauncherState,
        events: LauncherEvents,
        runner: Runner | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.state = state
        self.tester = NodeTester(
            runner or self._run_self_test,
            config.ranks_per_node,
            events.self_test_result,
            self.failed,
            fresh_s=config.self_test_fresh_s,
        )
        #: Set while no restart is in progress (the launcher's RestartRecorder keeps it).
        self.settled = threading.Event()
        self.settled.set()
        #: The ranks' fork servers (the launcher's attempts own them): a self-test's workers
        #: are forked from one when it is up, instead of importing torch each.
        self.forks: ForkServers | None = None

    def _run_self_test(self, node: str, devices: int, tests: Any) -> NodeSelfTestReport:
        """The real test: one worker process per device of `node`, with the ranks' extra
        environment (so a fire drill's TRAINGUARD_INJECT_WRONG_DEVICE reaches it), forked
        from the ranks' fork server when it is up."""
        fork = self.forks.popen if self.forks is not None else None
        timeout_s = self.config.self_test_timeout_s
        return run_node_self_test(node, devices, tests, timeout_s, self.config.env, fork=fork)

    def free(self, node: str) -> bool:
        """No live rank is on `node`: between attempts, after the run, or not in the placement."""
        return self.state.ended.is_set() or node not in self.state.busy

    def joining(self) -> list[str]:
        """Spares the next placement would bring in that have not passed a self-test."""
        state = self.state
        with state.lock:
            try:
                nxt = plan(self.pool, state.quarantined, self.config.nproc, state.placement)
            except PoolExhausted:
                return []  # the placement itself says so
            before = set(state.placement.nodes) if state.placement is not None else set()
        own = self._own()
        return [n for n in nxt.nodes if n not in own and n not in before and not self.tester.fresh(n)]

    def _own(self) -> set[str]:
        """The job's own nodes: the pool's first, as many as the world needs."""
        return set(self.pool.nodes[: self.pool.slots(self.config.nproc)])

    def idle_spares(self) -> list[str]:
        """Spares no rank uses: not the job's own nodes, not quarantined, not placed."""
        own = self._own()
        with self.state.lock:
            out = set(self.state.quarantined)
            placed = set(self.state.placement.nodes) if self.state.placement is not None else set()
        return [n for n in self.pool.nodes if n not in own and n not in out and n not in placed]

    def pretest(self) -> None:
        """Keep the idle spares proven while the run trains: each one tested in turn (one at
        a time: bounded extra load) from the start, and again once its pass is older than
        `self_test_fresh_s`; until the run ends."""
        state, fresh_s = self.state, self.config.self_test_fresh_s
        while not (state.ended.is_set() or state.stop.is_set()):
            for node in self.idle_spares():
                if state.ended.is_set() or state.stop.is_set():
                    return
                if not self.tester.fresh(node):
                    self.tester.start(node, SELF_TESTS, "spare")
                    self.tester.wait(node)
            ages = [age for n in self.idle_spares() if (age := self.tester.age_s(n)) is not None]
            state.ended.wait(max(1.0, fresh_s - max(ages, default=0.0)))

    def prestart(self) -> None:
        """A quarantine changed the next placement: start testing the spares it brings in."""
        if self.config.self_test_spares != "off":
            for node in self.joining():
                self.tester.start(node, SELF_TESTS, "spare")

    def admit(self) -> None:
        """Before an attempt: every spare its placement brings in has passed the self-test;
        one that fails is quarantined (by the tester) and the placement made again."""
        if self.config.self_test_spares == "off":
            return
        while not self.state.stop.is_set():
            joining = self.joining()
            if not joining:
                return
            for node in joining:
                self.tester.start(node, SELF_TESTS, "spare")
            for node in joining:
                report = self.tester.wait(node, self.config.self_test_timeout_s + 30)
                if report is None:  # never finished: keep it out rather than trust it
                    self.failed(node)

    def failed(self, node: str) -> None:
        """`node` failed its self-test: it leaves the pool for the run (journaled)."""
        state = self.state
        with state.lock:
            if node in state.quarantined:
                return
            effect = quarantine_effect(self.pool, state.quarantined, node, self.config.nproc, state.placement)
            state.record(None, f"{node} failed its self-test: {effect}", quarantine=node)
            state.quarantined.add(node)
