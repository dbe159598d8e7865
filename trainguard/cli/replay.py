"""`trainguard replay` and `trainguard backtest`: a recorded run read back from the Kafka
topics (or from the archive: `--archive`) and driven through the policy core (registered
in trainguard/cli/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from .app import Bootstrap, Prefix, app, reach_broker
from .render import progress_bar

if TYPE_CHECKING:
    from ..replay.log import Recording

RunId = Annotated[str, typer.Option("--run-id", help="The recorded run.")]
FromArchive = Annotated[
    str | None,
    typer.Option(
        "--archive",
        help="Read the run from this archive (a directory or object-store URI written by "
        "`trainguard archive`) instead of the Kafka topics.",
    ),
]


def _recording(bootstrap: str | None, topic_prefix: str, run_id: str, archive: str | None) -> Recording:
    from ..kafka.topics import topic_names
    from ..replay.log import read_archived_recording, read_recording

    names = topic_names(topic_prefix)
    if archive is not None:
        recording = read_archived_recording(archive, names, run_id)
        where = f"archive {archive}"
    else:
        with progress_bar() as update:
            recording = read_recording(
                reach_broker(bootstrap), names, run_id, lambda d, t: update("reading", d, t)
            )
        where = "telemetry topic"
    if not recording.records:
        from .render import make_console

        make_console().print(f"[red]no telemetry of run {run_id} in the {where}", markup=False)
        raise typer.Exit(2)
    return recording


@app.command()
def replay(
    run_id: RunId,
    policy: Annotated[
        Path | None, typer.Option(help="Policy YAML the run used; default: the seed's.")
    ] = None,
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
    rows: Annotated[int, typer.Option(help="Differences to print.")] = 20,
    archive: FromArchive = None,
) -> None:
    """Drive the policy core with a recorded run's telemetry (read back from Kafka, or from
    the archive with --archive, in the order the processor consumed it) and compare its
    decisions with the live processor's, event for event. Exit 0 when they are identical,
    1 when some differ."""
    from ..processors.core.policy import load_policy
    from ..replay.replay import compare, decisions_of, replay, replayed_decisions
    from .render import make_console

    out = make_console()
    recording = _recording(bootstrap, topic_prefix, run_id, archive)
    with progress_bar() as update:
        core_policy = load_policy(str(policy) if policy else None)
        replayed = replay(recording, core_policy, progress=lambda d, t: update("replaying", d, t))
    comparison = compare(decisions_of(recording), replayed_decisions(replayed))
    out.print(
        f"run {run_id}: {replayed.records:,} records, {replayed.events:,} events replayed in "
        f"{replayed.seconds:.2f} s ({replayed.events_per_s:,.0f} events/s); decisions recorded "
        f"{comparison.recorded}, replayed {comparison.replayed}, identical {comparison.matched}",
        markup=False,
    )
    if recording.operator_commands:
        inputs = recording.operator_commands
        kinds = ", ".join(sorted({c.KIND for c in inputs}))
        out.print(
            f"operator commands (run API; inputs, not decisions): {len(inputs)} ({kinds})", markup=False
        )
    if comparison.identical:
        out.print("[green]the replay reproduces every recorded decision, in order")
        return
    table = Table(
        "difference", "kind", "step", "id", "detail", title=f"{len(comparison.differences)} differences"
    )
    for d in comparison.differences[:rows]:
        table.add_row(d.what, d.kind, str(d.step), d.decision_id[:12], d.detail)
    out.print(table)
    raise typer.Exit(1)


@app.command()
def backtest(
    run_id: RunId,
    policy: Annotated[
        list[Path], typer.Option(help="Policy YAML files; the first is the baseline (the run's own). Repeat.")
    ],
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
    report: Annotated[Path, typer.Option(help="Where report.md and its PNG charts go.")] = Path(
        ".trainguard/backtest"
    ),
    archive: FromArchive = None,
) -> None:
    """Replay a recorded run under several policies: the decisions that differ from the
    baseline's, when each acts, its modelled cost or saving (replay/cost_model.py), and
    each policy's counterfactual goodput; a terminal table and a report file with charts.
    Failure prediction (issue 46): each policy's drains against the recording's failures
    (precision, failures drained before they struck, lead, false drains, their value)."""
    from ..processors.core.policy import load_policy
    from ..replay.backtest import backtest
    from ..replay.report import (
        DIFF_HEADER,
        PREDICTION_HEADER,
        SUMMARY_HEADER,
        difference_cells,
        prediction_cells,
        summary_cells,
        write_report,
    )
    from .render import make_console

    out = make_console()
    policies = [(path.stem, load_policy(str(path))) for path in policy]
    if len({name for name, _ in policies}) < len(policies):
        policies = [(f"{i}:{name}", p) for i, (name, p) in enumerate(policies)]
    recording = _recording(bootstrap, topic_prefix, run_id, archive)
    with progress_bar() as update:
        result = backtest(recording, policies, progress=update)
    summary = Table(*SUMMARY_HEADER, title=f"backtest of run {run_id}")
    for run in result.runs:
        summary.add_row(*summary_cells(run, result))
    out.print(summary)
    if any(
        run.prediction is not None and (run.prediction.drains or run.prediction.predictions)
        for run in result.runs
    ):
        prediction = Table(*PREDICTION_HEADER, title="failure prediction against the recording's failures")
        for run in result.runs:
            prediction.add_row(*prediction_cells(run))
        out.print(prediction)
    for run in result.runs[1:]:
        table = Table(*DIFF_HEADER, title=f"{run.name} against {result.baseline.name}")
        for row in run.rows:
            table.add_row(*difference_cells(row, result.facts.start_ts))
        out.print(table if run.rows else f"{run.name}: no decision differs from {result.baseline.name}")
    out.print(f"report: {write_report(result, report)}")
