"""The `trainguard` command line's shared parts: the app and its groups, the options
every command shares, and how a command finds the broker and the secret. Commands are
registered from one place, trainguard/cli/__init__.py.

Imports of heavy parts (faust, duckdb) happen inside the subcommands, so `--help`
is instant and one missing part does not break the others.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

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
REPORT_SUFFIXES = (".txt", ".md", ".html")


def _report_file(path: Path | None) -> Path | None:
    if path is not None and path.suffix not in REPORT_SUFFIXES:
        raise typer.BadParameter(
            f"{path}: reports are written as {', '.join(REPORT_SUFFIXES)}, not {path.suffix or 'no suffix'}"
        )
    return path


ReportFile = Annotated[
    Path | None,
    typer.Option(
        "--output", callback=_report_file, help="Also write the report to this file (.txt, .md, or .html)."
    ),
]
#: Where the archive writer writes and the reports read (a directory, or an object-store URI).
DEFAULT_ARCHIVE = ".trainguard/archive"
ArchiveRoot = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="TRAINGUARD_ARCHIVE",
        help="Archive root: a directory, or an object-store URI (s3://bucket/path).",
    ),
]
ConnectTimeout = Annotated[
    float,
    typer.Option(
        "--connect-timeout",
        envvar="TRAINGUARD_CONNECT_TIMEOUT",
        help="Seconds to wait for the broker at start before giving up with an error.",
    ),
]


#: Where a command finds the broker when --bootstrap and TRAINGUARD_BOOTSTRAP are both
#: unset: functions returning a bootstrap address or None, tried in order. The
#: development tooling adds the local broker's (harness/devtools/cli.py); the product
#: knows of no broker on its own.
bootstrap_fallbacks: list[Callable[[], str | None]] = []


def resolve_bootstrap(bootstrap: str | None) -> str:
    if bootstrap:
        return bootstrap
    for fallback in bootstrap_fallbacks:
        found = fallback()
        if found:
            return found
    console.print(
        "[red]No broker: pass --bootstrap, set TRAINGUARD_BOOTSTRAP, or run `trainguard broker start`."
    )
    raise typer.Exit(2)


def fail(message: str, code: int = 2) -> NoReturn:
    """One red line on stderr, never folded (a log reader greps it), then exit `code`."""
    console.print(Text(message, style="red"), soft_wrap=True)
    raise typer.Exit(code)


def reach_broker(bootstrap: str | None, timeout_s: float | None = None) -> str:
    """The resolved bootstrap, once the broker there answers; else one line naming it and
    exit 2 (librdkafka alone would retry, and log each try, forever)."""
    from ..kafka.errors import BrokerError
    from ..kafka.probe import DEFAULT_PROBE_S, probe_broker

    resolved = resolve_bootstrap(bootstrap)
    try:
        probe_broker(resolved, DEFAULT_PROBE_S if timeout_s is None else timeout_s)
    except BrokerError as exc:
        fail(str(exc))
    return resolved


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def master_secret() -> bytes:
    from ..schemas.auth import SecretError, load_master_secret

    try:
        return load_master_secret()
    except SecretError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc


def principal_env(user: str, password_file: Path) -> str:
    from ..kafka.security import PASSWORD_FILE_ENV, USER_ENV

    return f"export {USER_ENV}={user} {PASSWORD_FILE_ENV}={password_file}"


RunId = Annotated[str, typer.Argument(help="The run id (as in `trainguard launch --run-id`).")]
