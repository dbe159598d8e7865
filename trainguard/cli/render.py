"""How the commands print: the terminal's tables of what the archive and the long-run
simulation hold, and the progress bar of long commands. The commands themselves are in
reports.py, replay.py, pipeline.py and admin.py (the development tooling's evaluation
tables are its own: harness/devtools/render.py)."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def make_console(record: bool = False) -> Console:
    """A console for reports: the terminal's width, or 160 columns when piped to a file
    (rich would otherwise fold every table to 80). `record`: keep what is printed, for
    :func:`save_report`."""
    return Console(width=None if sys.stdout.isatty() else 160, record=record)


def save_report(console: Console, path: Path | None) -> None:
    """Write what a recording console printed to `path` as plain text (.txt, .md) or
    HTML (.html), so every report is readable as a file too."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".html":
        console.save_html(str(path))
    else:
        console.save_text(str(path))
    console.print(f"report written to {path}", markup=False)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%m-%d %H:%M:%S.%f")[:-3]


def timeline_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Interruptions (seed §3 /timeline)", show_lines=False)
    for column in ("when (UTC)", "run", "cause", "node", "rank", "lost steps", "restart s", "GPU-h"):
        table.add_column(column)
    table.add_column("reason", overflow="fold")
    table.add_column("decisions", overflow="fold")
    for row in rows:
        restart, cost = row.get("restart_seconds"), row.get("gpu_hours")
        table.add_row(
            _when(row["at"]),
            str(row["run_id"]),
            str(row["cause"]),
            str(row["node"] or "?"),
            str(row["rank"]),
            str(row["lost_steps"]),
            "-" if restart is None else f"{restart:.1f}",
            "-" if cost is None else f"{cost:,.1f}",
            f"{row['reason']} [{row['detected_by']}]",
            _decisions(row),
        )
    return table


def _decisions(row: dict[str, Any]) -> str:
    """Each decision with its reason, once: decisions that give the same reason are named
    together, and one that only repeats the interruption's reason is named alone."""
    grouped: dict[str, list[str]] = {}
    for kind, line in zip(row.get("decisions") or (), row.get("decision_reasons") or (), strict=True):
        text = line[len(kind) + 2 :]
        grouped.setdefault("" if text == row["reason"] else text, []).append(kind)
    lines = [" + ".join(kinds) + (f": {text}" if text else "") for text, kinds in grouped.items()]
    return "\n".join(lines) or "-"


def print_timeline(db: str | Path, run_id: str | None, console: Console, last: int | None = None) -> None:
    """Every interruption (or the `last` ones) with its cost and the decisions it caused."""
    from ..sinks.archive_store import timeline

    rows = timeline(db, run_id)
    if not rows:
        console.print(f"no interruptions recorded in {db}")
        return
    shown = rows[-last:] if last else rows
    console.print(timeline_table(shown))
    if len(shown) < len(rows):
        console.print(
            f"(the last {len(shown)} of {len(rows)} interruptions; `trainguard timeline` lists all)"
        )


def print_goodput(db: str | Path, run_id: str | None, console: Console) -> None:
    """Each run's latest goodput breakdown per window (from GoodputReport events)."""
    from ..sinks.archive_store import goodput_breakdown

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


def longrun_table(result: Any) -> Table:
    """A month-long simulated run (replay/longrun.py): what happened, what the core measured
    and decided, and what the seed's formulas say, side by side."""
    run, truth, m = result.run, result.truth, result.measured
    final_t = result.interval_updates[-1].interval_s if result.interval_updates else None
    in_force = final_t if final_t is not None else truth.intervals[-1][1]
    t_star, best = result.formula()
    _, at_t = result.formula(in_force)
    low, high = result.poisson_range()
    e = truth.elapsed_s
    shape = f"C={run.checkpoint_s:g} s, R={run.restart_s:g} s"
    table = Table(title=f"{run.days:g}-day run at {run.world_size:,} ranks ({shape})")
    for column in ("", "simulated (truth)", "core measured / decided", "seed formula"):
        table.add_column(column)
    table.add_row(
        "interruptions",
        str(truth.failures),
        str(m.interruptions),
        f"{run.expected_interruptions():.1f} (99%: {low}-{high})",
    )
    table.add_row("MTBF", f"{run.failure_mtbf_s / 3600:.2f} h", f"{result.mtbf_s / 3600:.2f} h", "-")
    table.add_row(
        "checkpoint interval",
        f"{in_force / 60:.1f} min in force",
        f"{final_t / 60:.1f} min" if final_t else "none published",
        f"T* {t_star / 60:.1f} min",
    )
    for name, true_s, measured_s, formula in (
        ("checkpoint C/T", truth.checkpoint_s, m.checkpoint, run.checkpoint_s / in_force),
        ("lost work T/2M", truth.lost_s, m.lost, in_force / (2 * run.failure_mtbf_s)),
        ("restart R/M", truth.restart_s, m.restart, run.restart_s / run.failure_mtbf_s),
    ):
        table.add_row(
            name, f"{100 * true_s / e:.2f}%", f"{100 * measured_s / m.elapsed:.2f}%", f"{100 * formula:.2f}%"
        )
    table.add_row(
        "overhead",
        f"{100 * truth.overhead:.2f}%",
        f"{100 * result.measured_overhead:.2f}%",
        f"{100 * at_t:.2f}% at this T ({100 * best:.2f}% at T*)",
    )
    table.add_row("goodput", f"{1 - truth.overhead:.3f}", f"{m.goodput:.3f}", f"{1 - at_t:.3f}")
    rules = ", ".join(sorted({p.rule for p in result.pages})) or "none"
    table.add_row("pages", "-", f"{len(result.pages)} ({rules})", "R5: patterns only")
    return table


@contextmanager
def progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress bar per task name; the callback is (task, done, total)."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        tasks: dict[str, int] = {}

        def update(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = int(bar.add_task(name, total=max(total, 1)))
            bar.update(tasks[name], completed=done, total=max(total, 1))  # type: ignore[arg-type]

        yield update
