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


def print_goodput(db: Path, run_id: str | None, console: Console) -> None:
    """Each run's latest goodput breakdown per window (from GoodputReport events)."""
    from .sinks.archive_store import goodput_breakdown

    rows = goodput_breakdown(db, run_id)
    if not rows:
        console.print(f"no goodput reports recorded in {db} (the first comes 10 min into a run)")
        return
    table = Table(title="Goodput: where the time went (latest report per window)")
    for column in ("run", "window", "goodput", "elapsed s", "checkpoints s", "lost work s", "restarts s"):
        table.add_column(column)
    table.add_column("stragglers s")
    for row in rows:
        window = row["window_s"]
        span = f"{window / 86_400:g} d" if window % 86_400 == 0 else f"{window / 3600:g} h"
        table.add_row(
            row["run_id"],
            span,
            f"{row['goodput']:.3f}",
            *(f"{row[k]:,.0f}" for k in ("elapsed_s", "checkpoint_s", "lost_s", "restart_s", "straggler_s")),
        )
    console.print(table)


def evaluation_table(title: str, scores: list[Any]) -> Table:
    """Per detector, summed over scenarios: TP / FP / FN and detection latency."""
    from statistics import median

    totals: dict[str, list[Any]] = {}
    for scenario in scores:
        for detector, board in scenario.detectors.items():
            totals.setdefault(detector, []).append(board)
    table = Table(title=title)
    for column in ("detector", "TP", "FP", "FN", "latency steps (median, max)", "latency s (median, max)"):
        table.add_column(column)
    table.add_column("diagnosis right/all")
    for detector, boards in sorted(totals.items()):
        steps = [x for b in boards for x in b.latency_steps]
        secs = [x for b in boards for x in b.latency_s]
        right = sum(b.diagnosis_right for b in boards)
        judged = right + sum(b.diagnosis_wrong for b in boards)
        table.add_row(
            detector,
            str(sum(b.tp for b in boards)),
            str(sum(b.fp for b in boards)),
            str(sum(b.fn for b in boards)),
            f"{median(steps):g}, {max(steps):g}" if steps else "-",
            f"{median(secs):.1f}, {max(secs):.1f}" if secs else "-",
            f"{right}/{judged}" if judged else "-",
        )
    return table


def scenario_lines(scores: list[Any]) -> list[str]:
    lines = []
    for scenario in scores:
        verdict = "ok" if not scenario.misses and not scenario.false_alarms else "CHECK"
        found = ", ".join(sorted({d.detector for d in scenario.detections})) or "nothing"
        lines.append(f"{scenario.scenario:26s} {verdict:5s} detected: {found}")
        lines += [f"    missed {m.kind} rank {m.rank} ({m.node}) at step {m.step}" for m in scenario.misses]
        lines += [
            f"    false alarm {a.detector} rank {a.rank} ({a.node}) at step {a.step}: {a.event.reason.text}"
            for a in scenario.false_alarms
        ]
    return lines
