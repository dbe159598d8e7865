"""What a user sees when a command cannot start: one line that names what is wrong and a
non-zero exit, after a bounded wait, never a traceback or an endless stream of retries."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainguard.cli import app

SECRET = "cli-errors-test-secret-0123456789abcdef"


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_an_unreachable_broker_is_named_in_one_line_and_the_command_exits() -> None:
    bootstrap = f"127.0.0.1:{_closed_port()}"
    env = {"TRAINGUARD_SECRET": SECRET}
    for command in (
        ["process", "--metrics-port", "0"],
        ["archive"],
    ):
        started = time.monotonic()
        done = CliRunner().invoke(
            app, [*command, "--bootstrap", bootstrap, "--connect-timeout", "2"], env=env
        )
        took = time.monotonic() - started
        assert done.exit_code == 2, done.output
        lines = _lines(done.output)
        assert len(lines) == 1, done.output
        assert bootstrap in lines[0] and "Connection refused" in lines[0], lines[0]
        assert took < 10, f"{command[0]} took {took:.1f} s to give up"


@pytest.mark.parametrize("where", ["missing", "empty-dir", "uri"])
def test_a_missing_archive_is_one_line(tmp_path: Path, where: str) -> None:
    missing: Path | str = tmp_path / "missing"
    if where == "empty-dir":
        missing.mkdir()  # type: ignore[union-attr]
    elif where == "uri":
        missing = f"file://{tmp_path}/nothing-here"
    for command in ("timeline", "goodput", "query"):
        args = [command, "runs"] if command == "query" else [command]
        done = CliRunner().invoke(app, [*args, "--db", str(missing)])
        assert done.exit_code == 2, done.output
        assert _lines(done.output) == [
            f"no archive at {missing}: pass --db, or run `trainguard archive --db {missing}` first"
        ]
        assert done.exception is None or isinstance(done.exception, SystemExit)


def test_an_unsupported_report_format_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    db, report = tmp_path / "run.duckdb", tmp_path / "report.pdf"
    done = CliRunner().invoke(app, ["timeline", "--db", str(db), "--output", str(report)])
    assert done.exit_code == 2, done.output
    assert ".pdf" in done.output and ".html" in done.output
    assert not report.exists()


def test_a_checkpoint_location_no_rank_could_use_is_refused_in_one_line() -> None:
    launch = ["launch", "--nproc", "2", "--run-id", "r1", "--offline", "--checkpoint-dir"]
    done = CliRunner().invoke(app, [*launch, "memory://ckpt", "--", "train.py"])
    assert done.exit_code == 2, done.output
    lines = _lines(done.output)
    assert len(lines) == 1 and "memory://ckpt" in lines[0] and "one process's memory" in lines[0], lines


def test_across_hosts_an_object_store_needs_a_shared_state_dir() -> None:
    hosts = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "r"]
    done = CliRunner().invoke(
        app, ["launch", "--offline", *hosts, "--checkpoint-dir", "s3://bucket/ckpt", "--", "train.py"]
    )
    assert done.exit_code == 2, done.output
    lines = _lines(done.output)
    assert len(lines) == 1 and "--state-dir must name a directory every host mounts" in lines[0], lines
