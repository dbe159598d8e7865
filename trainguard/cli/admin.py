"""Commands that administer the broker and the run's configuration: per-run principals
and ACLs on a secured broker, the topics, the policy file, the signing secret."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .. import __version__
from ..home import broker_credentials_dir
from .app import (
    Bootstrap,
    DataDir,
    Prefix,
    RunId,
    app,
    broker_app,
    console,
    policy_app,
    principal_env,
    reach_broker,
    secret_app,
)

if TYPE_CHECKING:
    from ..kafka.security import KafkaCredentials


@app.command()
def version() -> None:
    """Print the version."""
    print(__version__)


def _admin_access(data_dir: Path | None) -> tuple[KafkaCredentials, Path]:
    """The admin principal (TRAINGUARD_KAFKA_* if set, else the `admin` password file a
    secured broker wrote) and the directory where run passwords are written (the broker's
    credentials/, as `trainguard broker start --secure` lays it out)."""
    from ..kafka.acl import ADMIN_USER
    from ..kafka.security import CredentialsError, KafkaCredentials

    credentials_dir = broker_credentials_dir(data_dir)
    try:
        admin = KafkaCredentials.from_env()
        if admin is None and (credentials_dir / ADMIN_USER).exists():
            admin = KafkaCredentials.from_file(ADMIN_USER, credentials_dir / ADMIN_USER)
    except CredentialsError as exc:
        console.print(f"[red]{exc}")
        raise typer.Exit(2) from exc
    if admin is None:
        console.print("[red]not a secured broker: start it with `trainguard broker start --secure`")
        raise typer.Exit(2)
    return admin, credentials_dir


@broker_app.command("grant-run")
def broker_grant_run(
    run_id: RunId, bootstrap: Bootstrap = None, topic_prefix: Prefix = "", data_dir: DataDir = None
) -> None:
    """Secured broker: create a run's rank principal (password file 0600), its command topic
    and its ACLs (write telemetry and acks, read only its own commands). Before the launch."""
    from ..kafka.acl import provision_run

    admin, credentials_dir = _admin_access(data_dir)
    user, path = provision_run(reach_broker(bootstrap), admin, credentials_dir, run_id, topic_prefix)
    print(principal_env(user, path))


@broker_app.command("revoke-run")
def broker_revoke_run(
    run_id: RunId, bootstrap: Bootstrap = None, topic_prefix: Prefix = "", data_dir: DataDir = None
) -> None:
    """Secured broker: remove a run's principal, password file, ACLs and command topic."""
    from ..kafka.acl import revoke_run

    admin, credentials_dir = _admin_access(data_dir)
    revoke_run(reach_broker(bootstrap), admin, credentials_dir, run_id, topic_prefix)
    console.print(f"revoked {run_id}")


@broker_app.command("topics")
def broker_topics(bootstrap: Bootstrap = None, topic_prefix: Prefix = "") -> None:
    """Create trainguard's topics (idempotent) with their documented settings."""
    from ..kafka.topics import ensure_topics

    for name in ensure_topics(reach_broker(bootstrap), prefix=topic_prefix):
        print(name)


@policy_app.command("check")
def policy_check(path: Annotated[Path, typer.Argument(help="Policy YAML file.")]) -> None:
    """Validate a policy file: every invalid field is named with the reason (exit 1)."""
    from ..processors.core.policy import PolicyError, load_policy

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
    from ..processors.core.policy import PolicyError, dump_policy, load_policy

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
    from ..schemas.auth import write_secret_file

    print(write_secret_file(path))


@app.command()
def contract(
    write: Annotated[
        Path | None, typer.Option(help="Write the contract files into this folder (docs/contract).")
    ] = None,
    check: Annotated[
        Path | None, typer.Option(help="Exit 1 naming each file of this folder that differs from the code.")
    ] = None,
) -> None:
    """The streams' public contract, generated from the models: an AsyncAPI 3.0 document of
    the topics, keys and headers, and a JSON Schema per record kind and version."""
    from ..kafka.contract import rendered

    files = rendered()
    if write is None and check is None:
        typer.echo(files["asyncapi.json"], nl=False)
        return
    if write is not None:
        for name, text in files.items():
            (write / name).parent.mkdir(parents=True, exist_ok=True)
            (write / name).write_text(text)
        console.print(f"wrote {len(files)} files to {write}", soft_wrap=True)
    if check is not None:
        stale = [
            name
            for name, text in files.items()
            if not (check / name).is_file() or (check / name).read_text() != text
        ]
        extra = sorted(
            str(p.relative_to(check)) for p in check.rglob("*.json") if str(p.relative_to(check)) not in files
        )
        for name in stale:
            console.print(f"{check / name}: differs from the models", markup=False, soft_wrap=True)
        for name in extra:
            console.print(f"{check / name}: no such record kind any more", markup=False, soft_wrap=True)
        if stale or extra:
            console.print(f"regenerate: trainguard contract --write {check}", markup=False, soft_wrap=True)
            raise typer.Exit(1)
        console.print(f"{check}: {len(files)} files match the models", soft_wrap=True)
