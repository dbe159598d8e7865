"""How a command's process ends once torch is imported (trainguard/cli/ending.py): what the
interpreter's exit shows anyone is all there, in its order, without the teardown."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENDS = textwrap.dedent(
    """
    import atexit, json, sys, threading, time
    from trainguard.cli import ending
    left_open = open(sys.argv[1], "w")  # a file a library left to its finalizer
    left_open.write("written")
    atexit.register(lambda: print("atexit", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    print("buffered", end="")  # stdout is a pipe: block-buffered
    ending.end(json.loads(sys.argv[2]))
    """
)


@pytest.mark.parametrize(("status", "code"), [(None, 0), (3, 3), ("no such run", 1)])
def test_the_end_keeps_what_the_interpreters_exit_shows(tmp_path: Path, status: object, code: int) -> None:
    left = tmp_path / "left-open.txt"
    done = subprocess.run(
        [sys.executable, "-c", ENDS, str(left), json.dumps(status)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    # the thread joined first, then the atexit hooks, then the streams flushed, as python does
    assert done.stdout == "bufferedthread done\natexit\n"
    assert left.read_text() == "written"
    assert done.stderr == ("no such run\n" if isinstance(status, str) else "")
