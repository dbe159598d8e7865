"""Terminal reports read from the DuckDB archive."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def make_console() -> Console:
    """A console for reports: the terminal's width, or 160 columns when piped to a file
    (rich would otherwise fold every table to 80)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def timeline_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Interruptions (seed §3 /timeline)", show_lines=False)
    for column in ("when (UTC)", "run", "cause", "node", "rank", "lost steps", "restart s", "detected by"):
        table.add_column(column)
    table.add_column("reason", overflow="fold")
    for row in rows:
        restart = row.get("restart_seconds")
        table.add_row(
            _when(row["at"]),
            str(row["run_id"]),
            str(row["cause"]),
            str(row["node"] or "?"),
            str(row["rank"]),
            str(row["lost_steps"]),
            "-" if restart is None else f"{restart:.1f}",
            str(row["detected_by"]),
            str(row["reason"]),
        )
    return table


def print_timeline(db: Path, run_id: str | None, console: Console) -> None:
    from .sinks.archive_store import timeline

    rows = timeline(db, run_id)
    if not rows:
        console.print(f"no interruptions recorded in {db}")
        return
    console.print(timeline_table(rows))
