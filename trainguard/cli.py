"""`trainguard`: one command line for every part of the pipeline.

Imports of heavy parts (faust, duckdb) happen inside the subcommands, so `--help`
is instant and one missing part does not break the others.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from . import __version__

if TYPE_CHECKING:
    from .broker.security import KafkaCredentials

app = typer.Typer(
    help="trainguard keeps long synchronous training runs alive and trustworthy: ranks report "
    "to Kafka, processors detect hangs and crashes and send commands back, DuckDB keeps the log.",
    no_args_is_help=True,
    add_completion=False,
)
broker_app = typer.Typer(help="Run a local single-node Kafka broker (KRaft) from Maven Central jars.")
secret_app = typer.Typer(help="Manage the command-signing secret (never stored in the repository).")
app.add_typer(broker_app, name="broker")
app.add_typer(secret_app, name="secret")
policy_app = typer.Typer(help="Check and show policy files (every threshold of the core).")
app.add_typer(policy_app, name="policy")
console = Console(stderr=True)

Bootstrap = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        envvar="TRAINGUARD_BOOTSTRAP",
        help="Kafka bootstrap servers. Default: the local broker started by `trainguard broker start`.",
    ),
]
Prefix = Annotated[str, typer.Option("--topic-prefix", help="Prefix of every topic name (isolation).")]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Broker data directory.")]
ReportFile = Annotated[
    Path | None, typer.Option("--output", help="Also write the report to this file (.txt, .md, or .html).")
]


def resolve_bootstrap(bootstrap: str | None) -> str:
    if bootstrap:
        return bootstrap
    from .broker.local import local_broker_status

    status = local_broker_status()
    if not status.running or not status.bootstrap:
        console.print(
            "[red]No broker: pass --bootstrap, set TRAINGUARD_BOOTSTRAP, or run `trainguard broker start`."
        )
        raise typer.Exit(2)
    return status.bootstrap


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@app.command()
def version() -> None:
    """Print the version."""
    print(__version__)


# --------------------------------------------------------------------------- broker


@broker_app.command("start")
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
    from .broker.local import BrokerError, start_local_broker

    try:
        broker = start_local_broker(data_dir, secure=True if secure else None)
    except BrokerError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(1) from exc
    print(broker.bootstrap)
    if broker.secure:
        console.print("secured: each process names its principal, e.g. the processor:", markup=False)
        for user in ("admin", "processor", "archive"):
            console.print(f"  {_principal_env(user, broker.credentials_dir / user)}", markup=False)
        console.print("and each run's ranks: `trainguard broker grant-run RUN_ID`", markup=False)


def _principal_env(user: str, password_file: Path) -> str:
    from .broker.security import PASSWORD_FILE_ENV, USER_ENV

    return f"export {USER_ENV}={user} {PASSWORD_FILE_ENV}={password_file}"


def _admin_access(data_dir: Path | None) -> tuple[KafkaCredentials, Path]:
    """The admin principal (TRAINGUARD_KAFKA_* if set, else the local broker's) and the
    directory where run passwords are written (the local broker's credentials/)."""
    from .broker.local import LocalBroker, default_data_dir
    from .broker.security import CredentialsError, KafkaCredentials

    broker = LocalBroker(data_dir or default_data_dir())
    try:
        admin = KafkaCredentials.from_env() or broker.admin_credentials()
    except CredentialsError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc
    if admin is None:
        console.print("[red]not a secured broker: start it with `trainguard broker start --secure`")
        raise typer.Exit(2)
    return admin, broker.credentials_dir


RunId = Annotated[str, typer.Argument(help="The run id (as in `trainguard launch --run-id`).")]


@broker_app.command("grant-run")
def broker_grant_run(
    run_id: RunId, bootstrap: Bootstrap = None, topic_prefix: Prefix = "", data_dir: DataDir = None
) -> None:
    """Secured broker: create a run's rank principal (password file 0600), its command topic
    and its ACLs (write telemetry and acks, read only its own commands). Before the launch."""
    from .broker.acl import provision_run

    admin, credentials_dir = _admin_access(data_dir)
    user, path = provision_run(resolve_bootstrap(bootstrap), admin, credentials_dir, run_id, topic_prefix)
    print(_principal_env(user, path))


@broker_app.command("revoke-run")
def broker_revoke_run(
    run_id: RunId, bootstrap: Bootstrap = None, topic_prefix: Prefix = "", data_dir: DataDir = None
) -> None:
    """Secured broker: remove a run's principal, password file, ACLs and command topic."""
    from .broker.acl import revoke_run

    admin, credentials_dir = _admin_access(data_dir)
    revoke_run(resolve_bootstrap(bootstrap), admin, credentials_dir, run_id, topic_prefix)
    console.print(f"revoked {run_id}")


@broker_app.command("stop")
def broker_stop(data_dir: DataDir = None) -> None:
    """Stop the local broker (controlled shutdown, then SIGKILL after a timeout)."""
    from .broker.local import stop_local_broker

    console.print("stopped" if stop_local_broker(data_dir) else "no broker was running")


@broker_app.command("status")
def broker_status(data_dir: DataDir = None) -> None:
    """Say whether the local broker runs, and its address."""
    from .broker.local import local_broker_status

    status = local_broker_status(data_dir)
    print(f"running {status.bootstrap}" if status.running else "stopped")
    raise typer.Exit(0 if status.running else 1)


@broker_app.command("topics")
def broker_topics(bootstrap: Bootstrap = None, topic_prefix: Prefix = "") -> None:
    """Create trainguard's topics (idempotent) with their documented settings."""
    from .broker.topics import ensure_topics

    for name in ensure_topics(resolve_bootstrap(bootstrap), prefix=topic_prefix):
        print(name)


# --------------------------------------------------------------------------- secret


@policy_app.command("check")
def policy_check(path: Annotated[Path, typer.Argument(help="Policy YAML file.")]) -> None:
    """Validate a policy file: every invalid field is named with the reason (exit 1)."""
    from .processors.core.policy import PolicyError, load_policy

    try:
        load_policy(str(path))
    except PolicyError as exc:
        console.print(str(exc), markup=False)
        raise typer.Exit(1) from None
    except OSError as exc:
        console.print(f"cannot read {path}: {exc}", markup=False)
        raise typer.Exit(1) from None
    console.print(f"{path}: ok")


@policy_app.command("show")
def policy_show(
    path: Annotated[
        Path | None, typer.Argument(help="Policy YAML file; default: the built-in defaults.")
    ] = None,
) -> None:
    """Print the effective policy (the file's values over the seed's defaults) as YAML."""
    from .processors.core.policy import PolicyError, dump_policy, load_policy

    try:
        typer.echo(dump_policy(load_policy(str(path) if path else None)), nl=False)
    except PolicyError as exc:
        console.print(str(exc), markup=False)
        raise typer.Exit(1) from None


@secret_app.command("init")
def secret_init(
    path: Annotated[Path, typer.Option(help="Where to write the secret (mode 0600).")] = Path(
        ".trainguard/secret"
    ),
) -> None:
    """Create a random command-signing secret file; export TRAINGUARD_SECRET_FILE=<path> to use it."""
    from .schemas.auth import write_secret_file

    print(write_secret_file(path))


def master_secret() -> bytes:
    from .schemas.auth import SecretError, load_master_secret

    try:
        return load_master_secret()
    except SecretError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc


# --------------------------------------------------------------------------- pipeline parts


@app.command()
def process(
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
    policy: Annotated[str | None, typer.Option(help="Policy YAML (defaults: the seed's numbers).")] = None,
    metrics_port: Annotated[int, typer.Option(help="Prometheus /metrics port (0: off).")] = 9464,
    metrics_addr: Annotated[str, typer.Option(help="Address the metrics server binds.")] = "127.0.0.1",
    loglevel: Annotated[str, typer.Option(help="faust log level")] = "warning",
    api_port: Annotated[
        int, typer.Option(help="Run API port (0: off); needs TRAINGUARD_API_TOKEN(_FILE).")
    ] = 0,
    api_host: Annotated[str, typer.Option(help="Address the run API binds.")] = "127.0.0.1",
    snapshot_interval: Annotated[
        float, typer.Option(help="Seconds between state snapshots of a partition (0: none).")
    ] = 30.0,
    commit_interval: Annotated[float, typer.Option(help="Seconds between offset commits.")] = 1.0,
    instance_id: Annotated[
        str | None,
        typer.Option(
            envvar="TRAINGUARD_INSTANCE_ID",
            help="Static group member id, stable across this worker's restarts (e.g. its pod "
            "name): a restart within the session timeout takes its partitions straight back.",
        ),
    ] = None,
) -> None:
    """Run the stream processor: telemetry -> detections, interruptions and signed commands."""
    from .processors.api_web import ApiTokenError, load_api_token
    from .processors.app import ProcessorSettings, run_worker
    from .processors.core.policy import load_policy

    try:
        api_token = load_api_token() if api_port else None
    except ApiTokenError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc
    settings = ProcessorSettings(
        bootstrap=resolve_bootstrap(bootstrap),
        master_secret=master_secret(),
        topic_prefix=topic_prefix,
        policy=load_policy(policy),
        metrics_port=metrics_port or None,
        metrics_addr=metrics_addr,
        api_port=api_port or None,
        api_host=api_host,
        api_token=api_token,
        snapshot_interval_s=snapshot_interval,
        commit_interval_s=commit_interval,
        instance_id=instance_id or None,
    )
    run_worker(settings, loglevel=loglevel)


@app.command()
def archive(
    db: Annotated[Path, typer.Option(help="DuckDB file to write.")] = Path(".trainguard/trainguard.duckdb"),
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
) -> None:
    """Archive every topic into DuckDB; offsets are committed only after rows are durable."""
    from .broker.topics import topic_names
    from .sinks.archive import ArchiveWriter

    db.parent.mkdir(parents=True, exist_ok=True)
    writer = ArchiveWriter(resolve_bootstrap(bootstrap), topic_names(topic_prefix), db)
    writer.run(stop_on_signals())


@app.command()
def simulate(
    scenario: Annotated[
        str,
        typer.Argument(
            help="Scenario YAML, or a built-in name (demo, healthy-16k, healthy-1k, scenarios/library/*)."
        ),
    ],
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
    speed: Annotated[float, typer.Option(help="Time compression: 2 runs twice as fast.")] = 1.0,
    max_seconds: Annotated[float | None, typer.Option(help="Stop after this much wall time.")] = None,
) -> None:
    """Emit a simulated cluster's telemetry (with the scenario's faults) and obey commands."""
    from .broker.topics import topic_names
    from .cli_replay import progress_bar
    from .producers.simulator.driver import Progress, run_simulation
    from .producers.simulator.scenario import Scenario

    chosen = Scenario.load(scenario) if Path(scenario).exists() else Scenario.builtin(scenario)
    with progress_bar() as update:

        def report(p: Progress) -> None:  # the step reached, of the scenario's (or of the time allowed)
            total, done = (chosen.steps, p.step) if max_seconds is None else (int(max_seconds), int(p.wall_s))
            update(
                f"simulating ({p.phase}, attempt {p.attempt}, {p.events:,} events)", min(done, total), total
            )

        result = run_simulation(
            chosen,
            resolve_bootstrap(bootstrap),
            topic_names(topic_prefix),
            master_secret(),
            speed=speed,
            max_seconds=max_seconds,
            progress=report,
        )
    console.print(result)


@app.command()
def evaluate(
    scenario: Annotated[
        list[str] | None, typer.Option(help="Library scenario name(s); default: the whole library.")
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
    fault. Through the pure core (always) and the live pipeline on a real broker (--live)."""
    from .processors.core.policy import load_policy
    from .producers.simulator import Scenario
    from .replay.evaluate import ScenarioScore, run_core, scores_json
    from .report import evaluation_table, harms_table, make_console, scenario_lines
    from .stack import builtin_policy

    out = make_console()
    policy_path = Path(policy) if policy else builtin_policy("evaluate")
    chosen = Scenario.library()
    if scenario:
        chosen = {name: chosen[name] for name in scenario}
    core = []
    for name, sc in chosen.items():
        with console.status(f"pure core: {name}"):
            core.append(run_core(sc, load_policy(str(policy_path)), shard_ranks=shard_ranks, workers=workers))
    sharded = f", shards of {shard_ranks} ranks over {workers} worker(s)" if shard_ranks else ""
    out.print(evaluation_table(f"Pure core ({len(core)} scenarios{sharded})", core))
    out.print(harms_table("Pure core: what a user suffers", core))
    for line in scenario_lines(core):
        out.print(line, markup=False)
    failed = any(s.failed for s in core)
    scores: list[ScenarioScore] = []
    if live:
        from .replay.evaluate_live import run_live
        from .schemas.auth import write_secret_file
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
        failed |= any(s.failed for s in scores)
    if json_out is not None:
        json_out.write_text(json.dumps({"core": scores_json(core), "live": scores_json(scores)}, indent=1))
    raise typer.Exit(1 if failed else 0)


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
    db: Annotated[Path, typer.Option(help="DuckDB archive the run's records and decisions go to.")] = Path(
        ".trainguard/longrun.duckdb"
    ),
    rows: Annotated[int, typer.Option(help="Timeline rows to print (the last ones; 0: all).")] = 20,
) -> None:
    """Simulate a month-long run with failures at the Llama 3 rate (419 in 54 days on 16,384
    GPUs, MTBF inversely proportional to the world size) through the policy core, and print
    what happened, what the core measured and decided, the seed's formulas, the timeline
    and the goodput breakdown (all stored in --db)."""
    from rich.progress import Progress

    from .processors.core.policy import load_policy
    from .producers.simulator.longrun import LongRun
    from .replay.longrun import run_longrun
    from .report import longrun_table, make_console, print_goodput, print_timeline

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
    if db.exists():
        db.unlink()  # one run per file: the report reads it back
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
    db: Annotated[Path, typer.Option(help="DuckDB archive.")] = Path(".trainguard/trainguard.duckdb"),
    run: Annotated[str | None, typer.Option(help="Only this run_id.")] = None,
    output: ReportFile = None,
) -> None:
    """Print every interruption: when, cause, node, cost (from the DuckDB archive)."""
    from .report import make_console, print_timeline, save_report

    console = make_console(record=output is not None)
    print_timeline(db, run, console)
    save_report(console, output)


@app.command()
def goodput(
    db: Annotated[Path, typer.Option(help="DuckDB archive.")] = Path(".trainguard/trainguard.duckdb"),
    run: Annotated[str | None, typer.Option(help="Only this run_id.")] = None,
    output: ReportFile = None,
) -> None:
    """Print each run's goodput breakdown over 1 h, 24 h and 7 d (from the DuckDB archive)."""
    from .report import make_console, print_goodput, save_report

    console = make_console(record=output is not None)
    print_goodput(db, run, console)
    save_report(console, output)


@app.command(context_settings={"allow_interspersed_args": False})
def launch(
    command: Annotated[list[str], typer.Argument(help="The rank program, after --: python train.py args.")],
    nproc: Annotated[int, typer.Option(help="World size: rank processes per attempt.")],
    run_id: Annotated[str, typer.Option(help="The run's id (commands are signed for it).")],
    checkpoint_dir: Annotated[Path, typer.Option(help="Validated checkpoints: DIR/step-N/VALIDATED.")],
    ranks_per_node: Annotated[int, typer.Option(help="Ranks of one modelled node.")] = 1,
    spares: Annotated[int, typer.Option(help="Spare nodes quarantine can swap in.")] = 2,
    nodes_per_rack: Annotated[int, typer.Option(help="Nodes per modelled rack.")] = 4,
    max_restarts: Annotated[int, typer.Option(help="Restarts before giving up (any cause).")] = 3,
    grace_s: Annotated[float, typer.Option(help="After an Abort: seconds the ranks get to exit.")] = 15.0,
    decision_wait_s: Annotated[
        float, typer.Option(help="After a crash: seconds to wait for the processor's decisions.")
    ] = 3.0,
    offline: Annotated[
        bool, typer.Option(help="No Kafka: no telemetry, no commands (restarts on crashes only).")
    ] = False,
    self_test: Annotated[
        str,
        typer.Option(
            help="When a spare is self-tested (known answers: GEMM, all-reduce) before it joins: "
            "on-demand (once a quarantine picks it), ahead (from the start), off."
        ),
    ] = "on-demand",
    restart_from_scratch: Annotated[
        bool,
        typer.Option(help="When every checkpoint was rejected, start again from step 0 (default: stop)."),
    ] = False,
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
) -> None:
    """Start and supervise NPROC rank processes of COMMAND: restarts from the newest validated
    checkpoint, executes Abort/QuarantineNode/EvictRank/Rollback/ResumeFrom, records the restart
    phases in DIR/.trainguard/restarts.jsonl. Exit 0 ok, 1 failed, 130 stopped, 75 paused (a
    PauseRun: the run fails at one step on every node; fix the data or code, then relaunch)."""
    if self_test not in ("on-demand", "ahead", "off"):
        console.print(f"[red]--self-test must be on-demand, ahead or off (got {self_test!r})")
        raise typer.Exit(2)
    from .producers.agent import MemorySink
    from .producers.launcher import (
        FAULT_ENV,
        Launcher,
        LauncherConfig,
        install_signal_handlers,
        make_actuator,
    )

    config = LauncherConfig(
        command=tuple(command),
        nproc=nproc,
        ranks_per_node=ranks_per_node,
        run_id=run_id,
        checkpoint_dir=checkpoint_dir.resolve(),
        spares=spares,
        nodes_per_rack=nodes_per_rack,
        max_restarts=max_restarts,
        grace_s=grace_s,
        decision_wait_s=decision_wait_s,
        self_test_spares=self_test,  # type: ignore[arg-type]  # checked above
        restart_from_scratch=restart_from_scratch,
        bootstrap="" if offline else resolve_bootstrap(bootstrap),
        topic_prefix=topic_prefix,
        secret_file=os.environ.get("TRAINGUARD_SECRET_FILE", ""),
        # Test hook (kill points of producers/launcher.py); not passed on to the ranks.
        fault=os.environ.pop(FAULT_ENV, ""),
    )
    if offline:
        launcher = Launcher(config, MemorySink())
        install_signal_handlers(launcher)
        result = launcher.run()
    else:
        from .broker.topics import topic_names
        from .producers.shipper import ShipperConfig, TelemetryShipper

        names = topic_names(topic_prefix)
        secret = master_secret()
        shipper = TelemetryShipper(
            ShipperConfig(config.bootstrap, names.telemetry), run_id, nproc, name="launcher"
        )
        launcher = Launcher(config, shipper)
        install_signal_handlers(launcher)
        actuator = make_actuator(launcher, config.bootstrap, names.commands, names.acks, secret)
        try:
            with actuator:
                if not actuator.wait_ready(30):
                    console.print("[yellow]commands topic not assigned yet; continuing")
                result = launcher.run()
        finally:
            shipper.close()
    for rec in result.restarts:
        console.print(
            f"interruption {rec.interruption}: {rec.cause} ({rec.detail}) attempt {rec.from_attempt}"
            f"->{rec.to_attempt}, restart {rec.restart_s if rec.restart_s is not None else '?'} s",
            markup=False,
        )
    console.print(f"{result.status}: {result.reason} ({result.attempts} attempts)", markup=False)
    raise typer.Exit({"ok": 0, "failed": 1, "stopped": 130, "paused": 75}[result.status])


@app.command()
def selftest(
    node: Annotated[
        str | None, typer.Option(help="The node's name in the report (default: TRAINGUARD_NODE or the host).")
    ] = None,
    nproc_per_node: Annotated[
        int, typer.Option(help="Devices to test, one process each (0: LOCAL_WORLD_SIZE, the GPUs, else 2).")
    ] = 0,
    tests: Annotated[str, typer.Option(help="Comma-separated: gemm, collective.")] = "gemm,collective",
    timeout_s: Annotated[float, typer.Option(help="Give up (and fail) after this many seconds.")] = 120.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full report as JSON.")] = False,
) -> None:
    """Run the node self-test with known answers: a matrix multiply of small integers on every
    device (exact whatever the kernel's summation order) and an all-reduce of known values
    across them (NCCL on GPUs, gloo on CPU). Exit 0 when every test passed, 1 otherwise."""
    import json
    import socket

    from .producers.selftest import default_nproc, run_node_self_test

    chosen = [t.strip() for t in tests.split(",") if t.strip()]
    name = node or os.environ.get("TRAINGUARD_NODE") or socket.gethostname()
    try:
        report = run_node_self_test(name, nproc_per_node or default_nproc(), chosen, timeout_s)
    except ValueError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from None
    if json_out:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for r in report.results:
            mark = "ok  " if r.passed else "FAIL"
            console.print(
                f"{mark} {r.test:<10} local rank {r.local_rank} ({r.device}): {r.detail}", markup=False
            )
        for error in report.errors:
            console.print(f"FAIL {error}", markup=False)
        console.print(report.summary(), markup=False)
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def demo(
    scenario: Annotated[Path | None, typer.Option(help="Scenario YAML; default: the 64-rank demo.")] = None,
    workdir: Annotated[Path, typer.Option(help="Where the demo's broker data and DuckDB file go.")] = Path(
        ".trainguard/demo"
    ),
    metrics_port: Annotated[int, typer.Option(help="Prometheus /metrics port during the demo.")] = 9464,
) -> None:
    """The live demo: a local broker, a 64-rank simulated run with a crash and a hang, the
    processor detecting both, commands executed and acknowledged, then the timeline."""
    from .demo import run_demo
    from .report import make_console

    raise typer.Exit(run_demo(scenario, workdir, metrics_port, make_console()))


# Commands kept in modules of their own register on `app` when imported.
from . import cli_replay, cli_soak  # noqa: E402, F401


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
