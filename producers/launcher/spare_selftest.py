"""The launcher's node self-tests (seed §SDC (c), issue 15 item 6): each runs on a thread
of its own, so that neither the restart loop nor the actuator waits for one unless it must.

- A quarantined node is tested once its ranks have left it (RunNodeSelfTest: the test
  needs the node's devices to itself), in the background; a node that fails stays out.
- A spare is tested before it joins: the launcher starts the test as soon as a quarantine
  makes the spare the next placement's (overlapping the rest of the attempt, its teardown
  and the decision wait), and waits for the verdict before it spawns ranks there.

Each result goes out as a NodeSelfTestResult (the core's input) with its reason. The test
itself is a callable (default :func:`~.node_selftest.run_node_self_test`), so launcher tests can
use a double at that boundary.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .node_selftest import NodeSelfTestReport

log = logging.getLogger(__name__)

#: runner(node, devices, tests) -> the node's report.
Runner = Callable[[str, int, Sequence[str]], NodeSelfTestReport]
#: report(node's report, purpose, command_id): publish it.
Reporter = Callable[[NodeSelfTestReport, str, str], None]


@dataclass
class _Test:
    node: str
    purpose: str
    command_id: str
    thread: threading.Thread | None = None
    report: NodeSelfTestReport | None = None
    done: threading.Event = field(default_factory=threading.Event)


class NodeTester:
    """Self-tests by node: at most one in flight per node; the latest verdict per node."""

    def __init__(
        self,
        runner: Runner,
        devices: int,
        report: Reporter,
        on_fail: Callable[[str], None],
        fresh_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        #: A pass older than this no longer admits a spare (it is tested again).
        self.fresh_s = fresh_s
        self.clock = clock
        self.devices = devices
        self.report = report
        self.on_fail = on_fail
        self._lock = threading.Lock()
        self._tests: dict[str, _Test] = {}
        self._closed = threading.Event()
        #: node -> summary of the test it failed (it stays out for the run).
        self.failed: dict[str, str] = {}
        self.passed: set[str] = set()
        #: node -> when its latest pass finished (clock()).
        self.passed_at: dict[str, float] = {}

    def fresh(self, node: str) -> bool:
        """`node` passed its latest test less than `fresh_s` ago."""
        with self._lock:
            return self._fresh_locked(node)

    def age_s(self, node: str) -> float | None:
        """Seconds since `node`'s latest pass (None: it has none)."""
        with self._lock:
            at = self.passed_at.get(node) if node in self.passed else None
        return None if at is None else self.clock() - at

    def start(
        self,
        node: str,
        tests: Sequence[str],
        purpose: str,
        command_id: str = "",
        ready: Callable[[], bool] | None = None,
    ) -> bool:
        """Test `node` once `ready()` (default: now). False if a test of it is in flight
        (its verdict will do) or it already has the verdict this purpose asks for."""
        with self._lock:
            current = self._tests.get(node)
            if current is not None and not current.done.is_set():
                return False
            if purpose == "spare" and (node in self.failed or self._fresh_locked(node)):
                return False
            test = self._tests[node] = _Test(node, purpose, command_id)
            test.thread = threading.Thread(
                target=self._run, args=(test, list(tests), ready), name=f"selftest-{node}", daemon=True
            )
            test.thread.start()
        return True

    def _fresh_locked(self, node: str) -> bool:
        at = self.passed_at.get(node)
        return node in self.passed and at is not None and self.clock() - at < self.fresh_s

    def wait(self, node: str, timeout_s: float | None = None) -> NodeSelfTestReport | None:
        with self._lock:
            test = self._tests.get(node)
        if test is None:
            return None
        test.done.wait(timeout_s)
        return test.report

    def close(self, timeout_s: float) -> None:
        """Let tests still waiting for their node run now (the run is over: every node is
        free) and wait for those of suspect nodes, at most `timeout_s` in all (a spare's
        test is only worth its verdict for a placement, and there is none to come)."""
        self._closed.set()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            tests = [t for t in self._tests.values() if t.purpose != "spare"]
        for test in tests:
            test.done.wait(max(0.0, deadline - time.monotonic()))

    def _run(self, test: _Test, tests: list[str], ready: Callable[[], bool] | None) -> None:
        try:
            while ready is not None and not ready() and not self._closed.wait(0.2):
                pass
            try:
                report = self.runner(test.node, self.devices, tests)
            except Exception as exc:  # the test could not run at all: not a pass
                report = NodeSelfTestReport(test.node, tests, errors=[f"{type(exc).__name__}: {exc}"[:500]])
            test.report = report
            with self._lock:
                if report.passed:
                    self.passed.add(test.node)
                    self.passed_at[test.node] = self.clock()
                else:
                    self.failed[test.node] = report.summary()
                    self.passed.discard(test.node)
            log.warning("self-test (%s): %s", test.purpose, report.summary())
            if not report.passed:
                self.on_fail(test.node)
            self.report(report, test.purpose, test.command_id)
        except Exception:
            log.exception("self-test of %s", test.node)
        finally:
            test.done.set()
