"""How a command's process ends once torch is imported: what the interpreter's exit does
that anyone can see (non-daemon threads joined, atexit hooks, every open file and stream
flushed, the status), without its module-by-module teardown, which frees torch's ~2,000
modules one by one: ~0.9 CPU-s at the end of every `trainguard launch`, for nothing a
user sees. Only the console entry point (:func:`trainguard.cli.main`) ends this way, and only its own
process: a command invoked in-process (typer's CliRunner in tests) returns as before, and a
rank forked below the CLI (the launcher's own fork server) ends as a new interpreter does."""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

#: The classes of a file opened for writing (open()'s text, buffered and raw files).
_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)

#: Imported, the teardown costs more than it is worth (a command without it ends as usual).
HEAVY = "torch"


def run_to_end(command: Callable[[], object]) -> None:
    """Run `command` (the app); when it exits with torch imported, end this process now
    (:func:`end`). Not in a process forked below it (a rank of the launcher's own fork
    server returns through here): a user's program ends as python ends it, teardown and all."""
    pid = os.getpid()
    try:
        command()
    except SystemExit as done:
        if os.getpid() == pid and HEAVY in sys.modules:
            end(done.code)
        raise


def end(status: object) -> NoReturn:
    """Exit with SystemExit `status`'s meaning (None: 0, an int: itself, anything else
    printed on stderr: 1) after the interpreter's own visible steps, in its order."""
    if status is None:
        code = 0
    elif isinstance(status, int):
        code = status
    else:
        print(status, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's first step at exit
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(code & 0xFF)


def _flush_open_files() -> None:
    """What the teardown would have written: the buffers of files still open (a file a
    library left to its finalizer), then the standard streams."""
    for obj in gc.get_objects():
        # the concrete classes only: isinstance against the io.IOBase ABC asks every object
        # (a deprecated torch alias warns when asked)
        if issubclass(type(obj), _WRITERS):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # a broken pipe, a detached buffer: as teardown ignores them
                pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
