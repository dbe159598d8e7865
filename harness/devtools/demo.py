"""The live demo: every real part, end to end, on one machine.

A local Kafka broker; the processor (a faust worker, in its own process) serving
Prometheus metrics; the archive writer; and a 64-rank simulated run with an
injected crash and an injected hang whose actuator executes the processor's signed
commands and acknowledges them. At the end: the timeline from DuckDB, the commands
and their acks, and a check of every detection against the scenario's ground truth.
The exit status is 0 only if every injected fault was detected on the right rank or node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainguard.cli.render import print_goodput, timeline_table
from trainguard.kafka.lag import wait_caught_up
from trainguard.kafka.topics import EVENTS
from trainguard.schemas import Derived, decode
from trainguard.schemas.auth import SECRET_FILE_ENV, load_master_secret, write_secret_file
from trainguard.schemas.codec import DERIVED
from trainguard.sinks.archive_store import open_snapshot, timeline

from ..scoring.evaluate import EXPECTED, score
from .stack import PROCESSOR_GROUP, builtin_policy, local_stack


def run_demo(scenario_path: Path | None, workdir: Path, metrics_port: int, console: Console) -> int:
    from trainguard.producers.simulator.driver import run_simulation
    from trainguard.producers.simulator.scenario import Scenario
    from trainguard.sinks.archive import ArchiveWriter

    scenario = Scenario.load(scenario_path) if scenario_path else Scenario.builtin("demo")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    db_path = workdir / "archive"
    shutil.rmtree(db_path, ignore_errors=True)  # the demo's run only
    os.environ.setdefault(SECRET_FILE_ENV, str(write_secret_file(workdir / "secret")))
    secret = load_master_secret()

    console.rule("[bold]trainguard demo")
    stop_archive = threading.Event()
    console.print("starting a local Kafka broker (KRaft, single node) and the processor...")
    with local_stack(workdir, builtin_policy("demo"), metrics_port) as stack:
        try:
            console.print(f"kafka broker   [cyan]{stack.bootstrap}[/] (log: {stack.broker.log_path})")
            console.print(
                f"processor      pid {stack.processor.pid}, Prometheus at [cyan]{stack.metrics_url}[/] "
                f"(log: {stack.processor_log})"
            )
            writer = ArchiveWriter(stack.bootstrap, stack.names, db_path)
            archiver = threading.Thread(target=writer.run, args=(stop_archive,), name="archive", daemon=True)
            archiver.start()
            console.print(
                f"archive        [cyan]{db_path}[/] (Delta Lake tables; read it while it is written)"
            )
            console.print(
                f"simulation     {scenario.world_size} ranks, {scenario.steps} steps of "
                f"{scenario.step_time_s}s; injected: "
                + ", ".join(f"{t.kind} rank {t.rank} ({t.node}) at step {t.step}" for t in scenario.truth())
            )

            with Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                TimeElapsedColumn(),
                console=console,
            ) as bar:
                task = bar.add_task("training (simulated)", total=scenario.steps)
                result = run_simulation(
                    scenario,
                    stack.bootstrap,
                    stack.names,
                    secret,
                    progress=lambda p: bar.update(
                        task, completed=p.step + 1, description=f"attempt {p.attempt} ({p.phase})"
                    ),
                )
            console.print(
                f"simulation done: {result.events_generated} events, {result.attempts} attempt(s), "
                f"{result.commands_executed} command(s) executed by the ranks, {result.wall_s:.1f}s wall"
            )

            if not stack.processor_alive():
                console.print(f"[red]the processor died; last lines of {stack.processor_log}:")
                console.print(stack.processor_log_tail(), markup=False)
                return 1
            with console.status("waiting for the processor and the archive to catch up..."):
                wait_caught_up(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry], timeout_s=60)
                time.sleep(1.5)  # the last commands' acks
                metrics = stack.scrape()
                stop_archive.set()
                archiver.join(timeout=30)
                writer.run_until_caught_up(timeout_s=60)
                writer.close()
        finally:
            stop_archive.set()

    rows = timeline(db_path)
    console.print(timeline_table(rows))
    print_goodput(db_path, None, console)  # where the run's time went (its GoodputReports)
    with contextlib.closing(open_snapshot(db_path)) as con:
        acks = con.execute(
            "SELECT c.kind, a.status, count(*) FROM ack a JOIN command c USING (command_id) "
            "GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        dead = con.execute("SELECT count(*) FROM dead_letter").fetchall()[0][0]
        raw = con.execute("SELECT count(*) FROM raw_event").fetchall()[0][0]
        payloads = con.execute("SELECT payload::VARCHAR FROM raw_event WHERE topic = ?", [EVENTS]).fetchall()
    derived = [decode(p.encode(), DERIVED) for (p,) in payloads]
    commands = Table(title="Commands and their acknowledgements")
    for column in ("command", "ack status", "acks"):
        commands.add_column(column)
    for kind, status, count in acks:
        commands.add_row(str(kind), str(status), str(count))
    console.print(commands)

    shown = (
        "goodput_ratio",
        "step_time_p50_seconds",
        "step_time_max_seconds",
        "slowest_rank",
        "interruptions",
    )
    console.print("Prometheus (scraped at the end of the run):")
    for name, value in sorted(metrics.items()):
        if any(key in name for key in shown):
            console.print(f"  {name} {value:g}")

    # Every injected fault against the detections, scored as `trainguard evaluate` does.
    scored = score(scenario.name, scenario.truth(), [d for d in derived if isinstance(d, Derived)], {}, {})
    console.print("Ground truth:")
    for truth in scenario.truth():
        mark = "[red]MISSED" if truth in scored.misses else f"[green]detected ({EXPECTED[truth.kind]})"
        console.print(f"  {truth.kind} rank {truth.rank} ({truth.node}) from step {truth.step}: {mark}")
    for alarm in scored.false_alarms:
        where = f"rank {alarm.rank} ({alarm.node}) at step {alarm.step}"
        console.print(f"  [yellow]unexpected {alarm.detector} {where}")
    ok = not scored.misses
    console.print(f"\narchive: [cyan]{db_path}[/] ({raw} raw events, {dead} dead letters)")
    console.print(f"query it: trainguard timeline --db {db_path}, trainguard goodput --db {db_path}")
    return 0 if ok else 1
