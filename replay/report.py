"""The backtest's report: a Markdown file with its charts as PNG (goodput breakdown,
interruption timeline, step-time percentiles over the run), and the rows the terminal
table prints. Charts are drawn with matplotlib's non-interactive Agg backend."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..schemas import Interruption  # noqa: E402
from . import cost_model  # noqa: E402
from .backtest import Act, Backtest, PolicyRun, Row, decisions_count  # noqa: E402

CHARTS = ("goodput.png", "interruptions.png", "step_time.png")


def when(act: Act | None, start_ts: float) -> str:
    if act is None:
        return "never"
    step = f"step {act.step}, " if act.step >= 0 else ""
    return f"{step}{(act.ts - start_ts) / 60:.1f} min"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:+,.1f} s"


def difference_cells(row: Row, start_ts: float) -> list[str]:
    """decision, subject, baseline, candidate, acts at, saving, rule."""
    acts = "-" if row.acts_at is None else f"{(row.acts_at - start_ts) / 60:.1f} min"
    if row.counts is not None:
        base, cand = (f"{n} times" for n in row.counts)
    else:
        base, cand = when(row.baseline, start_ts), when(row.candidate, start_ts)
    return [row.decision, row.subject, base, cand, acts, seconds(row.saving_s), row.rule]


def summary_cells(run: PolicyRun, bt: Backtest) -> list[str]:
    """policy, decisions, differences, modelled saving, GPU-hours, goodput."""
    gpu_h = run.saving_s * bt.facts.world_size / 3600
    goodput = "-" if run.goodput is None else f"{run.goodput:.4f}"
    if run is bt.baseline:
        return [run.name + " (baseline)", str(decisions_count(run)), "-", "-", "-", goodput]
    return [
        run.name,
        str(decisions_count(run)),
        str(len(run.rows)),
        seconds(run.saving_s),
        f"{gpu_h:+,.2f}",
        goodput,
    ]


SUMMARY_HEADER = ["policy", "decisions", "differences", "saving (job time)", "GPU-hours", "goodput"]
PREDICTION_HEADER = [
    "policy",
    "predictions",
    "drains",
    "precision",
    "failures drained",
    "lead p50 / p10 min",
    "false drains",
    "per 1,000 node-days",
    "drains' value (job time)",
]


def prediction_cells(run: PolicyRun) -> list[str]:
    """A policy's failure prediction against the recording's failures (prediction_backtest.py)."""
    p = run.prediction
    if p is None:
        return [run.name] + ["-"] * (len(PREDICTION_HEADER) - 1)
    precision = "-" if p.precision is None else f"{p.precision:.0%}"
    recall = "-" if p.recall is None else f"{p.recall:.0%}"
    lead = "-" if p.lead_median_s is None else f"{p.lead_median_s / 60:.0f} / {(p.lead_p10_s or 0) / 60:.0f}"
    return [
        run.name,
        str(p.predictions),
        str(len(p.drains)),
        precision,
        f"{recall} ({p.drained}/{p.failures})",
        lead,
        str(p.false_drains),
        f"{p.false_per_1000_node_days:.2f}",
        seconds(p.value_s),
    ]


DIFF_HEADER = ["decision", "subject", "baseline", "candidate", "acts at", "saving", "cost rule"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_goodput(bt: Backtest, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    breakdown = bt.baseline.replayed.breakdown
    parts = ("checkpoint", "lost", "restart", "straggler")
    if breakdown is not None and breakdown.elapsed > 0:
        acc = 0.0
        for name in parts:
            value = getattr(breakdown, name) / breakdown.elapsed
            left.barh([0], [value], left=acc, label=name)
            acc += value
        left.legend(loc="upper right", fontsize=8)
    left.set_yticks([])
    left.set_xlabel("fraction of run time")
    left.set_title(f"{bt.baseline.name}: where the time went")
    names = [r.name for r in bt.runs]
    values = [r.goodput if r.goodput is not None else math.nan for r in bt.runs]
    right.bar(names, values, color=["tab:gray", *["tab:blue"] * (len(names) - 1)])
    finite = [v for v in values if math.isfinite(v)]
    if finite:
        right.set_ylim(max(0.0, min(finite) - 0.02), min(1.0, max(finite) + 0.01))
    right.set_ylabel("goodput")
    right.set_title("goodput: measured (baseline) and counterfactual")
    _save(fig, path)


def chart_interruptions(bt: Backtest, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(bt.runs)))
    start = bt.facts.start_ts
    markers = {"crash": "x", "hang": "s", "sdc": "D", "non_finite": "^", "eviction": "v", "operator": "o"}
    colors = dict(
        zip(
            markers, ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:blue", "tab:gray"), strict=True
        )
    )
    seen: set[str] = set()
    for y, run in enumerate(bt.runs):
        for d in run.replayed.derived:
            if isinstance(d, Interruption):
                cause = d.cause.value
                label = cause if cause not in seen else None
                x = (d.ts - start) / 60
                ax.scatter(
                    [x], [y], marker=markers.get(cause, "o"), s=60, color=colors.get(cause), label=label
                )
                seen.add(cause)
    ax.set_yticks(range(len(bt.runs)), [r.name for r in bt.runs])
    ax.set_ylim(-0.6, len(bt.runs) - 0.4)
    ax.set_xlim(0, max(1e-9, bt.facts.elapsed_s / 60))
    ax.set_xlabel("minutes since the run started")
    ax.set_title("interruptions by cause")
    if seen:
        ax.legend(loc="upper right", fontsize=8, ncols=len(seen))
    _save(fig, path)


def chart_step_time(bt: Backtest, path: Path) -> None:
    """Per step: percentiles over the ranks of the pre-collective compute time (where a
    straggler shows) and the median step time (the same on every rank of a synchronous
    job: each waits for the slowest)."""
    compute: dict[tuple[int, int], list[float]] = defaultdict(list)
    total: dict[tuple[int, int], list[float]] = defaultdict(list)
    at: dict[tuple[int, int], float] = {}
    for e in bt.log.timings():
        key = (e.attempt, e.step)
        compute[key].append(e.compute_s)
        total[key].append(e.total_s)
        at[key] = min(at.get(key, e.ts), e.ts)
    keys = sorted(compute, key=lambda k: at[k])
    fig, ax = plt.subplots(figsize=(11, 3.8))
    if keys:
        x = np.array([(at[k] - bt.facts.start_ts) / 60 for k in keys])
        values = [np.asarray(compute[k]) for k in keys]
        for q in (50, 90, 99):
            ax.plot(x, [np.percentile(v, q) for v in values], label=f"compute p{q}", linewidth=1)
        ax.plot(x, [v.max() for v in values], label="compute max", linewidth=0.8, linestyle=":")
        ax.plot(x, [float(np.median(total[k])) for k in keys], label="step p50", linewidth=1.2, color="black")
        ax.legend(loc="upper right", fontsize=8, ncols=5)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("seconds")
    ax.set_title("per step, over the ranks: pre-collective compute time and step time")
    _save(fig, path)


def write_report(bt: Backtest, out_dir: Path) -> Path:
    """Write report.md and its charts under `out_dir`; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chart_goodput(bt, out_dir / CHARTS[0])
    chart_interruptions(bt, out_dir / CHARTS[1])
    chart_step_time(bt, out_dir / CHARTS[2])
    f = bt.facts
    lines = [
        f"# Backtest of run `{bt.run_id}`",
        "",
        f"Measured in the recording: {f.world_size} ranks, {f.elapsed_s / 60:.1f} min of run time, "
        f"median step {f.step_s:.3f} s, checkpoint C {f.checkpoint_s:.3f} s, restart R {f.restart_s:.1f} s, "
        f"MTBF M {f.mtbf_s / 3600:.1f} h (the baseline core's estimate).",
        "",
        _table(SUMMARY_HEADER, [summary_cells(run, bt) for run in bt.runs]),
        "",
    ]
    if any(
        run.prediction is not None and (run.prediction.drains or run.prediction.predictions)
        for run in bt.runs
    ):
        lines += [
            "## Failure prediction",
            "",
            _table(PREDICTION_HEADER, [prediction_cells(r) for r in bt.runs]),
            "",
        ]
    for run in bt.runs[1:]:
        lines += [f"## {run.name} against {bt.baseline.name}", ""]
        rows = [difference_cells(row, f.start_ts) for row in run.rows]
        lines += [_table(DIFF_HEADER, rows) if rows else "No decision differs.", ""]
    lines += ["## Charts", ""] + [f"![{name}]({name})" for name in CHARTS] + [""]
    lines += ["## Cost model", "", (cost_model.__doc__ or "").strip(), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
