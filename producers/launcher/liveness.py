"""Which hosts' agents are alive, seen through shared storage (docs/multihost.md).

Every host agent beats: it rewrites ``<shared dir>/hosts/<node>/beat`` (the launcher's
shared directory, config.shared_dir: ``<checkpoint_dir>/.trainguard`` by default)
with a counter, once a second, from a thread of its own. Another agent judges a host
alive while it sees the counter change: a host whose counter stayed the same for
``stale_s`` seconds of the observer's own monotonic clock is gone. No timestamps are
compared across hosts, so clock skew cannot fake or hide a loss (a counter, not the
file's mtime, which a network file system may set from either side's clock).

A spare agent (``trainguard launch --spare``) uses it to know when the run needs it: a
host of the newest world stopped beating (or was quarantined), so the world cannot
re-form without another host. The rendezvous' own keep-alives say the same inside
torch, but only to the hosts in the rendezvous, which a spare waiting outside is not.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

BEAT_NAME = "beat"
#: How often a host beats (HostBeat's interval).
BEAT_S = 1.0


def hosts_dir(shared_dir: Path) -> Path:
    return shared_dir / "hosts"


class HostBeat:
    """This host's beat: a counter rewritten every `interval_s` until stop()."""

    def __init__(self, shared_dir: Path, node: str, interval_s: float = BEAT_S) -> None:
        self.path = hosts_dir(shared_dir) / node / BEAT_NAME
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HostBeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="trainguard-host-beat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        count = 0
        tmp = self.path.with_suffix(".tmp")
        while not self._stop.is_set():
            count += 1
            try:
                tmp.write_text(str(count))
                os.replace(tmp, self.path)
            except OSError as exc:  # storage away: the others may take this host for lost
                log.warning("host beat not written to %s: %s", self.path, exc)
            self._stop.wait(self.interval_s)


class Liveness:
    """The other hosts' beats as this agent sees them change."""

    def __init__(self, shared_dir: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = hosts_dir(shared_dir)
        self.clock = clock
        self._seen: dict[str, tuple[str, float]] = {}  # node -> (its counter, when it last changed)

    def _observe(self, node: str) -> float:
        """Seconds since `node`'s counter last changed (0 on the first look)."""
        try:
            value = (self.dir / node / BEAT_NAME).read_text()
        except OSError:
            value = ""
        now = self.clock()
        last = self._seen.get(node)
        if last is None or last[0] != value:
            self._seen[node] = (value, now)
            return 0.0
        return now - last[1]

    def stale(self, nodes: Iterable[str], stale_s: float) -> list[str]:
        """The hosts among `nodes` whose beat has not changed for `stale_s` seconds."""
        return sorted(self.gone(nodes, stale_s))

    def gone(self, nodes: Iterable[str], stale_s: float) -> dict[str, float]:
        """The stale hosts among `nodes`, each with the seconds since its beat last changed on
        this observer's clock (how long ago it was last alive, at most one beat interval
        before it died); one read of each beat."""
        quiet = {n: self._observe(n) for n in nodes}
        return {n: s for n, s in sorted(quiet.items()) if s >= stale_s}


class LossWatch:
    """Across hosts, a host waiting to join below MAX is either a host come to grow the
    world or a spare called in for a host of this world that stopped beating (a spare
    joins once it finds one stale). Told apart by watching the world's other hosts'
    beats, from the poll that first saw a host waiting, for `stale_s` and one beat more:
    shared storage is read only while a host waits."""

    def __init__(
        self,
        shared_dir: Path,
        nodes: Iterable[str],
        stale_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = Liveness(shared_dir, clock)
        self.nodes, self.stale_s, self.clock = tuple(nodes), stale_s, clock
        self.since = clock()
        self.live.stale(self.nodes, stale_s)  # the first look: each host's counter now

    def lost(self) -> dict[str, float] | None:
        """The hosts found lost (node -> seconds since its beat last changed); {} once
        every host beat through the watch (a host joins); None while still watching."""
        if gone := self.live.gone(self.nodes, self.stale_s):
            return gone
        return {} if self.clock() - self.since >= self.stale_s + BEAT_S else None


def newest_world(shared_dir: Path) -> tuple[int, tuple[str, ...], bool]:
    """From every host's journal on shared storage: the newest attempt's number, its hosts,
    and whether it ended cleanly (the run is over); (-1, (), False) before any attempt."""
    worlds: dict[int, tuple[str, ...]] = {}
    clean: set[int] = set()
    for journal in sorted(hosts_dir(shared_dir).glob("*/launcher.actions.jsonl")):
        try:
            lines = journal.read_bytes().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
                op, number = rec["op"], int(rec["attempt"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line, or a record without an attempt
            if op == "attempt":
                worlds[number] = tuple(rec.get("nodes") or ())
            elif op == "ended" and rec.get("end") == "ok":
                clean.add(number)
    if not worlds:
        return -1, (), False
    newest = max(worlds)
    return newest, worlds[newest], newest in clean
