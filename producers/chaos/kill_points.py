"""The launcher's kill points: ``TRAINGUARD_LAUNCHER_FAULT=point[:detail]`` makes
`trainguard launch` SIGKILL itself at a named point of a restart or a command, as an OOM
kill would, so the tests can prove that a relaunched launcher neither repeats nor loses an
action (producers/launcher/recovery.py). Unset (production), every point is a no-op."""

from __future__ import annotations

import logging
import os
import signal

#: ``point[:detail]`` makes the launcher SIGKILL itself there (:func:`kill_at`).
FAULT_ENV = "TRAINGUARD_LAUNCHER_FAULT"
#: The named points, in the order a restart passes them (detail: the attempt, or a command's kind).
FAULT_POINTS = (
    "before-command",  # the actuator journaled the command id; its effect is not recorded yet
    "after-command",  # the command's effect is journaled; not applied, not acked
    "after-interruption",  # the attempt's end is journaled; its ranks are still running
    "after-teardown",  # every rank of the attempt is gone and journaled so
    "before-spawn",  # the next attempt's intent is journaled; nothing spawned
    "mid-spawn",  # the ranks are spawned; their pids are not journaled
    "after-spawn",  # their pids are journaled
)


def kill_at(fault: str, point: str, detail: object = "") -> None:
    """With `fault` (LauncherConfig.fault, FAULT_ENV's value) = "point" or "point:detail"
    (FAULT_POINTS; detail the attempt or the command's kind), SIGKILL this process there."""
    if not fault:
        return
    name, _, want = fault.partition(":")
    if name == point and (not want or want == str(detail)):
        logging.getLogger(__name__).warning("fault injection: SIGKILL at %s (%s)", point, detail)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
