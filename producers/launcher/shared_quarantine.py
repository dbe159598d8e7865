"""The run's quarantine list on shared storage, across hosts (docs/multihost.md).

The rendezvous store lives in one process; losing it must not lose which hosts are out.
So every host's agent appends the quarantines it executes or decides to
``<shared dir>/quarantine.jsonl`` (config.shared_dir; one JSON object a line, fsynced),
and reads the file before it joins a round: a host listed there does not rejoin the run.
A ReleaseNode appends a release. The last record of a node wins.

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

from ..checkpoint.location import checkpoint_location, is_url

FILE_NAME = "quarantine.jsonl"


class SharedQuarantine:
    def __init__(self, shared_dir: Path) -> None:
        self.path = shared_dir / FILE_NAME

    def add(self, node: str, reason: str, by: str) -> bool:
        """`node` out of the run; False: it already was (another agent's decision stands)."""
        record = {"node": node, "out": True, "reason": reason[:500], "by": by, "ts": time.time()}
        return self._decide(record)

    def release(self, node: str, by: str) -> bool:
        """`node` back in the run; False: it was not out."""
        return self._decide({"node": node, "out": False, "reason": "released", "by": by, "ts": time.time()})

    def nodes(self) -> dict[str, str]:
        """The nodes out of the run, and why (a torn last line is skipped)."""
        try:
            return _listed(self.path.read_bytes())
        except FileNotFoundError:
            return {}

    def _decide(self, record: dict[str, Any]) -> bool:
        """Append `record` unless the list already says what it says, under the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            if (record["node"] in _listed(data)) == record["out"]:
                return False
            line = (json.dumps(record) + "\n").encode()
            if data and not data.endswith(b"\n"):  # a writer killed mid-line: ours starts anew
                line = b"\n" + line
            os.write(fd, line)
            os.fsync(fd)
            return True
        finally:
            os.close(fd)


def _listed(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in data.splitlines():
        try:
            rec: dict[str, Any] = json.loads(line)
            node, listed = str(rec["node"]), bool(rec["out"])
        except (ValueError, KeyError, TypeError):
            continue
        if listed:
            out[node] = str(rec.get("reason", ""))
        else:
            out.pop(node, None)
    return out


def refusal(node: str, run_id: str, why: str) -> str:
    """The one line a quarantined host's agent leaves with."""
    return f"{node} is quarantined for run {run_id} ({why}): it does not rejoin"


def refused_at_start(
    state_dir: Path | None, checkpoint_dir: str | None, node: str, run_id: str
) -> str | None:
    """Before anything else (no torch import, no journal, no recovery): the refusal of an
    agent whose host is on the run's list, or None. The shared directory is
    LauncherConfig.shared_dir's across hosts: --state-dir, else DIR/.trainguard of a
    checkpoint directory on a file system (an object store needs --state-dir there)."""
    shared = state_dir
    on_a_file_system = not is_url(checkpoint_dir or "") or (checkpoint_dir or "").startswith("file://")
    if shared is None and checkpoint_dir and on_a_file_system:
        try:
            shared = Path(checkpoint_location(checkpoint_dir)) / ".trainguard"
        except ValueError:  # refused later, with the launcher's own message
            return None
    why = SharedQuarantine(shared).nodes().get(node) if shared is not None else None
    return None if why is None else refusal(node, run_id, why)
