"""Failure prediction over the library's fleet scenarios (issue 46): every precursor-* and
noise-* scenario, at 1,024 and 16,384 ranks, run at run level (producers/simulator/fleet.py)
through the pure core twice with the same seed, prediction on (the evaluate policy's
defaults) and off, and scored against the truth (harness/scoring/prediction.py): precision, recall,
lead time, false drains, false drains per 1,000 node-days, and the net goodput gained.
Prints the docs/benchmarks.md table, the acceptance lines and what each run cost.

    .venv/bin/python bench/bench_prediction.py [--scenario NAME ...] [--jobs N] [--json out.json]
                                               [--warm-spares]

`--jobs` runs scenarios in parallel processes (each run is single-threaded); the 16,384-rank
days dominate (~11.8 million GPU health reports a day each way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from harness.devtools.stack import builtin_policy
from harness.scoring.prediction import (
    PredictionScore,
    acceptance_lines,
    compare_prediction,
    prediction_json,
)
from trainguard.processors.core.policy import load_policy
from trainguard.producers.simulator.fleet_scenario import fleet_library


def one(name: str, warm: bool = False) -> tuple[PredictionScore, dict[str, Any]]:
    policy = load_policy(str(builtin_policy("evaluate")))
    started = time.perf_counter()
    scenario = fleet_library()[name]
    if warm:  # a diagnostic: spares join at the fleet's load, no warm-up from idle
        fleet = scenario.fleet.model_copy(update={"spare_idle": False})
        scenario = scenario.model_copy(update={"name": f"{name} (warm spares)", "fleet": fleet})
    c = compare_prediction(scenario, policy)
    costs = {
        "wall_s": time.perf_counter() - started,
        "events": c.on.events,
        "health_reports": c.on.truth.health_reports,
        "on_s": c.on.seconds,
        "off_s": c.off.seconds,
        "predictions": c.on.predictions,
        "declined": sum(d.decision == "decline" for d in c.on.decisions),
        "json": prediction_json([c])[0],
    }
    return c.score, costs


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def row(s: PredictionScore) -> str:
    lead = "-" if s.lead_median_s is None else f"{s.lead_median_s / 60:.0f} / {(s.lead_p10_s or 0) / 60:.0f}"
    cells = [
        s.scenario,
        f"{s.world_size:,}",
        f"{s.node_days:,.0f}",
        str(s.drains),
        pct(s.precision),
        f"{pct(s.recall)} ({s.foretold_drained}/{s.foretold})",
        f"{pct(s.recall_all)} ({s.drained}/{s.failures})",
        lead,
        f"{s.false_drains} ({s.early} early)",
        f"{s.false_per_1000_node_days:.2f}",
        f"{s.off_goodput:.4f} → {s.on_goodput:.4f}",
        f"{s.gained_s:+,.0f} s ({s.gained_points:+.2f} pts)",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| scenario | ranks | node-days | drains | precision | recall (foretold) | recall (all) "
    "| lead p50 / p10 (min) | false drains | per 1,000 node-days | goodput off → on | gained |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", action="append", help="A fleet scenario (repeat); default: all.")
    parser.add_argument("--jobs", type=int, default=1, help="Scenarios run in parallel processes.")
    parser.add_argument("--json", type=Path, help="Also write every score and cost here.")
    parser.add_argument(
        "--warm-spares",
        action="store_true",
        help="Diagnostic: every spare joins at the fleet's load (spare_idle false), not idle.",
    )
    args = parser.parse_args()
    library = fleet_library()
    names = args.scenario or sorted(library, key=lambda n: (library[n].fleet.world_size, n))
    started = time.perf_counter()
    results: list[tuple[PredictionScore, dict[str, Any]]] = []
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as pool:
        mapped = (pool.map if pool is not None else map)(one, names, [args.warm_spares] * len(names))
        # each scenario's row as it ends (a 16,384-rank one takes an hour), and the JSON so far
        for score, cost in mapped:
            results.append((score, cost))
            print(f"{score.scenario}: {cost['wall_s']:,.0f} s ({cost['events']:,} events with prediction on)")
            print(f"    {row(score)}", flush=True)
            if args.json is not None:
                _write_json(args.json, results)
    print()
    print(HEADER)
    for score, _ in results:
        print(row(score))
    print()
    for line in acceptance_lines([score for score, _ in results]):
        print(line)
    print()
    for score, cost in results:
        print(
            f"{score.scenario}: {cost['health_reports']:,} health reports, {cost['events']:,} events; "
            f"on {cost['on_s']:,.0f} s, off {cost['off_s']:,.0f} s; {cost['predictions']} predictions, "
            f"{cost['declined']} declined"
        )
    for score, cost in results:
        by = cost["json"]["recall_by"]
        if by["kind"]:
            kinds = ", ".join(f"{k} {d}/{n}" for k, (d, n) in sorted(by["kind"].items()))
            leads = ", ".join(f"{k} min {d}/{n}" for k, (d, n) in by["lead_min"].items())
            print(f"{score.scenario}: drained/foretold by precursor: {kinds}; by lead: {leads}")
    print(f"total {time.perf_counter() - started:,.0f} s")


def _write_json(path: Path, results: list[tuple[PredictionScore, dict[str, Any]]]) -> None:
    document = [
        {**cost["json"], "cost": {k: v for k, v in cost.items() if k != "json"}} for _, cost in results
    ]
    path.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
