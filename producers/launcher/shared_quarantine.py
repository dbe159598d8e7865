"""The run's quarantine list on shared storage, across hosts (docs/multihost.md).

The rendezvous store lives in one process; losing it must not lose which hosts are out.
So every host's agent appends the quarantines it executes or decides to
``<shared dir>/quarantine.jsonl`` (config.shared_dir; one JSON object a line, fsynced),
and reads the file before it joins a round: a host listed there does not rejoin the run.
A ReleaseNode appends a release. The last record of a node wins.

Under elastic training (docs/elastic.md, across hosts) a host that was lost without a
fault of its own (its agent gone: the reason starts with :data:`HOST_LOST`) is admitted
back when its agent returns and passes the node self-test, as a spare is: its agent
appends a readmission (a release naming the newest attempt then, :meth:`readmitted`); a
quarantine decided for an attempt up to that one is spent (commands.py).

One line per decision: several agents see the same host lost (every survivor does) and
every agent executes the same QuarantineNode, so each append first reads the list under
an exclusive lock (``flock`` on the file: local, and on Linux NFS clients a lock the
server arbitrates) and writes nothing when the node is already out (or, for a release,
already in): the first observer's reason is the decision's, whoever else saw it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from ...common.checkpoint_location import checkpoint_location, is_url

FILE_NAME = "quarantine.jsonl"
#: How the reason of a host lost without a fault of its own begins (its agent left the
#: rendezvous, did not answer the survivors, or its beat stopped): under elastic training
#: its agent, back, rejoins once it passes the node self-test.
HOST_LOST = "host lost: "


def lost_without_fault(reason: str) -> bool:
    """`reason` takes a host out only because it was lost (not for a fault of its own)."""
    return reason.startswith(HOST_LOST)


class SharedQuarantine:
    def __init__(self, shared_dir: Path) -> None:
        self.path = shared_dir / FILE_NAME

    def add(self, node: str, reason: str, by: str, again: bool = False) -> bool:
        """`node` out of the run; False: it already was (another agent's decision stands).
        `again`: a new decision about a node already out (it failed its readmission test)."""
        record = {"node": node, "out": True, "reason": reason[:500], "by": by, "ts": time.time()}
        return self._decide(record, again)

    def release(self, node: str, by: str, readmitted_in: int | None = None, reason: str = "released") -> bool:
        """`node` back in the run; False: it was not out. `readmitted_in`: a lost host
        readmitted after its self-test, with the newest attempt it knew of then."""
        record = {"node": node, "out": False, "reason": reason[:500], "by": by, "ts": time.time()}
        if readmitted_in is not None:
            record["readmitted_in"] = readmitted_in
        return self._decide(record)

    def nodes(self) -> dict[str, str]:
        """The nodes out of the run, and why (a torn last line is skipped)."""
        return _listed(self._read())

    def readmitted(self) -> dict[str, int]:
        """Lost hosts back in the run (their last record a readmission), with the newest
        attempt when they were readmitted: a quarantine for that one or an earlier is spent."""
        out: dict[str, int] = {}
        for rec in _records(self._read()):
            node = str(rec["node"])
            if rec["out"] or "readmitted_in" not in rec:
                out.pop(node, None)
            else:
                out[node] = int(rec["readmitted_in"])
        return out

    def _read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def _decide(self, record: dict[str, Any], again: bool = False) -> bool:
        """Append `record` unless the list already says what it says, under the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            if (record["node"] in _listed(data)) == record["out"] and not again:
                return False
            line = (json.dumps(record) + "\n").encode()
            if data and not data.endswith(b"\n"):  # a writer killed mid-line: ours starts anew
                line = b"\n" + line
            os.write(fd, line)
            os.fsync(fd)
            return True
        finally:
            os.close(fd)


def _records(data: bytes) -> list[dict[str, Any]]:
    """The list's records in order (a torn or foreign line is skipped)."""
    out = []
    for line in data.splitlines():
        try:
            rec: dict[str, Any] = json.loads(line)
            rec["node"], rec["out"] = str(rec["node"]), bool(rec["out"])
        except (ValueError, KeyError, TypeError):
            continue
        out.append(rec)
    return out


def _listed(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for rec in _records(data):
        if rec["out"]:
            out[rec["node"]] = str(rec.get("reason", ""))
        else:
            out.pop(rec["node"], None)
    return out


def refusal(node: str, run_id: str, why: str) -> str:
    """The one line a quarantined host's agent leaves with."""
    return f"{node} is quarantined for run {run_id} ({why}): it does not rejoin"


def refused_at_start(
    state_dir: Path | None, checkpoint_dir: str | None, node: str, run_id: str, elastic: bool = False
) -> str | None:
    """Before anything else (no torch import, no journal, no recovery): the refusal of an
    agent whose host is on the run's list, or None. The shared directory is
    LauncherConfig.shared_dir's across hosts: --state-dir, else DIR/.trainguard of a
    checkpoint directory on a file system (an object store needs --state-dir there).
    `elastic`: a host lost without a fault of its own is not refused here: its agent
    self-tests it and readmits it (world.py)."""
    shared = state_dir
    on_a_file_system = not is_url(checkpoint_dir or "") or (checkpoint_dir or "").startswith("file://")
    if shared is None and checkpoint_dir and on_a_file_system:
        try:
            shared = Path(checkpoint_location(checkpoint_dir)) / ".trainguard"
        except ValueError:  # refused later, with the launcher's own message
            return None
    why = SharedQuarantine(shared).nodes().get(node) if shared is not None else None
    if why is None or (elastic and lost_without_fault(why)):
        return None
    return refusal(node, run_id, why)
