"""`trainguard soak`: the chaos soak (issue 7 scenario 6), registered on the CLI by
harness/devtools/cli.py. Without --bootstrap it starts a local broker of its own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer


def soak(
    minutes: Annotated[float, typer.Option(help="Minutes of load and chaos.")] = 5.0,
    kill_rate_text: Annotated[
        str, typer.Option("--kill-rate", help="Kills per minute (Poisson): K/min, K/s or K.")
    ] = "3/min",
    workers: Annotated[int, typer.Option(min=1, help="Processor workers (one consumer group).")] = 2,
    runs: Annotated[int, typer.Option(min=1, help="Concurrent simulated runs.")] = 3,
    world_size: Annotated[int, typer.Option(min=2, help="Ranks per run.")] = 16,
    speed: Annotated[float, typer.Option(help="Simulated time compression of every run.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seeds the kill plan and the runs' faults.")] = 0,
    step_time: Annotated[
        float, typer.Option(min=0.01, help="Healthy step of every simulated run (s); 2 s is a real job's.")
    ] = 0.2,
    ranks_per_node: Annotated[int, typer.Option(min=1, help="Ranks per simulated node.")] = 4,
    bootstrap: Annotated[
        str | None,
        typer.Option("--bootstrap", help="Kafka bootstrap servers; default: a local broker of its own."),
    ] = None,
    workdir: Annotated[Path, typer.Option(help="Logs, the archive (emptied first).")] = Path(
        ".trainguard/soak"
    ),
    report: Annotated[
        Path | None, typer.Option("--report", help="Also write the report as Markdown.")
    ] = None,
    keep_topics: Annotated[bool, typer.Option(help="Leave the soak's topics on the broker.")] = False,
) -> None:
    """Chaos soak: R simulated runs through W workers and the archive writer while workers,
    the writer and ranks are SIGKILLed at random (restarted after a short delay); then the
    nothing-lost oracle per run. Exit 1 if any check fails."""
    from trainguard.cli.render import make_console

    from .soak import run_soak
    from .soak_plan import SoakConfig, kill_rate
    from .soak_report import print_report, write_markdown

    console = make_console()
    try:
        rate = kill_rate(kill_rate_text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kill-rate") from exc
    config = SoakConfig(
        minutes,
        rate,
        workers,
        runs,
        seed,
        world_size,
        speed,
        step_time_s=step_time,
        ranks_per_node=ranks_per_node,
    )
    t0 = time.monotonic()

    def note(text: str) -> None:
        console.print(f"[{time.monotonic() - t0:6.1f} s] {text}", markup=False, highlight=False)

    if bootstrap:
        result = run_soak(config, bootstrap, workdir, note, keep_topics)
    else:
        import shutil

        from .broker_jars import ensure_jars
        from .local_broker import LocalBroker

        ensure_jars()
        data = workdir.parent / f"{workdir.name}-broker"
        shutil.rmtree(data, ignore_errors=True)  # a fresh broker: nothing of an earlier soak
        broker = LocalBroker(data)
        try:
            address = broker.start()
            note(f"local broker at {address}")
            result = run_soak(config, address, workdir, note, keep_topics)
        finally:
            broker.stop()
    print_report(result, console)
    if report is not None:
        write_markdown(result, report)
        console.print(f"report written to {report}", markup=False)
    raise typer.Exit(0 if result.ok else 1)
