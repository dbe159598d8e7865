"""Across hosts, the lost-peer tracebacks off the agent's console (issue 44).

When a host is lost, every survivor's rank fails in its next collective with the
transport's error (gloo: "Connection reset by peer"; NCCL: "remote process exited") and
prints its traceback: a survivor's console headlined one gloo traceback per rank, none of
which says that a host was lost, let alone which. The agent says that once, in one line
naming the host, at the next round (story.py); the tracebacks stay whole in each rank's
stderr.log, where that line points.

So ``trainguard launch`` across hosts writes its stderr through :class:`PeerLossFilter`:
a traceback in a rank's lines (``[rankN]:`` before it: the rank output's tag, or torch's
own excepthook prefix) is held until that rank has written nothing more for `settle_s`;
then it is dropped when its exception lines say a peer was lost (the rank's own test,
producers/training/peer_loss.py, applied to the text), else written as it came. Every
other line passes at once; the agent's own tracebacks (no rank tag) are never held.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from typing import Any, TextIO

from ..training.peer_loss import peer_lost

#: A rank's line: its tag (the first ``[rankN]:``), then any other bracketed prefixes.
_TAGGED = re.compile(r"^(\[rank\d+\]:)((?:\s?\[[^\]\n]*\]:)*)\s?(.*)$", re.DOTALL)
_TRACEBACK = "Traceback (most recent call last):"
#: Lines of a traceback that are not its exception's message.
_FRAMING = (_TRACEBACK, "During handling of the above exception", "The above exception was the direct cause")


class PeerLossFilter:
    """A text stream in front of `out` (the agent's stderr): what reaches it, less the
    ranks' lost-peer tracebacks. Thread-safe; install() puts it in sys.stderr."""

    def __init__(self, out: TextIO, settle_s: float = 0.5) -> None:
        self.out, self.settle_s = out, settle_s
        self._lock = threading.Lock()
        self._partial = ""  # text after the last newline written
        self._held: dict[str, list[str]] = {}  # rank tag -> its traceback's lines so far
        self._last: dict[str, float] = {}  # rank tag -> when its last line came
        #: rank tag -> the lost-peer error of each traceback dropped (tests; the story says it).
        self.dropped: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._settle, name="trainguard-peer-tracebacks", daemon=True)
        self._thread.start()

    def install(self) -> PeerLossFilter:
        sys.stderr = self
        return self

    def write(self, text: str) -> int:
        with self._lock:
            if not self._held and not self._partial and "[rank" not in text:
                self.out.write(text)  # the agent's own lines: as they come
                return len(text)
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self._line(line + "\n")
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.out.flush()

    def close(self) -> None:
        """Release what is held (as the settle would) and give sys.stderr back."""
        self._stop.set()
        with self._lock:
            for tag in list(self._held):
                self._release(tag)
            if self._partial:
                self.out.write(self._partial)
                self._partial = ""
        self.flush()
        if sys.stderr is self:
            sys.stderr = self.out

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno...: the console's
        return getattr(self.out, name)

    def _line(self, line: str) -> None:
        match = _TAGGED.match(line)
        tag = match.group(1) if match else None
        if tag is not None and tag in self._held:
            self._held[tag].append(line)
            self._last[tag] = time.monotonic()
        elif tag is not None and match is not None and match.group(3).startswith(_TRACEBACK):
            self._held[tag] = [line]
            self._last[tag] = time.monotonic()
        else:
            self.out.write(line)

    def _settle(self) -> None:
        while not self._stop.wait(min(0.1, self.settle_s)):
            with self._lock:
                now = time.monotonic()
                for tag in [t for t, last in self._last.items() if now - last >= self.settle_s]:
                    self._release(tag)
                self.flush()

    def _release(self, tag: str) -> None:
        lines = self._held.pop(tag)
        self._last.pop(tag, None)
        error = peer_error(lines)
        if error is None:
            self.out.write("".join(lines))
        else:
            self.dropped[tag] = error


def peer_error(lines: list[str]) -> str | None:
    """The lost-peer error a traceback's exception lines name (each exception of a chain
    counts, as on the rank's way out), or None: the rank's own error."""
    message = []
    for line in lines:
        match = _TAGGED.match(line)
        body = (match.group(3) if match else line).rstrip("\n")
        if body and not body[0].isspace() and not body.startswith(_FRAMING):
            message.append(body)
    return peer_lost(RuntimeError("\n".join(message))) if message else None
