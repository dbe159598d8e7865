"""The ranks' output (issue 44): on the launcher's console, each line prefixed by its rank
as torchrun's ``--tee`` shows it, and in a log file per rank and attempt, whatever the
restart mode.

The files, under the log root (``LauncherConfig.log_root``: ``--log-dir DIR`` gives
``DIR/RUN_ID``, across hosts ``DIR/RUN_ID/NODE``; else the launcher's run dir's ``logs/``):

- ``attempt-N/rank-R/stdout.log`` and ``stderr.log``: what rank R printed in attempt N
  (startup.py reads a failed rank's stderr);
- ``attempt-N/rank-R/error.json``: torch elastic's error file (TORCHELASTIC_ERROR_FILE,
  written by ``@record``);
- in-process restart only, ``workers/<worker>.stdout.log`` and ``.stderr.log``: each
  process's own streams across the attempts it served (a warm spare's from its start).

Full restarts: torch elastic's process layer writes each rank's streams to its files
(:class:`RankLogsSpecs`, a ``LogsSpecs``: torchrun's ``--logs-specs`` hook). In-process
restart: a process outlives attempts and changes rank (a spare takes a failed one), so
its streams go to its ``workers/`` files and :class:`RankOutput` splits each line into the
rank file of the attempt it serves when the line is read (a line written just before an
assignment may land in the next one's).

The console: :class:`RankOutput` follows the files (every ``POLL_S``, as torch elastic's
``TailLog`` does) and copies each complete line to the launcher's stdout or stderr, as
the rank wrote it: ``[rankR]:`` before it for a stream ``--tee`` names (default: both),
nothing before it for a stream named by neither flag (torchrun's console without
``--tee``), and not at all for a stream ``--redirects`` names (its file only; ``--tee``
wins, as in torchrun). A warm spare's lines before it took a rank: ``[spare-N]:``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

#: How often the files are read for new lines (torch elastic's TailLog: 0.1 s too).
POLL_S = 0.1
#: A line longer than this without its newline is copied in pieces (a progress bar's \r).
MAX_LINE = 1 << 16
STREAM_NAMES = {Std.OUT: "stdout", Std.ERR: "stderr"}


def rank_dir(root: Path, attempt: int, rank: int) -> Path:
    """Rank `rank`'s files of attempt `attempt`."""
    return root / f"attempt-{attempt}" / f"rank-{rank}"


def parse_std(value: str) -> Std | dict[int, Std]:
    """torchrun's --tee/--redirects value: 0-3, or per local rank "0:3,1:2" (ValueError)."""
    return Std.from_str(value)


class Console:
    """Which streams reach the console, and with which prefix (--tee, --redirects)."""

    def __init__(self, tee: str = "3", redirects: str = "0") -> None:
        self.tee, self.redirects = parse_std(tee), parse_std(redirects)

    def prefix(self, stream: Std, local_rank: int | None, tag: str) -> str | None:
        """The line prefix of `stream` for the process `tag` (``rank3``, ``spare-1``) on
        local rank `local_rank` (None: a spare); None: kept off the console."""
        if _of(self.tee, local_rank) & stream:
            return f"[{tag}]:"
        return None if _of(self.redirects, local_rank) & stream else ""


def _of(spec: Std | dict[int, Std], local_rank: int | None) -> Std:
    if isinstance(spec, Std):
        return spec
    return spec.get(local_rank, Std.NONE) if local_rank is not None else Std.NONE


class RankLogsSpecs(LogsSpecs):
    """torch elastic's destinations for one attempt of a full restart: each rank's two
    streams to its files under `root` and its error file beside them; nothing teed by
    torch (RankOutput copies the lines to the console with the rank's prefix)."""

    def __init__(self, root: Path) -> None:
        super().__init__(log_dir=str(root))
        self.root = root

    @property
    def root_log_dir(self) -> str:
        return str(self.root)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for i, env in envs.items():
            d = rank_dir(self.root, int(env["TRAINGUARD_ATTEMPT"]), int(env["RANK"]))
            d.mkdir(parents=True, exist_ok=True)
            error = d / "error.json"
            error.unlink(missing_ok=True)  # an attempt spawned again under its number (recovery.py)
            dest.stdouts[i], dest.stderrs[i] = str(d / "stdout.log"), str(d / "stderr.log")
            dest.error_files[i] = env["TORCHELASTIC_ERROR_FILE"] = str(error)
        return dest


@dataclass(frozen=True)
class Owner:
    """Whose lines a followed file holds now: the console tag (``rank3``, ``spare-1``),
    its local rank (None: a spare) and, in process, the rank's directory of the attempt
    its lines go to (None: the file is the rank's own)."""

    tag: str
    local_rank: int | None = None
    copy_to: Path | None = None


class _Source:
    def __init__(self, path: Path, stream: Std, owner: Owner | Callable[[], Owner]) -> None:
        self.path, self.stream, self.owner = path, stream, owner
        self.file: BinaryIO | None = None
        self.partial = b""
        self.copy: tuple[Path, BinaryIO] | None = None

    def close(self) -> None:
        for fh in (self.file, self.copy[1] if self.copy else None):
            if fh is not None:
                fh.close()
        self.file = self.copy = None


class RankOutput:
    """Follows the ranks' log files and copies their lines to the console (and, in
    process, into the rank files); one thread for all of them."""

    def __init__(self, console: Console, poll_s: float = POLL_S) -> None:
        self.console = console
        self.poll_s = poll_s
        self._sources: list[_Source] = []
        self._lock = threading.Lock()  # the sources, and one line at a time on the console
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, path: Path, stream: Std, owner: Owner | Callable[[], Owner]) -> None:
        """Copy the lines `path` gets (it may not exist yet) as `owner` (or what it returns
        when the lines are read) says."""
        with self._lock:
            self._sources.append(_Source(path, stream, owner))
            if self._thread is None or not self._thread.is_alive():  # the first, or after close()
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="trainguard-rank-output", daemon=True
                )
                self._thread.start()

    def drain(self, paths: Iterable[Path]) -> None:
        """Copy what is left in these files (their processes ended) and stop following them."""
        done = set(paths)
        with self._lock:
            for source in [s for s in self._sources if s.path in done]:
                self._pump(source, final=True)
                source.close()
                self._sources.remove(source)
            _flush()

    def close(self) -> None:
        """The run is over: what every file still holds, then no more following."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.drain([s.path for s in self._sources])

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            with self._lock:
                for source in self._sources:
                    self._pump(source)
                _flush()

    def _pump(self, source: _Source, final: bool = False) -> None:
        if source.file is None:
            try:
                source.file = source.path.open("rb")
            except OSError:
                return  # not created yet
        data = source.partial + source.file.read()
        lines = data.split(b"\n")
        source.partial = lines.pop()
        if final or len(source.partial) > MAX_LINE:
            if source.partial:
                lines.append(source.partial)
            source.partial = b""
        if lines:
            owner = source.owner if isinstance(source.owner, Owner) else source.owner()
            self._copy(source, owner, lines)
            self._show(source.stream, owner, lines)

    def _copy(self, source: _Source, owner: Owner, lines: list[bytes]) -> None:
        """In process: the lines into the rank file of the attempt the process serves."""
        if owner.copy_to is None:
            return
        path = owner.copy_to / f"{STREAM_NAMES[source.stream]}.log"
        try:
            if source.copy is None or source.copy[0] != path:
                if source.copy is not None:
                    source.copy[1].close()
                path.parent.mkdir(parents=True, exist_ok=True)
                source.copy = (path, path.open("ab"))
            source.copy[1].write(b"".join(line + b"\n" for line in lines))
            source.copy[1].flush()
        except OSError:  # a full disk must not stop the console's copy
            source.copy = None

    def _show(self, stream: Std, owner: Owner, lines: list[bytes]) -> None:
        prefix = self.console.prefix(stream, owner.local_rank, owner.tag)
        if prefix is None:
            return
        out = sys.stdout if stream == Std.OUT else sys.stderr  # looked up now: tests swap them
        with contextlib.suppress(Exception):  # a closed or unencodable console loses the line only
            out.write("".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines))


def _flush() -> None:
    for out in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            out.flush()
