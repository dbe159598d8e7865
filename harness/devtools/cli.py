"""The development tooling's commands, added to `trainguard` through the `trainguard.cli`
entry point (pyproject.toml): the local broker (`broker start|stop|status`), the demo,
the labelled-scenario evaluation (`evaluate`, `--live` on a local stack) and the chaos
soak. They import the product; the product never imports them (docs/architecture.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trainguard.cli.app import DataDir, bootstrap_fallbacks, broker_app, console, master_secret, principal_env

from .cli_soak import soak

if TYPE_CHECKING:
    from rich.console import Console

    from trainguard.processors.core.policy import CorePolicy
    from trainguard.producers.simulator.fleet_scenario import FleetScenario

    from ..scoring.prediction import PredictionComparison


def local_bootstrap() -> str | None:
    """The running local broker's address, when --bootstrap and TRAINGUARD_BOOTSTRAP are unset."""
    from .local_broker import local_broker_status

    status = local_broker_status()
    return status.bootstrap if status.running else None


def register(app: typer.Typer) -> None:
    """The entry point: add the tooling's commands to the CLI, and the local broker as the
    place to find a broker when none is named."""
    broker_app.command("start")(broker_start)
    broker_app.command("stop")(broker_stop)
    broker_app.command("status")(broker_status)
    app.command()(demo)
    app.command()(evaluate)
    app.command()(soak)
    bootstrap_fallbacks.append(local_bootstrap)


def broker_start(
    data_dir: DataDir = None,
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="SASL/SCRAM authentication and ACLs (a new data dir only; it stays secured). "
            "Passwords are generated into <data dir>/credentials/ (mode 0600).",
        ),
    ] = False,
) -> None:
    """Fetch the jars (cached), format storage, start the broker, create the topics."""
    from .local_broker import BrokerError, start_local_broker

    try:
        broker = start_local_broker(data_dir, secure=True if secure else None)
    except BrokerError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(1) from exc
    print(broker.bootstrap)
    if broker.secure:
        console.print("secured: each process names its principal, e.g. the processor:", markup=False)
        for user in ("admin", "processor", "archive"):
            console.print(f"  {principal_env(user, broker.credentials_dir / user)}", markup=False)
        console.print("and each run's ranks: `trainguard broker grant-run RUN_ID`", markup=False)


def broker_stop(data_dir: DataDir = None) -> None:
    """Stop the local broker (controlled shutdown, then SIGKILL after a timeout)."""
    from .local_broker import stop_local_broker

    console.print("stopped" if stop_local_broker(data_dir) else "no broker was running")


def broker_status(data_dir: DataDir = None) -> None:
    """Say whether the local broker runs, and its address."""
    from .local_broker import local_broker_status

    status = local_broker_status(data_dir)
    print(f"running {status.bootstrap}" if status.running else "stopped")
    raise typer.Exit(0 if status.running else 1)


def demo(
    scenario: Annotated[Path | None, typer.Option(help="Scenario YAML; default: the 64-rank demo.")] = None,
    workdir: Annotated[Path, typer.Option(help="Where the demo's broker data and archive go.")] = Path(
        ".trainguard/demo"
    ),
    metrics_port: Annotated[int, typer.Option(help="Prometheus /metrics port during the demo.")] = 9464,
) -> None:
    """The live demo: a local broker, a 64-rank simulated run with a crash and a hang, the
    processor detecting both, commands executed and acknowledged, then the timeline."""
    from trainguard.cli.render import make_console

    from .demo import run_demo

    raise typer.Exit(run_demo(scenario, workdir, metrics_port, make_console()))


def evaluate(
    scenario: Annotated[
        list[str] | None,
        typer.Option(
            help="Library scenario name(s); default: the whole library (its fleet scenarios over "
            "1,024 ranks only when named)."
        ),
    ] = None,
    live: Annotated[
        bool,
        typer.Option(
            help="Also run each scenario through the live pipeline (scenarios over 1,024 ranks only "
            "when named with --scenario)."
        ),
    ] = False,
    speed: Annotated[
        float | None,
        typer.Option(
            help="Live: time compression for every scenario (1: real time); default: each "
            "scenario's own live_speed."
        ),
    ] = None,
    policy: Annotated[str | None, typer.Option(help="Policy YAML; default: policies/evaluate.yaml.")] = None,
    workdir: Annotated[Path, typer.Option(help="Broker data for --live.")] = Path(".trainguard/evaluate"),
    metrics_port: Annotated[int, typer.Option(help="Processor metrics port for --live.")] = 9465,
    shard_ranks: Annotated[
        int,
        typer.Option(
            help="Pure core: cut each run into shards of this many ranks (0: whole runs), as the "
            "shippers cut runs larger than one worker."
        ),
    ] = 0,
    workers: Annotated[int, typer.Option(help="Pure core: workers (separate states) the shards go to.")] = 1,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write every score (detectors and harms) here.")
    ] = None,
) -> None:
    """Score every detector on the labelled fault scenarios: TP, FP, FN and detection
    latency; and what a user suffers: false pages, false quarantines, wrong rollback
    targets, restarts into a failing step, phantom records accepted, goodput lost per
    fault. Through the pure core (always) and the live pipeline on a real broker (--live).
    A scenario whose lost node's replacement takes time (elastic training, issue 45) runs
    twice through the pure core, elastic off (wait) and under the policy (shrink), and the
    goodput of both is printed; the policy's run is the one scored. A fleet scenario
    (failure prediction, issue 46: precursor-*, noise-*) runs at run level through the pure
    core twice with the same seed, prediction on and off: precision, recall, lead time,
    false drains and the goodput gained (harness/scoring/prediction.py); never live."""
    from trainguard.cli.render import make_console
    from trainguard.processors.core.policy import load_policy
    from trainguard.producers.simulator import Scenario
    from trainguard.producers.simulator.fleet_scenario import fleet_library

    from ..scoring.capacity import CapacityComparison, capacity_json, compare_capacity
    from ..scoring.evaluate import ScenarioScore, run_core, scores_json
    from ..scoring.prediction import prediction_json
    from .render import capacity_table, evaluation_table, harms_table, scenario_lines
    from .stack import builtin_policy

    out = make_console()
    policy_path = Path(policy) if policy else builtin_policy("evaluate")
    chosen, fleets = Scenario.library(), fleet_library()
    if scenario:
        unknown = [name for name in scenario if name not in chosen and name not in fleets]
        if unknown:
            console.print(f"[red]no library scenario {', '.join(unknown)}", markup=False)
            raise typer.Exit(2)
        chosen = {name: chosen[name] for name in scenario if name in chosen}
        fleets = {name: fleets[name] for name in scenario if name in fleets}
    else:
        fleets = {name: f for name, f in fleets.items() if f.fleet.world_size <= 1024}
    core = []
    capacity: list[CapacityComparison] = []
    for name, sc in chosen.items():
        with console.status(f"pure core: {name}"):
            policy_ = load_policy(str(policy_path))
            if sc.replacement_s > 0:
                capacity.append(compare_capacity(sc, policy_, shard_ranks=shard_ranks, workers=workers))
                core.append(capacity[-1].shrink.score)
            else:
                core.append(run_core(sc, policy_, shard_ranks=shard_ranks, workers=workers))
    sharded = f", shards of {shard_ranks} ranks over {workers} worker(s)" if shard_ranks else ""
    if core:
        out.print(evaluation_table(f"Pure core ({len(core)} scenarios{sharded})", core))
        out.print(harms_table("Pure core: what a user suffers", core))
    for line in scenario_lines(core):
        out.print(line, markup=False)
    if capacity:
        out.print(capacity_table(capacity))
    prediction = _prediction(fleets, load_policy(str(policy_path)), out)
    failed = any(s.failed for s in core) or any(c.wait.failed or c.shrink.failed for c in capacity)
    failed |= any(c.score.failed for c in prediction)
    scores: list[ScenarioScore] = []
    if live:
        from trainguard.schemas.auth import write_secret_file

        from .evaluate_live import run_live
        from .stack import local_stack

        workdir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TRAINGUARD_SECRET_FILE", str(write_secret_file(workdir / "secret")))
        secret = master_secret()
        scores = []
        named = set(scenario or ())
        with local_stack(workdir.resolve(), policy_path, metrics_port) as stack:
            for name, sc in chosen.items():
                if sc.world_size > 1024 and name not in named:
                    continue
                with console.status(f"live pipeline: {name} (x{speed or sc.live_speed})"):
                    scores.append(run_live(sc, stack, secret, speed=speed))
        out.print(evaluation_table(f"Live pipeline ({len(scores)} scenarios)", scores))
        out.print(harms_table("Live pipeline: what a user suffers", scores))
        for line in scenario_lines(scores):
            out.print(line, markup=False)
        for live_score in scores:  # elastic training live: the stack's policy only
            if chosen[live_score.scenario].replacement_s > 0 and live_score.goodput is not None:
                text = f"{live_score.scenario}: live goodput {live_score.goodput:.3f} ({policy_path.name})"
                out.print(f"{text} (its last report)", markup=False)
        failed |= any(s.failed for s in scores)
    if json_out is not None:
        document = {"core": scores_json(core), "live": scores_json(scores)}
        document["capacity"] = capacity_json(capacity)
        document["prediction"] = prediction_json(prediction)
        json_out.write_text(json.dumps(document, indent=1))
    raise typer.Exit(1 if failed else 0)


def _prediction(
    fleets: dict[str, FleetScenario], policy: CorePolicy, out: Console
) -> list[PredictionComparison]:
    """The fleet scenarios, prediction on and off (harness/scoring/prediction.py), printed."""
    from ..scoring.prediction import acceptance_lines, compare_prediction
    from .render import prediction_table

    comparisons = []
    for name, fleet in fleets.items():
        with console.status(f"pure core, prediction on and off: {name}"):
            comparisons.append(compare_prediction(fleet, policy))
    if comparisons:
        out.print(prediction_table(comparisons))
        for line in acceptance_lines([c.score for c in comparisons]):
            out.print(line, markup=False)
    return comparisons
