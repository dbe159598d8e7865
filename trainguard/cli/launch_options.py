"""Parts of `trainguard launch` kept apart from pipeline.py (which holds the command): the
lemon-node options (issue 46; docs/prediction.md, "Lemon nodes"), the fork server's
(--preload), the checkpoint location's check and the line the command prints for each
interruption at the end."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..producers.launcher.config import PRELOAD
from .app import DEFAULT_ARCHIVE, fail

if TYPE_CHECKING:
    from ..producers.launcher.records import RestartPhases

#: The archive's batch log: a directory is an archive when it has one (sinks/lake.py).
_BATCHES = "_batches"

LaunchArchive = Annotated[
    str | None,
    typer.Option(
        "--archive",
        envvar="TRAINGUARD_ARCHIVE",
        help="Lemon nodes: the archive whose failure history across runs keeps them out of this "
        f"launch (a directory or an object-store URI). Default: {DEFAULT_ARCHIVE}, where `trainguard "
        "archive` writes, when an archive is there (none: no node is kept out, nothing is said).",
    ),
]
DEFAULT_PRELOAD = ",".join(PRELOAD)
Preload = Annotated[
    str,
    typer.Option(
        "--preload",
        envvar="TRAINGUARD_PRELOAD",
        help="For a `python script.py` or `python -m module` command: modules a fork server imports "
        "once, each rank then forked from it instead of a new interpreter importing them again "
        "(comma-separated; default: torch and trainguard's rank side). none: a new process per rank, as "
        "torchrun starts them. A forked rank shows its own command line and environment in ps and /proc "
        "(where the kernel cannot let it, every rank is a new process, with a warning).",
    ),
]


def preload_modules(value: str) -> tuple[str, ...]:
    """--preload's comma-separated modules ('' or none: none)."""
    return tuple(m.strip() for m in value.split(",") if m.strip() and m.strip().lower() != "none")


LemonFailures = Annotated[
    int,
    typer.Option(
        "--lemon-failures",
        help="A node with this many failures in the archive within --lemon-days (a crash, hang or SDC "
        "it caused, a failed self-test: once per run attempt; a quarantine released or a planned stop "
        "is none) is kept out of the launch with the reason, and paged (0: never).",
    ),
]
LemonDays = Annotated[
    float, typer.Option("--lemon-days", help="The days of history --lemon-failures counts.")
]


def lemon_settings(archive: str | None, failures: int, days: float) -> dict[str, Any]:
    """LauncherConfig's archive, lemon_failures and lemon_days. A named archive must be one;
    the default is read only when an archive is there; --lemon-failures 0 reads none."""
    if failures < 0 or not days > 0:
        fail(f"--lemon-failures must be 0 or more and --lemon-days above 0 (got {failures}, {days:g})")
    root = ""
    if failures and archive:
        root = archive if "://" in archive else str(Path(archive).resolve())
        if "://" not in archive and not (Path(root) / _BATCHES).is_dir():
            fail(
                f"--archive {archive}: no archive there (no {_BATCHES} table); `trainguard archive --db "
                f"{archive}` writes one, or leave --archive (and TRAINGUARD_ARCHIVE) out"
            )
    elif failures and (Path(DEFAULT_ARCHIVE) / _BATCHES).is_dir():
        root = str(Path(DEFAULT_ARCHIVE).resolve())
    return {"archive": root, "lemon_failures": failures, "lemon_days": days}


def restart_line(rec: RestartPhases) -> str:
    """One interruption as the console says it: what happened, where the next attempt
    resumed from (said loudly when from scratch: everything trained was lost), R."""
    if rec.to_attempt is None:
        return f"{rec.cause} ({rec.detail}) in attempt {rec.from_attempt}; no restart followed"
    if rec.resumed_from_step >= 0:
        resumed = f"resumed from step {rec.resumed_from_step}"
    else:
        resumed = "RESTARTED FROM SCRATCH (no validated checkpoint: every step trained so far is lost)"
    restart = f"{rec.restart_s:.2f}" if rec.restart_s is not None else "?"
    attempts = f"attempt {rec.from_attempt}->{rec.to_attempt}"
    return f"{rec.cause} ({rec.detail}) {attempts}, {resumed}, restart {restart} s"


def checkpoint_dir_location(given: str) -> Path | str:
    """A local or shared-filesystem checkpoint directory (absolute), or an fsspec URL whose
    package is installed here; anything else is refused in one line."""
    from ..common.checkpoint_location import LocationError, checkpoint_location, is_url

    try:
        location = checkpoint_location(given)
    except LocationError as exc:
        fail(f"--checkpoint-dir {exc}")
    return location if is_url(location) else Path(location).resolve()
