"""How the evaluation commands print (cli.py: `trainguard evaluate`): per detector, per
scenario's harms, elastic training's wait against shrink, failure prediction on against
off, and one line per scenario. The product's tables stay in trainguard/cli/render.py."""

from __future__ import annotations

from typing import Any

from rich.table import Table


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


def harms_table(title: str, scores: list[Any]) -> Table:
    """Per scenario, what a user suffers (harness/scoring/harms.py): faults found, false pages,
    innocent nodes quarantined (and released), rollbacks after a corruption's onset,
    restarts into a step known to fail, phantom records accepted, goodput lost."""
    table = Table(title=title)
    columns = (
        "scenario",
        "faults found",
        "false pages",
        "false quarantines (released)",
        "wrong rollbacks / all",
        "restarts after same_step",
        "phantoms accepted / sent",
        "goodput lost s (faults, unattributed)",
    )
    for column in columns:
        table.add_column(column)
    for scenario in scores:
        h = scenario.harms
        faults = [t for t in scenario.truths if t.kind != "phantom_ranks"]
        unattributed = h.lost_s.get("unattributed", 0.0)
        table.add_row(
            scenario.scenario,
            f"{len(faults) - len(scenario.misses)}/{len(faults)}",
            str(len(h.false_pages)),
            f"{len(h.false_quarantines)} ({len(h.released)})",
            f"{len(h.wrong_rollbacks)}/{h.rollbacks}",
            str(len(h.restarts_after_same_step)),
            f"{h.phantoms_accepted}/{h.phantoms_sent}",
            f"{sum(h.lost_s.values()) - unattributed:,.0f}, {unattributed:,.0f}",
        )
    return table


def capacity_table(comparisons: list[Any]) -> Table:
    """Elastic training (issue 45, harness/scoring/capacity.py): per node-lost scenario, the goodput
    of waiting for the replacement (elastic off) and of the policy's rule (shrink), each the
    core's accounting over the whole run, with where the time went."""
    table = Table(title="Elastic: wait or shrink (a node lost, its replacement away; pure core)")
    columns = (
        "scenario",
        "ranks",
        "replacement s",
        "policy",
        "goodput",
        "run s",
        "down s",
        "narrow s",
        "re-done s",
        "lost to the fault s",
        "clean",
    )
    for column in columns:
        table.add_column(column)
    for c in comparisons:
        for run in (c.wait, c.shrink):
            lost = sum(v for k, v in run.score.harms.lost_s.items() if k != "unattributed")
            table.add_row(
                c.scenario,
                f"{c.world_size:,}",
                f"{c.replacement_s:,.0f}",
                run.policy,
                f"{run.goodput:.3f}",
                f"{run.elapsed_s:,.0f}",
                f"{run.restart_s:,.0f}",
                f"{run.narrow_s:,.1f}",
                f"{run.lost_s:,.0f}",
                f"{lost:,.0f}",
                "no" if run.failed else "yes",
            )
    return table


def prediction_table(comparisons: list[Any]) -> Table:
    """Failure prediction (issue 46, harness/scoring/prediction.py): per fleet scenario, prediction
    on against the same run with it off (the same seed), scored against the truth."""
    table = Table(title="Failure prediction: on against off (the same seed; pure core)")
    columns = (
        "scenario",
        "ranks",
        "node-days",
        "drains",
        "precision",
        "recall",
        "recall (all)",
        "lead p50 / p10 min",
        "false drains",
        "per 1,000 node-days",
        "goodput off -> on",
        "gained s (pts)",
        "clean",
    )
    for column in columns:
        table.add_column(column)

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    for c in comparisons:
        s = c.score
        lead = "-" if s.lead_median_s is None else f"{s.lead_median_s / 60:.0f} / {s.lead_p10_s / 60:.0f}"
        table.add_row(
            s.scenario,
            f"{s.world_size:,}",
            f"{s.node_days:,.0f}",
            str(s.drains),
            share(s.precision),
            f"{share(s.recall)} ({s.foretold_drained}/{s.foretold})",
            f"{share(s.recall_all)} ({s.drained}/{s.failures})",
            lead,
            f"{s.false_drains} ({s.early} early)",
            f"{s.false_per_1000_node_days:.2f}",
            f"{s.off_goodput:.4f} -> {s.on_goodput:.4f}",
            f"{s.gained_s:+,.0f} ({s.gained_points:+.2f})",
            "no" if s.failed else "yes",
        )
    return table


def scenario_lines(scores: list[Any]) -> list[str]:
    lines = []
    for scenario in scores:
        verdict = "CHECK" if scenario.failed else "ok"
        found = ", ".join(sorted({d.detector for d in scenario.detections})) or "nothing"
        lines.append(f"{scenario.scenario:26s} {verdict:5s} detected: {found}")
        lines += [f"    missed {m.kind} rank {m.rank} ({m.node}) at step {m.step}" for m in scenario.misses]
        lines += [
            f"    false alarm {a.detector} rank {a.rank} ({a.node}) at step {a.step}: {a.event.reason.text}"
            for a in scenario.false_alarms
        ]
        lines += [f"    {line}" for line in scenario.violations]
        lost = scenario.harms.lost_s
        if lost:
            lines.append("    goodput lost: " + ", ".join(f"{k} {v:,.1f} s" for k, v in sorted(lost.items())))
    return lines
