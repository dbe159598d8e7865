"""Commands that run a part of the pipeline: the processor, the archive writer, the
launcher that supervises a job's ranks, the node self-test and the cluster simulator."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .app import (
    DEFAULT_ARCHIVE,
    ArchiveRoot,
    Bootstrap,
    ConnectTimeout,
    Prefix,
    app,
    console,
    fail,
    master_secret,
    reach_broker,
    resolve_bootstrap,
    stop_on_signals,
)
from .launch_options import (
    DEFAULT_PRELOAD,
    LaunchArchive,
    LemonDays,
    LemonFailures,
    Preload,
    checkpoint_dir_location,
    lemon_settings,
    preload_modules,
    restart_line,
)


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
    connect_timeout: ConnectTimeout = 15.0,
) -> None:
    """Run the stream processor: telemetry -> detections, interruptions and signed commands."""
    from ..processors.api_web import ApiTokenError, load_api_token
    from ..processors.app import ProcessorSettings, run_worker
    from ..processors.core.policy import load_policy

    try:
        api_token = load_api_token() if api_port else None
    except ApiTokenError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc
    settings = ProcessorSettings(
        bootstrap=reach_broker(bootstrap, connect_timeout),
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
    db: ArchiveRoot = DEFAULT_ARCHIVE,
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
    connect_timeout: ConnectTimeout = 15.0,
    retain: Annotated[
        list[str] | None,
        typer.Option(
            help="TABLE=AGE: drop the hours of raw_event, telemetry_log (telemetry_columns with it) or "
            "dead_letter older than AGE (30d, 12h, seconds); repeatable. Default: keep everything."
        ),
    ] = None,
    maintain_every: Annotated[
        float, typer.Option(help="Seconds between compaction, retention and vacuum passes.")
    ] = 300.0,
    metrics_port: Annotated[int, typer.Option(help="Prometheus /metrics port (0: off).")] = 9465,
    metrics_addr: Annotated[str, typer.Option(help="Address the metrics server binds.")] = "127.0.0.1",
) -> None:
    """Archive every topic into Delta Lake tables that any number of readers query while it
    writes; a killed writer resumes from its last batch, losing and repeating nothing."""
    from ..kafka.lag_metrics import ConsumerLagCollector
    from ..kafka.topics import topic_names
    from ..sinks.archive import ArchiveWriter, Maintenance, archive_group, archived_topics
    from ..sinks.archive_metrics import ArchiveMetrics

    maintenance = Maintenance(every_s=maintain_every, retain_s=_retention(retain or []))
    resolved = reach_broker(bootstrap, connect_timeout)
    names, metrics = topic_names(topic_prefix), ArchiveMetrics()
    try:
        writer = ArchiveWriter(resolved, names, db, maintenance=maintenance, metrics=metrics)
    except RuntimeError as exc:  # another writer holds the root, or a newer schema
        fail(str(exc))
    if metrics_port:
        lag = ConsumerLagCollector(resolved, archive_group(names), archived_topics(names), "archive")
        lag.start(metrics.registry)
        metrics.serve(metrics_port, metrics_addr)
    writer.run(stop_on_signals())
    writer.close()


def _host_agent(state: Path | None, ckpt: str | None, node: str, run_id: str, elastic: bool) -> None:
    """An agent across hosts, before torch is imported: a quarantined host's leaves at once
    with one line (no journal, no record; elastic training readmits a lost host: world.py);
    the others tell the story on the console (launcher/story.py), lost-peer tracebacks to
    the ranks' log files (launcher/peer_tracebacks.py)."""
    import atexit
    import socket
    import sys

    from ..producers.launcher.peer_tracebacks import PeerLossFilter
    from ..producers.launcher.shared_quarantine import refused_at_start
    from ..producers.launcher.story import tell_console

    refused = refused_at_start(state, ckpt, node or socket.gethostname(), run_id, elastic)
    if refused is not None:
        fail(refused, code=1)
    atexit.register(PeerLossFilter(sys.stderr).install().close)  # held lines out before the exit
    tell_console(sys.stderr)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


def _retention(specs: list[str]) -> dict[str, float]:
    """--retain TABLE=AGE options as {table: seconds}."""
    from ..sinks.archive_schema import HOUR, PARTITIONS

    retain = {}
    for spec in specs:
        table, _, age = spec.partition("=")
        if HOUR not in PARTITIONS.get(table, ()):
            hourly = ", ".join(t for t, parts in PARTITIONS.items() if HOUR in parts)
            raise typer.BadParameter(f"{table!r}: retention applies to {hourly}", param_hint="--retain")
        unit = _UNITS.get(age[-1:])
        try:
            seconds = float(age[:-1]) * unit if unit else float(age)
        except ValueError:
            raise typer.BadParameter(
                f"{spec!r}: AGE is like 30d, 12h or seconds", param_hint="--retain"
            ) from None
        retain[table] = seconds
    return retain


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
    from ..kafka.topics import topic_names
    from ..producers.simulator.driver import Progress, run_simulation
    from ..producers.simulator.scenario import Scenario
    from .render import progress_bar

    chosen = Scenario.load(scenario) if Path(scenario).exists() else Scenario.builtin(scenario)
    with progress_bar() as update:

        def report(p: Progress) -> None:  # the step reached, of the scenario's (or of the time allowed)
            total, done = (chosen.steps, p.step) if max_seconds is None else (int(max_seconds), int(p.wall_s))
            update(
                f"simulating ({p.phase}, attempt {p.attempt}, {p.events:,} events)", min(done, total), total
            )

        result = run_simulation(
            chosen,
            reach_broker(bootstrap),
            topic_names(topic_prefix),
            master_secret(),
            speed=speed,
            max_seconds=max_seconds,
            progress=report,
        )
    console.print(result)


@app.command(context_settings={"allow_interspersed_args": False})
def launch(
    command: Annotated[
        list[str],
        typer.Argument(help="The rank program: train.py args (torchrun's form), or -- python train.py args."),
    ],
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(
            envvar="TRAINGUARD_CHECKPOINT_DIR",
            help="Validated checkpoints: DIR/step-N/VALIDATED. A path every host mounts (or file://), "
            "or an object store's URL (s3://bucket/ckpt with trainguard[s3]; any fsspec URL). "
            "Default on one host: $TRAINGUARD_HOME (./.trainguard)/runs/RUN_ID/checkpoints; "
            "required across hosts.",
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="TRAINGUARD_STATE_DIR",
            help="The launcher's files (journal, restart phases; across hosts the hosts' beats and "
            "the quarantine list, so a directory every host mounts). Default: DIR/.trainguard; with "
            "the default DIR, its runs/RUN_ID; with an object-store DIR, $TRAINGUARD_HOME/launch/RUN_ID "
            "on one host, required across hosts.",
        ),
    ] = None,
    nproc: Annotated[int, typer.Option(help="One host: world size (default: --nproc-per-node).")] = 0,
    run_id: Annotated[
        str,
        typer.Option(
            help="The run's id (commands are signed for it; default: --rdzv-id, else on one host "
            "one made from the command and the working directory, printed: the same command there "
            "resumes the run).",
        ),
    ] = "",
    log_dir: Annotated[
        Path | None,
        typer.Option(
            "--log-dir",
            "--log_dir",
            help="torchrun's: base directory of the ranks' log files, LOG_DIR/RUN_ID/attempt-N/rank-R/"
            "{stdout,stderr}.log (default: the launcher's files' logs/).",
        ),
    ] = None,
    tee: Annotated[
        str,
        typer.Option(
            "--tee",
            "-t",
            help="torchrun's: the ranks' streams shown on the console prefixed by [rankN]: (0 none, "
            "1 stdout, 2 stderr, 3 both; or per local rank, 0:3,1:1). Default 3; a stream in neither "
            "--tee nor --redirects is shown unprefixed. Both are always in the log files.",
        ),
    ] = "3",
    redirects: Annotated[
        str,
        typer.Option(
            "--redirects",
            "-r",
            help="torchrun's: the ranks' streams kept off the console, in their log files only "
            "(same values as --tee, which wins).",
        ),
    ] = "0",
    nnodes: Annotated[
        str, typer.Option("--nnodes", help="torchrun's: hosts, N or MIN:MAX (one agent per host).")
    ] = "",
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", "--nproc_per_node", help="torchrun's: ranks per host.")
    ] = 0,
    rdzv_backend: Annotated[
        str, typer.Option("--rdzv-backend", "--rdzv_backend", help="torchrun's: rendezvous backend.")
    ] = "c10d",
    rdzv_endpoint: Annotated[
        str,
        typer.Option(
            "--rdzv-endpoint", "--rdzv_endpoint", help="torchrun's: HOST:PORT of the rendezvous store."
        ),
    ] = "",
    rdzv_id: Annotated[
        str, typer.Option("--rdzv-id", "--rdzv_id", help="torchrun's: the job's rendezvous id.")
    ] = "",
    rdzv_conf: Annotated[
        str, typer.Option("--rdzv-conf", "--rdzv_conf", help="torchrun's: key=value,... for the rendezvous.")
    ] = "",
    local_addr: Annotated[
        str, typer.Option("--local-addr", "--local_addr", help="torchrun's: how other hosts reach this one.")
    ] = "",
    node_name: Annotated[
        str, typer.Option(help="This host's node name in every event (default: hostname).")
    ] = "",
    ranks_per_node: Annotated[int, typer.Option(help="One host: ranks of one modelled node.")] = 1,
    spares: Annotated[int, typer.Option(help="One host: modelled spare nodes quarantine can swap in.")] = 2,
    spare: Annotated[
        bool,
        typer.Option(
            "--spare",
            help="Across hosts: this agent is a spare host. It stays out of the rendezvous (never "
            "growing a world below MAX) until a host of the run is lost or quarantined, then takes "
            "its ranks; it ends with status ok when the run finishes without it.",
        ),
    ] = False,
    restart: Annotated[
        str,
        typer.Option(
            help="What a rank's fault restarts: full (every rank process spawned again) or in-process "
            "(the survivors stay in their processes; the training script calls "
            "trainguard.producers.training.inprocess.run(main)); with --nnodes MIN<MAX: elastic."
        ),
    ] = "full",
    warm_spares: Annotated[
        int,
        typer.Option(
            help="In-process restart: idle processes kept with torch and the script's modules imported, "
            "each ready to take a failed rank (implies --restart in-process)."
        ),
    ] = 0,
    preload: Preload = DEFAULT_PRELOAD,
    min_nproc: Annotated[
        int | None,
        typer.Option(
            help="Elastic training on one host (docs/elastic.md): when a rank is lost and no warm spare "
            "is ready, the survivors go on in a world of at least this many ranks, the same global "
            "batch, and grow back to --nproc at a checkpoint boundary once a new process is ready "
            "(implies --restart in-process; the script uses ElasticBatches). Default: never smaller."
        ),
    ] = None,
    nodes_per_rack: Annotated[int, typer.Option(help="Nodes per modelled rack.")] = 4,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", "--max_restarts", help="Restarts before giving up (any cause).")
    ] = 3,
    grace_s: Annotated[float, typer.Option(help="After an Abort: seconds the ranks get to exit.")] = 15.0,
    decision_wait_s: Annotated[
        float,
        typer.Option(
            help="After a crash: the longest wait for the processor's decisions (it ends when the "
            "processor says it decided; offline there is none)."
        ),
    ] = 3.0,
    survivors_wait_s: Annotated[
        float, typer.Option(help="Elastic training across hosts: the survivors' wait for the others.")
    ] = 1.0,
    offline: Annotated[
        bool,
        typer.Option(
            envvar="TRAINGUARD_OFFLINE",
            help="No Kafka: no telemetry, no commands (restarts on crashes only).",
        ),
    ] = False,
    self_test: Annotated[
        str,
        typer.Option(
            help="When a spare is self-tested (known answers: GEMM, all-reduce) before it joins: "
            "ahead (idle spares from the start, renewed every --self-test-fresh-s: restarts wait for "
            "nothing), on-demand (once a quarantine picks it: the restart may wait), off."
        ),
    ] = "ahead",
    self_test_fresh_s: Annotated[
        float, typer.Option(help="How long a spare's passed self-test admits it (older: tested again).")
    ] = 1800.0,
    restart_from_scratch: Annotated[
        bool,
        typer.Option(help="When every checkpoint was rejected, start again from step 0 (default: stop)."),
    ] = False,
    archive: LaunchArchive = None,
    lemon_failures: LemonFailures = 3,
    lemon_days: LemonDays = 30.0,
    bootstrap: Bootstrap = None,
    topic_prefix: Prefix = "",
) -> None:
    """Start and supervise the rank processes of COMMAND: restarts from the newest validated
    checkpoint, executes Abort/QuarantineNode/EvictRank/Rollback/ResumeFrom, records the restart
    phases in DIR/.trainguard/restarts.jsonl. One host: --nproc ranks here. Across hosts: one
    agent per host with torchrun's flags (--nnodes, --nproc-per-node, --rdzv-*; its files in
    DIR/.trainguard/hosts/NODE; docs/multihost.md). Exit 0 ok, 1 failed, 130 stopped, 75 paused
    (a PauseRun: the run fails at one step on every node; fix the data or code, then relaunch)."""
    if nnodes or rdzv_endpoint:  # one agent per host (docs/multihost.md)
        elastic = (restart == "in-process" or warm_spares > 0) and len(set(nnodes.split(":"))) == 2  # MIN<MAX
        _host_agent(state_dir, checkpoint_dir, node_name, run_id or rdzv_id, elastic)
        if min_nproc is not None:
            fail("--min-nproc is for one host; across hosts the range is --nnodes MIN:MAX")
    if self_test not in ("on-demand", "ahead", "off"):
        console.print(f"[red]--self-test must be on-demand, ahead or off (got {self_test!r})")
        raise typer.Exit(2)
    if warm_spares or min_nproc is not None:
        restart = "in-process"
    if min_nproc is not None and not 1 <= min_nproc <= nproc:
        console.print(f"[red]--min-nproc must be between 1 and --nproc {nproc} (got {min_nproc})")
        raise typer.Exit(2)
    if restart not in ("full", "in-process") or warm_spares < 0:
        console.print(f"[red]--restart must be full or in-process (got {restart!r}); --warm-spares >= 0")
        raise typer.Exit(2)
    from ..producers.launcher.import_env import importing_as_ranks

    across_hosts = bool(nnodes or rdzv_endpoint)
    # torch imported as the ranks import it (their OMP_NUM_THREADS), so that the fork
    # server can be this process's own fork, with torch already in it (fork_server.prefork)
    with importing_as_ranks(nproc_per_node if across_hosts else nproc or nproc_per_node):
        from ..home import trainguard_home
        from ..producers.chaos import FAULT_ENV
        from ..producers.launcher.config import LauncherConfig, default_run_id, rank_program
        from ..producers.launcher.fork_server import prefork
        from ..producers.launcher.journal import ENV_RUN_DIR
        from ..producers.launcher.launcher import Launcher
        from ..producers.launcher.rank_output import parse_std
        from ..producers.launcher.rendezvous import RendezvousSpec, parse_conf, parse_nnodes
        from ..producers.launcher.wiring import install_signal_handlers, make_actuator
        from ..producers.rank.agent import MemorySink

    run_id = run_id or rdzv_id
    if not run_id and across_hosts:
        fail("across hosts, --run-id (or torchrun's --rdzv-id) is required: every host's agent names one run")
    if not checkpoint_dir and across_hosts:
        fail(
            "across hosts, --checkpoint-dir is required: a directory every host mounts, or an object "
            "store's URL (each host's ranks resume from the same checkpoints)"
        )
    default_id = not run_id
    run_id = run_id or default_run_id(command, Path.cwd())
    for flag, value in (("--tee", tee), ("--redirects", redirects)):
        try:
            parse_std(value)
        except ValueError:
            fail(f"{flag} must be 0-3 (none, stdout, stderr, both) or per local rank: 0:3,1:2, not {value!r}")
    rendezvous = None
    try:
        if across_hosts:  # one agent per host (docs/multihost.md)
            low, high = parse_nnodes(nnodes or "1")
            if not rdzv_endpoint or nproc_per_node < 1:
                raise ValueError(
                    "across hosts, --rdzv-endpoint HOST:PORT and --nproc-per-node N are required"
                )
            rendezvous = RendezvousSpec(
                rdzv_endpoint,
                rdzv_id or run_id,
                low,
                high,
                rdzv_backend,
                parse_conf(rdzv_conf),
                local_addr or None,
            )
            ranks_per_node, nproc = nproc_per_node, high * nproc_per_node
        else:
            if spare:
                raise ValueError("--spare is for an agent across hosts (with --nnodes and --rdzv-endpoint)")
            nproc = nproc or nproc_per_node
            if nproc < 1:
                raise ValueError("--nproc (or --nproc-per-node) is required")
    except ValueError as exc:
        console.print(f"[red]{exc}", markup=False)
        raise typer.Exit(2) from None
    default_dir = trainguard_home().resolve() / "runs" / run_id
    if checkpoint_dir is None:  # one host: its launcher files beside them, not inside
        state_dir = state_dir or default_dir
    location = checkpoint_dir_location(checkpoint_dir or str(default_dir / "checkpoints"))
    if isinstance(location, str) and rendezvous is not None and state_dir is None:
        fail(
            f"--checkpoint-dir {location} is an object store: across hosts, --state-dir must name a "
            "directory every host mounts (the hosts' beats, journals and quarantine list live there)"
        )

    config = LauncherConfig(
        command=rank_program(command),
        nproc=nproc,
        ranks_per_node=ranks_per_node,
        run_id=run_id,
        rendezvous=rendezvous,
        node_name=node_name,
        spare=spare,
        restart=restart,  # type: ignore[arg-type]  # checked above
        warm_spares=warm_spares,
        preload=preload_modules(preload),
        min_nproc=min_nproc,
        checkpoint_dir=location,
        state_dir=state_dir.resolve() if state_dir is not None else None,
        spares=spares,
        nodes_per_rack=nodes_per_rack,
        max_restarts=max_restarts,
        grace_s=grace_s,
        decision_wait_s=0.0 if offline else decision_wait_s,  # offline no processor decides
        survivors_wait_s=survivors_wait_s,
        self_test_spares=self_test,  # type: ignore[arg-type]  # checked above
        self_test_fresh_s=self_test_fresh_s,
        restart_from_scratch=restart_from_scratch,
        **lemon_settings(archive, lemon_failures, lemon_days),
        bootstrap="" if offline else resolve_bootstrap(bootstrap),
        topic_prefix=topic_prefix,
        secret_file=os.environ.get("TRAINGUARD_SECRET_FILE", ""),
        log_dir=log_dir.resolve() if log_dir is not None else None,
        tee=tee,
        redirects=redirects,
        # Test hook (kill points of producers/launcher/config.py); not passed on to the ranks.
        fault=os.environ.pop(FAULT_ENV, ""),
    )
    # Said once, before the ranks' output: what the run chose for itself, and where to look.
    if default_id:
        console.print(
            f"run id {run_id} (the default, from the command and the working directory: the same "
            "command here resumes this run; --run-id names another)",
            markup=False,
            soft_wrap=True,
        )
    if checkpoint_dir is None:
        console.print(
            f"checkpoints in {location} (the default: --checkpoint-dir to choose; a run across "
            "hosts needs storage every host mounts)",
            markup=False,
            soft_wrap=True,
        )
    logs = f"rank logs in {config.log_root}/attempt-N/rank-R/ (stdout.log, stderr.log)"
    console.print(logs, markup=False, soft_wrap=True)
    # Before the launcher's first thread (its shipper's, its actuator's): a fork is safe now.
    prefork(config.preload, config.command, {**os.environ, ENV_RUN_DIR: str(config.resolved_run_dir)})
    if offline:
        launcher = Launcher(config, MemorySink())
        install_signal_handlers(launcher)
        result = launcher.run()
    else:
        from ..kafka.topics import topic_names
        from ..producers.rank.shipper import ShipperConfig, TelemetryShipper

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
        console.print(f"interruption {rec.interruption}: {restart_line(rec)}", markup=False, soft_wrap=True)
    console.print(
        f"{result.status}: {result.reason} ({result.attempts} attempts)", markup=False, soft_wrap=True
    )
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

    from ..producers.launcher.node_selftest import default_nproc, run_node_self_test

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
