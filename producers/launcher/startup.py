"""A start-up failure that repeats is code, not hardware (issue 44).

A script that raises before its first training step (a wrong flag, Lightning's
``sync_batchnorm=True`` on CPU, a missing file) fails the same way on every attempt and
every node: ``--max-restarts`` restarts of it only keep a human waiting. The processor's
``same_step`` rule cannot see it (no step was completed; offline there is no processor),
so the launcher decides this by itself, after each attempt, and waits on nobody:

- the attempt failed *at start-up*: it ended in a crash while none of its ranks had
  completed a step (their progress files, records.py), and the crash's rank exited with
  an error status (a signal, an OOM kill, a lost peer's teardown say nothing of the code);
- its *error* is what that rank reported: torch elastic's error file
  (TORCHELASTIC_ERROR_FILE, written by a script under ``@record``), else the exception
  line of the last traceback in its stderr (attempt.py tees each rank's stderr to a
  file); its *signature* is that line with what differs between ranks and attempts
  normalised (numbers, hex, tmp paths, node names: :func:`normalise`);
- the same signature on two start-up failures since the run last completed a step, seen
  on two different nodes (one node failing twice may be that node; a world of one node
  has no other), ends the run "paused" (``trainguard launch`` exits 75, as after a
  PauseRun) with the error, quarantining nobody and leaving the other restarts unused.
  Two different errors, a failure after a step, or a rank killed while the others
  trained restart as before.

Across hosts each agent is a node and sees its own ranks: each writes its start-up
failures to ``attempt-N/startup-error.json`` in its run dir (on the shared storage), and
reads the other hosts' for the attempts it counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .records import (
    RankEnd,
    RestartCause,
    RestartPhases,
    phases_path,
    progress_path,
    read_json,
    read_progress,
)
from .world import World

#: How much of a rank's stderr is read for its last traceback (the end of the file).
TAIL_BYTES = 64 * 1024
#: The longest error kept (its first line only: a message's start is what identifies it).
MAX_ERROR = 300
#: A start-up failure's record in its attempt's directory (read by the other hosts' agents).
STARTUP_FILE = "startup-error.json"

#: Where a rank reported its error: torch elastic's error file, its stderr file (None: none).
Reports = Mapping[int, tuple[Path | None, Path | None]]

_TRACEBACK = "Traceback (most recent call last):"
# torch.distributed prefixes each stderr line of a rank once its process group is up.
_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_TMP_ROOTS = {"/tmp", "/var/tmp", "/dev/shm", "/var/folders", "/private/var/folders", tempfile.gettempdir()}
_TMP = re.compile(
    "(?:" + "|".join(map(re.escape, sorted(_TMP_ROOTS, key=len, reverse=True))) + r")/[^\s'\"`,;)\]}]*"
)
_UUID = re.compile(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b")
# 0x-prefixed, or a long hex run with a digit in it (an id, an address, a hash)
_HEX = re.compile(r"\b0[xX][0-9a-fA-F]+\b|\b(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}\b")
_NUMBER = re.compile(r"\d+")


def normalise(error: str, names: Iterable[str] = ()) -> str:
    """`error` without what differs from one rank or attempt to the next (pids, ranks,
    ports, addresses, timestamps, ids, tmp paths; `names`, the node names) and what
    stays: the exception's type and words."""
    text = _TMP.sub("<tmp>", error)
    for name in sorted({n for n in names if n}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", "<node>", text)
    text = _NUMBER.sub("N", _HEX.sub("<hex>", _UUID.sub("<hex>", text)))
    return " ".join(text.split())[:MAX_ERROR]


def last_exception(stderr: str) -> str:
    """The exception line of the last Python traceback in `stderr` ('' none): the first
    line after its header that is not indented (its frames and source lines are)."""
    lines = [_PREFIX.sub("", line.rstrip()) for line in stderr.splitlines()]
    starts = [i for i, line in enumerate(lines) if line == _TRACEBACK]
    if not starts:
        return ""
    return next((line.strip() for line in lines[starts[-1] + 1 :] if line and not line[0].isspace()), "")


def reported_error(error_file: Path | None, stderr_file: Path | None) -> str:
    """What a rank reported of its failure: its error file's message (torch elastic's
    ``@record`` writes ``{"message": {"message": "Type: text", ...}}``), else the last
    exception in its stderr; '' when neither says."""
    if error_file is not None:
        message = read_json(error_file).get("message")
        if isinstance(message, dict):
            message = message.get("message")
        if isinstance(message, str) and message.strip():
            return message.strip().splitlines()[0][:MAX_ERROR]
    if stderr_file is None:
        return ""
    try:
        with stderr_file.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return last_exception(tail)[:MAX_ERROR]


def completed_a_step(run_dir: Path, attempt: int, ranks: Iterable[int]) -> bool:
    """Some rank of `ranks` completed a step in `attempt` (its progress file, or the last
    step in its phases file for a program without one, as RankExit reads them)."""
    for r in ranks:
        if read_progress(progress_path(run_dir, attempt, r)) is not None:
            return True
        last = read_json(phases_path(run_dir, attempt, r)).get("last_step")
        if isinstance(last, int) and not isinstance(last, bool) and last >= 0:
            return True
    return False


@dataclass(frozen=True)
class StartupFailure:
    attempt: int
    signature: str
    error: str  # the crash's rank's, as reported
    nodes: tuple[str, ...]  # the nodes whose ranks reported the signature


class StartupFailures:
    """The run's start-up failures since it last completed a step, and the verdict on them."""

    def __init__(self, run_dir: Path, hosts_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        #: Across hosts: the hosts' run dirs' parent (shared storage); None on one host.
        self.hosts_dir = hosts_dir
        #: The first attempt that counts: this launcher's first, or the one after a step.
        self.since: int | None = None

    def after_attempt(
        self, world: World, interruption: RestartPhases | None, exits: Sequence[RankEnd], reports: Reports
    ) -> str | None:
        """Call when attempt `world.attempt` ended (`interruption`: what ended it, None for
        a clean end). Notes the crash's error in `interruption`; returns why the run stops
        (the same start-up error as an earlier attempt's), or None: the usual rules go on."""
        attempt, placement = world.attempt, world.placement
        if self.since is None:
            self.since = attempt
        started = completed_a_step(self.run_dir, attempt, world.local_ranks)
        if started:  # the code can start: earlier start-up failures were something else
            self.since = attempt + 1
        if interruption is None or interruption.cause is not RestartCause.CRASH:
            return None
        if interruption.exit_code is None or interruption.exit_code <= 0 or interruption.rank not in reports:
            return None  # a signal (or a rank of another host): no error of the code's to compare
        interruption.error = reported_error(*reports[interruption.rank])
        if not interruption.error:
            return None
        signature = normalise(interruption.error, placement.nodes)
        interruption.error_signature = signature
        if started:
            return None

        def same(rank: int) -> bool:  # (the crash's rank made the signature)
            reported = reported_error(*reports[rank])
            return rank == interruption.rank or normalise(reported, placement.nodes) == signature

        failed = [e for e in exits if e.attempt == attempt and e.returncode is not None and e.returncode > 0]
        nodes = sorted({e.node for e in failed if e.rank in reports and same(e.rank)})
        failure = StartupFailure(attempt, signature, interruption.error, tuple(nodes))
        interruption.startup, interruption.error_nodes = True, list(nodes)
        self._write(failure)
        seen = [f for f in self._failures(attempt) if f.signature == signature]
        attempts = sorted({f.attempt for f in seen})
        on = sorted({n for f in seen for n in f.nodes})
        if len(attempts) < 2 or (len(placement.nodes) > 1 and len(on) < 2):
            return None
        where = f"on {len(on)} different nodes ({', '.join(on)})" if len(on) > 1 else "on the run's only node"
        resume = f" (resuming from step {world.resume})" if world.resume >= 0 else ""
        numbers = ", ".join(map(str, attempts[:-1])) + f" and {attempts[-1]}"
        return (
            f"paused at start-up by the launcher: attempts {numbers} failed before their first "
            f"step{resume} with the same error {where}: data or code, not hardware; restarting "
            f"again would fail again (fix it, then relaunch). Rank {interruption.rank} on "
            f"{interruption.node}: {interruption.error}"
        )

    def _write(self, failure: StartupFailure) -> None:
        """The failure's record, for the other hosts' agents (best effort: a host that
        cannot write it only counts for itself)."""
        path = self.run_dir / f"attempt-{failure.attempt}" / STARTUP_FILE
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(dataclasses.asdict(failure)))
            os.replace(tmp, path)
        except OSError:
            pass

    def _failures(self, attempt: int) -> list[StartupFailure]:
        """The start-up failures recorded for attempts since `self.since`, up to
        `attempt`: this launcher's, and across hosts every host's."""
        dirs = [self.run_dir]
        if self.hosts_dir is not None:
            dirs += [d for d in sorted(self.hosts_dir.glob("*")) if d.resolve() != self.run_dir.resolve()]
        found = []
        for d in dirs:
            for a in range(self.since if self.since is not None else attempt, attempt + 1):
                data = read_json(d / f"attempt-{a}" / STARTUP_FILE)
                nodes, signature = data.get("nodes"), data.get("signature")
                if isinstance(nodes, list) and isinstance(signature, str) and data.get("attempt") == a:
                    error = str(data.get("error", ""))
                    found.append(StartupFailure(a, signature, error, tuple(map(str, nodes))))
        return found
