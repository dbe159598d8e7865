"""The live demo: every real part, end to end, on one machine.

A local Kafka broker; the processor (a faust worker, in its own process) serving
Prometheus metrics; the DuckDB archive writer; and a 64-rank simulated run with an
injected crash and an injected hang whose actuator executes the processor's signed
commands and acknowledges them. At the end: the timeline from DuckDB, the commands
and their acks, and a check of every detection against the scenario's ground truth.
The exit status is 0 only if every injected crash and hang was detected on the right node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .broker.lag import wait_caught_up
from .broker.local import LocalBroker, ensure_jars
from .broker.topics import ensure_topics, topic_names
from .report import timeline_table
from .schemas.auth import SECRET_FILE_ENV, load_master_secret, write_secret_file

PROCESSOR_GROUP = "trainguard-processor"


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the processor exited ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the processor's metrics endpoint {url} did not come up; see {log}")


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("trainguard_") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def run_demo(scenario_path: Path | None, workdir: Path, metrics_port: int, console: Console) -> int:
    from .producers.simulator.driver import run_simulation
    from .producers.simulator.scenario import Scenario
    from .sinks.archive import ArchiveWriter
    from .sinks.archive_store import Archive, timeline

    scenario = Scenario.load(scenario_path) if scenario_path else Scenario.builtin("demo")
    workdir = workdir.resolve()
    shutil.rmtree(workdir / "broker", ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    db_path = workdir / "trainguard.duckdb"
    for stale in (db_path, db_path.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    os.environ.setdefault(SECRET_FILE_ENV, str(write_secret_file(workdir / "secret")))
    secret = load_master_secret()
    policy = resources.files("trainguard.processors") / "policies" / "demo.yaml"

    console.rule("[bold]trainguard demo")
    ensure_jars()
    broker = LocalBroker(workdir / "broker")
    processor: subprocess.Popen[bytes] | None = None
    stop_archive = threading.Event()
    try:
        with console.status("starting a local Kafka broker (KRaft, single node)..."):
            bootstrap = broker.start()
            names = topic_names()
            ensure_topics(bootstrap)
        console.print(f"kafka broker   [cyan]{bootstrap}[/] (log: {broker.log_path})")

        log = workdir / "processor.log"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        with log.open("wb") as out:
            processor = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "process", "--bootstrap", bootstrap]
                + ["--policy", str(policy), "--metrics-port", str(metrics_port), "--loglevel", "info"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        with console.status("starting the processor (faust worker)..."):
            _wait_http(metrics_url, 60, processor, log)
        console.print(
            f"processor      pid {processor.pid}, Prometheus at [cyan]{metrics_url}[/] (log: {log})"
        )

        writer = ArchiveWriter(bootstrap, names, db_path)
        archiver = threading.Thread(target=writer.run, args=(stop_archive,), name="archive", daemon=True)
        archiver.start()
        console.print(f"archive        DuckDB file [cyan]{db_path}[/]")
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
                bootstrap,
                names,
                secret,
                progress=lambda p: bar.update(
                    task, completed=p.step + 1, description=f"attempt {p.attempt} ({p.phase})"
                ),
            )
        console.print(
            f"simulation done: {result.events_generated} events, {result.attempts} attempt(s), "
            f"{result.commands_executed} command(s) executed by the ranks, {result.wall_s:.1f}s wall"
        )

        if processor.poll() is not None:
            console.print(f"[red]the processor died (exit {processor.returncode}); last lines of {log}:")
            console.print(log.read_text()[-3000:], markup=False)
            return 1
        with console.status("waiting for the processor and the archive to catch up..."):
            wait_caught_up(bootstrap, PROCESSOR_GROUP, [names.telemetry], timeout_s=60)
            time.sleep(1.5)  # the last commands' acks
            metrics = _scrape(metrics_url)
            stop_archive.set()
            archiver.join(timeout=30)
            writer.run_until_caught_up(timeout_s=60)
            writer.close()
    finally:
        stop_archive.set()
        if processor is not None and processor.poll() is None:
            processor.terminate()
            try:
                processor.wait(timeout=30)
            except subprocess.TimeoutExpired:
                processor.kill()
        broker.stop()

    rows = timeline(db_path)
    console.print(timeline_table(rows))
    with Archive(db_path) as archive:
        con = archive.cursor()
        acks = con.execute(
            "SELECT c.kind, a.status, count(*) FROM ack a JOIN command c USING (command_id) "
            "GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        dead = con.execute("SELECT count(*) FROM dead_letter").fetchall()[0][0]
        raw = con.execute("SELECT count(*) FROM raw_event").fetchall()[0][0]
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

    ok = True
    console.print("Ground truth:")
    for truth in scenario.truth():
        if truth.kind not in ("crash", "hang"):
            console.print(f"  {truth.kind} rank {truth.rank} ({truth.node}): not an interruption")
            continue
        hit = [r for r in rows if r["cause"] == truth.kind and r["node"] == truth.node]
        ok &= bool(hit)
        mark = "[green]detected" if hit else "[red]MISSED"
        console.print(f"  {truth.kind} rank {truth.rank} ({truth.node}) at step {truth.step}: {mark}")
    console.print(f"\nDuckDB archive: [cyan]{db_path}[/] ({raw} raw events, {dead} dead letters)")
    console.print(f"query it: trainguard timeline --db {db_path}")
    return 0 if ok else 1
