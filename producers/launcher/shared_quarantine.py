"""The run's quarantine list on shared storage, across hosts (docs/multihost.md).

The rendezvous store lives in one process; losing it must not lose which hosts are out.
So every host's agent appends the quarantines it executes or decides to
``<shared dir>/quarantine.jsonl`` (config.shared_dir; one JSON object a line, appended with
O_APPEND and fsynced, so concurrent agents never interleave a line), and reads the file
before it joins a round: a host listed there does not rejoin the run. A ReleaseNode
appends a release. The last record of a node wins.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FILE_NAME = "quarantine.jsonl"


class SharedQuarantine:
    def __init__(self, shared_dir: Path) -> None:
        self.path = shared_dir / FILE_NAME

    def add(self, node: str, reason: str, by: str) -> None:
        self._append({"node": node, "out": True, "reason": reason[:500], "by": by, "ts": time.time()})

    def release(self, node: str, by: str) -> None:
        self._append({"node": node, "out": False, "reason": "released", "by": by, "ts": time.time()})

    def nodes(self) -> dict[str, str]:
        """The nodes out of the run, and why (a torn last line is skipped)."""
        out: dict[str, str] = {}
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
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

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)  # one write: O_APPEND keeps concurrent agents' lines whole
            os.fsync(fd)
        finally:
            os.close(fd)
