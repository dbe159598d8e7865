"""`trainguard query`: ad-hoc SQL and the ready queries on an archive, as a table, CSV or
JSON lines; a bad statement is one line naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from trainguard.cli import app
from trainguard.sinks.archive_store import Archive

from ..sinks.test_archive import RUN, every_kind


def _archive(tmp_path: Path) -> str:
    root = tmp_path / "archive"
    with Archive(root) as archive:
        archive.write(every_kind())
    return str(root)


def test_sql_and_ready_queries_in_each_format(tmp_path: Path) -> None:
    db = _archive(tmp_path)
    sql = "SELECT kind, count(*) AS n FROM raw_event GROUP BY kind ORDER BY kind"
    done = CliRunner().invoke(app, ["query", sql, "--db", db, "--format", "json"])
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["kind"]: r["n"] for r in rows} == {
        "run_started": 1, "step_timing": 24, "interruption": 1, "interruption_recovered": 1
    }  # fmt: skip

    done = CliRunner().invoke(app, ["query", "runs", "--db", db, "--format", "csv"])
    assert done.exit_code == 0, done.output
    header, *lines = done.stdout.splitlines()
    assert header.startswith("run_id,state,world_size") and len(lines) == 1 and lines[0].startswith(RUN)

    done = CliRunner().invoke(app, ["query", "timeline", "--db", db])
    assert done.exit_code == 0 and "crash" in done.stdout, done.output


def test_a_bad_statement_is_one_line(tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["query", "SELECT nope FROM raw_event", "--db", _archive(tmp_path)])
    assert done.exit_code == 2
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "nope" in lines[0], done.output


def test_retention_of_a_table_without_hours_is_refused(tmp_path: Path) -> None:
    done = CliRunner().invoke(app, ["archive", "--db", str(tmp_path / "a"), "--retain", "command=30d"])
    assert done.exit_code == 2 and "raw_event" in done.output, done.output
    assert not (tmp_path / "a").exists()
