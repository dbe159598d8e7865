"""The chaos soak's report: the same rows as a rich table for the terminal and as
Markdown for a file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .soak import LASTING, SoakReport
from .soak_plan import Victim

RUN_HEADER = ["run", "verdict", "faults struck", "recovered", "survived", "events", "events/s", "max lag s",
              "lost", "duplicates", "decisions", "executions", "abort acked s p50 / max"]  # fmt: skip
TIMELINE_HEADER = ["run", "abort of", "ship s", "decide s", "deliver s", "execute s", "ack s", "total s",
                   "workers meanwhile (s from the fault)", "never delivered: where it stopped"]  # fmt: skip
KILL_HEADER = ["victim", "planned", "killed", "restarted", "down s (mean / max)"]


def run_rows(report: SoakReport) -> list[list[str]]:
    rows = []
    for run in report.runs:
        result = run.result
        failed = [v.name for v in run.oracle.verdicts if not v.held]
        rows.append([
            run.run_id,
            "ok" if run.ok else "FAIL: " + ", ".join(failed or ["no result"]),
            ", ".join(f"{kind} {n}" for kind, n in sorted(run.faults.items())) or "-",
            f"{run.recovered} of {run.stalls}",
            "yes" if run.survived else "no",
            f"{run.events:,}",
            f"{result.delivered_per_s:,.0f}" if result is not None else "-",
            f"{result.max_lag_s:.2f}" if result is not None else "-",
            str(run.lost),
            str(run.duplicates),
            str(run.decisions),
            str(run.executions),
            _p50_max(run.abort_latencies),
        ])  # fmt: skip
    return rows


def _p50_max(values: list[float]) -> str:
    return f"{values[len(values) // 2]:.1f} / {values[-1]:.1f}" if values else "-"


def timeline_rows(report: SoakReport) -> list[list[str]]:
    """Each abort's stages (soak_timeline.py): where the seconds from its cause to its ack went."""
    rows = []
    for run in report.runs:
        for line in run.timelines:
            stages = [f"{s:.1f}" if s is not None else "-" for s in line.stages()]
            meanwhile = "; ".join(line.workers) or "-"
            rows.append([run.run_id, line.cause, *stages, meanwhile, line.stopped or "-"])
    return rows


def kill_rows(report: SoakReport) -> list[list[str]]:
    planned = Counter(k.victim.value for k in report.plan)
    rows = []
    for victim in Victim:
        downs = [d for name, ds in report.downtimes.items() if name.startswith(victim.value) for d in ds]
        down = f"{sum(downs) / len(downs):.1f} / {max(downs):.1f}" if downs else "-"
        restarted = (
            str(report.restarts[victim.value]) if victim is not Victim.RANK else "(simulated launcher)"
        )
        rows.append(
            [victim.value, str(planned[victim.value]), str(report.kills[victim.value]), restarted, down]
        )
    return rows


def summary(report: SoakReport) -> list[str]:
    c = report.config
    lines = [
        f"soak: {c.minutes:g} min at {c.kill_rate_per_min:g} kills/min, {c.workers} workers, "
        f"{c.runs} runs of {c.world_size} ranks, seed {c.seed}, topics {report.prefix}*",
        f"load: {sum(r.events for r in report.runs):,} events in {report.load_s:.0f} s, "
        f"{report.events_per_s:,.0f} events/s held under chaos",
        f"kills: {sum(report.kills.values())} ({_counts(report.kills)}), "
        f"{report.skipped} skipped (no live victim)",
        f"lost: {sum(r.lost for r in report.runs)}; redelivered decision copies: "
        f"{sum(r.duplicates for r in report.runs)}",
        _recoveries(report.worker_metrics),
        f"aborts acked after the crash or hang timeout (s, p50 / max): "
        f"{_p50_max(sorted(x for r in report.runs for x in r.abort_latencies))}",
        _hang_line(report),
        "lasting commands (quarantine, release, go-ahead): "
        + "; ".join(
            f"{r.run_id} {v.detail}" for r in report.runs for v in r.oracle.verdicts if v.name == LASTING
        ),
        f"caught up {report.drain_s:.0f} s after the load stopped; whole soak {report.total_s:.0f} s; "
        f"archive {report.archive}",
        *(f"failure: {f}" for f in report.failures),
        "verdict: " + ("every check held" if report.ok else "FAILED"),
    ]
    return lines


def _hang_line(report: SoakReport) -> str:
    hangs = [h for r in report.runs for h in r.hangs]
    named = sum(h.from_stack for h in hangs)
    acked = sorted(h.ack_s for h in hangs if h.ack_s is not None)
    detail = "; ".join(
        f"rank {h.rank} at {h.at_s:.0f} s: named {h.named} ({h.code or 'no verdict'}), acked "
        + (f"{h.ack_s:.1f} s" if h.ack_s is not None else "never")
        for h in hangs
    )
    innocent = sorted({n for r in report.runs for n in r.innocent_quarantines})
    return (
        f"hangs: {len(hangs)} struck, {named} culprit(s) named from their stack, abort acked after "
        f"the timeout (s, p50 / max) {_p50_max(acked)}{f' [{detail}]' if detail else ''}; "
        f"innocent nodes quarantined: {', '.join(innocent) or 'none'}"
    )


def _recoveries(metrics: dict[str, float]) -> str:
    def m(name: str) -> int:
        return int(metrics.get(f"trainguard_{name}", 0.0))

    n = m("recoveries_total")
    mean = metrics.get("trainguard_recovery_seconds_sum", 0.0) / n if n else 0.0
    return (
        f"worker recoveries: {n} (mean {mean:.2f} s), {m('recovery_records_total'):,} records re-folded, "
        f"{m('redelivered_records_total'):,} redelivered records skipped, "
        f"{m('suppressed_outputs_total')} re-made outputs not re-sent, {m('snapshots_total')} snapshots"
    )


def _counts(counts: Counter[str]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def _table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def print_report(report: SoakReport, console: Console) -> None:
    console.print(_table("runs (oracle per run)", RUN_HEADER, run_rows(report)))
    console.print(_table("kills", KILL_HEADER, kill_rows(report)))
    console.print(_table("aborts, stage by stage", TIMELINE_HEADER, timeline_rows(report)))
    for run in report.runs:
        if not run.ok:
            console.print(f"[red]{run.run_id}[/red]:\n{run.oracle}", highlight=False)
    for line in summary(report):
        console.print(line, markup=False, highlight=False)


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: SoakReport) -> str:
    parts = [
        "# Chaos soak",
        "\n".join(f"- {line}" for line in summary(report)),
        "## Runs",
        _markdown_table(RUN_HEADER, run_rows(report)),
        "## Kills",
        _markdown_table(KILL_HEADER, kill_rows(report)),
        "## Aborts, stage by stage",
        _markdown_table(TIMELINE_HEADER, timeline_rows(report)),
        "## Oracle, per run",
        *(f"### {run.run_id}\n\n```\n{run.oracle}\n```" for run in report.runs),
        "## Each run's actuator at the end",
        "\n".join(f"- {run.run_id}: {run.result.actuator}" for run in report.runs if run.result is not None),
        "## Plan",
        _markdown_table(
            ["at s", "victim", "target", "restart after s"],
            [
                [
                    f"{k.at_s:.1f}",
                    k.victim.value,
                    _target(k.victim, k.target, k.rank),
                    f"{k.restart_after_s:.1f}" if k.victim is not Victim.RANK else "-",
                ]
                for k in report.plan
            ],
        ),  # fmt: skip
    ]
    return "\n\n".join(parts) + "\n"


def _target(victim: Victim, target: int, rank: int) -> str:
    if victim is Victim.RANK:
        return f"run {target}, rank {rank}"
    return f"worker-{target}" if victim is Victim.WORKER else "archive"


def write_markdown(report: SoakReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(report))
