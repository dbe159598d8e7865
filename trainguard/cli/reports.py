"""Commands that read what a run did: its timeline and goodput from the archive, ad-hoc SQL,
and a month-long simulated run through the policy core."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from .app import DEFAULT_ARCHIVE, ArchiveRoot, ReportFile, app, console, fail


def _existing(db: str) -> str:
    """`db` if there is an archive there; else one line and exit 2 (not a traceback)."""
    from ..sinks.lake import Lake, is_uri

    if is_uri(db) or not Path(db).is_file():  # a lake (a file is a DuckDB archive of before)
        try:
            Lake.reading(db)
        except FileNotFoundError:
            fail(f"no archive at {db}: pass --db, or run `trainguard archive --db {db}` first")
    return db


@app.command()
def longrun(
    world_size: Annotated[int, typer.Option(help="Ranks (GPUs) of the simulated job.")] = 16_384,
    days: Annotated[float, typer.Option(help="Length of the run.")] = 30.0,
    interval: Annotated[
        str, typer.Option(help="'auto' (the core derives T from measured C and M) or fixed seconds.")
    ] = "auto",
    checkpoint_s: Annotated[float, typer.Option(help="C: seconds a checkpoint blocks training.")] = 30.0,
    restart_s: Annotated[float, typer.Option(help="R: seconds from detection to the first step.")] = 600.0,
    step_s: Annotated[float, typer.Option(help="Seconds per training step.")] = 10.0,
    seed: Annotated[int, typer.Option(help="Random seed of the failure draws.")] = 0,
    policy: Annotated[str | None, typer.Option(help="Policy YAML; default: the seed's defaults.")] = None,
    db: Annotated[str, typer.Option(help="Archive root the run's records and decisions go to.")] = (
        ".trainguard/longrun"
    ),
    rows: Annotated[int, typer.Option(help="Timeline rows to print (the last ones; 0: all).")] = 20,
) -> None:
    """Simulate a month-long run with failures at the Llama 3 rate (419 in 54 days on 16,384
    GPUs, MTBF inversely proportional to the world size) through the policy core, and print
    what happened, what the core measured and decided, the seed's formulas, the timeline
    and the goodput breakdown (all stored in --db)."""
    from rich.progress import Progress

    from ..processors.core.policy import load_policy
    from ..producers.simulator.longrun import LongRun
    from ..replay.longrun import run_longrun
    from .render import longrun_table, make_console, print_goodput, print_timeline

    chosen = load_policy(policy)
    if interval != "auto":
        try:
            fixed = float(interval)
        except ValueError:
            raise typer.BadParameter(
                f"expected 'auto' or seconds, got {interval!r}", param_hint="--interval"
            ) from None
        update = {"mode": "fixed", "initial_s": fixed}
        chosen = chosen.model_copy(update={"interval": chosen.interval.model_copy(update=update)})
    run = LongRun(
        run_id=f"longrun-{world_size}-{interval}-{seed}",
        world_size=world_size,
        days=days,
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        step_s=step_s,
        seed=seed,
    )
    if Path(db).is_dir():
        shutil.rmtree(db)  # one run per archive: the report reads it back
    else:
        Path(db).unlink(missing_ok=True)  # a DuckDB archive of before
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"{days:g} days at {world_size:,} ranks", total=1.0)
        result = run_longrun(run, chosen, archive=db, progress=lambda f: bar.update(task, completed=f))
    out = make_console()
    out.print(longrun_table(result))
    print_timeline(db, run.run_id, out, last=rows or None)
    print_goodput(db, run.run_id, out)
    out.print(f"archive: {db} (views and ready queries: docs/queries.md)")


@app.command()
def timeline(
    db: ArchiveRoot = DEFAULT_ARCHIVE,
    run: Annotated[str | None, typer.Option(help="Only this run_id.")] = None,
    output: ReportFile = None,
) -> None:
    """Print every interruption: when, cause, node, cost (from the archive)."""
    from .render import make_console, print_timeline, save_report

    _existing(db)
    console = make_console(record=output is not None)
    print_timeline(db, run, console)
    save_report(console, output)


@app.command()
def goodput(
    db: ArchiveRoot = DEFAULT_ARCHIVE,
    run: Annotated[str | None, typer.Option(help="Only this run_id.")] = None,
    output: ReportFile = None,
) -> None:
    """Print each run's goodput breakdown over 1 h, 24 h and 7 d (from the archive)."""
    from .render import make_console, print_goodput, save_report

    _existing(db)
    console = make_console(record=output is not None)
    print_goodput(db, run, console)
    save_report(console, output)


@app.command()
def query(
    sql: Annotated[
        str, typer.Argument(help="SQL over the archive's tables and views, or a ready query's name.")
    ],
    db: ArchiveRoot = DEFAULT_ARCHIVE,
    output_format: Annotated[
        str, typer.Option("--format", help="table (the terminal), csv or json (one object per line).")
    ] = "table",
) -> None:
    """Query the archive (a snapshot as of its newest batch: the writer may keep writing).
    Ready queries: `trainguard query goodput_by_day` (docs/queries.md lists them)."""
    import csv
    import json
    import sys

    from rich.table import Table

    from ..sinks.archive_store import query as run_sql
    from ..sinks.queries import QUERIES

    if output_format not in ("table", "csv", "json"):
        raise typer.BadParameter(f"{output_format!r}: use table, csv or json", param_hint="--format")
    _existing(db)
    text = QUERIES[sql].sql if sql in QUERIES else sql
    try:
        rows = run_sql(db, text)
    except Exception as exc:  # duckdb's errors name the problem in their first line
        fail(str(exc).splitlines()[0])
    if output_format == "json":
        for row in rows:
            sys.stdout.write(json.dumps(row, default=str) + "\n")
        return
    names = list(rows[0]) if rows else []
    if output_format == "csv":
        out = csv.writer(sys.stdout)
        out.writerow(names)
        out.writerows([row[n] for n in names] for row in rows)
        return
    from .render import make_console

    table = Table(*names)
    for row in rows:
        table.add_row(*("" if row[n] is None else str(row[n]) for n in names))
    make_console().print(table if rows else "no rows")
