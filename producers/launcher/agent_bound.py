"""Ranks never outlive their agent (issue 44): a rank process whose launcher is gone is
killed by the kernel before it can write again (a checkpoint, a telemetry batch, a
progress file), whatever the restart mode, warm spares included.

The ranks run in sessions of their own (torch elastic's process layer; hot.py likewise),
so a signal to the launcher's process group does not reach them, and a launcher killed
outright (SIGKILL, the OOM killer) cannot end them. Each rank process is therefore started
through this file run as a script: ``python -I -S agent_bound.py <launcher pid> -- program
args...`` sets Linux's ``PR_SET_PDEATHSIG`` to SIGKILL and execs the program (same pid:
the launcher's handle, its journal and torch elastic see the program itself; ~20 ms
before the exec; ``-I -S``: stdlib only, no site-packages to import). The death signal
survives the exec and fires when the thread that forked the process ends: the launcher
spawns every rank and spare from the thread that runs ``Launcher.run``, which ends them
itself before it returns. A launcher that died between the fork and the ``prctl`` is
caught by comparing the parent's pid afterwards.

Only the rank process itself is bound: a program that runs the training in a child
(``sh -c "python train.py; ..."``) leaves that child to the rank side's watch
(producers/training/agent_watch.py: TRAINGUARD_AGENT_PID); a relaunched launcher still
ends whatever carries its run dir in its environment (recovery.py). Off Linux the
program is run as given.

Nothing but the standard library is imported here: this file runs before the program.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

#: The launcher's pid in every rank's environment (the rank side's watch reads it).
ENV_AGENT_PID = "TRAINGUARD_AGENT_PID"
#: linux/prctl.h
PR_SET_PDEATHSIG = 1


def bound(program: Sequence[str]) -> tuple[str, ...]:
    """`program` as the launcher spawns it: killed when this process (its agent) dies."""
    if not sys.platform.startswith("linux"):
        return tuple(program)
    return (sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), "--", *program)


def _exec(argv: list[str]) -> None:
    """``<agent pid> -- program args...``: bind this process to its parent, then become
    the program."""
    import ctypes

    agent, program = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # never expected on Linux
        print(f"trainguard: PR_SET_PDEATHSIG failed (errno {ctypes.get_errno()})", file=sys.stderr)
    if os.getppid() != agent:  # the agent died before the prctl: as if it fired
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        os.execvp(program[0], program)
    except OSError as exc:  # as a shell says it; the rank's stderr is the launcher's to read
        print(f"trainguard: cannot run {program[0]!r}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    _exec(sys.argv[1:])
