"""Where trainguard keeps its local files: `$TRAINGUARD_HOME`, else `<cwd>/.trainguard`."""

from __future__ import annotations

import os
from pathlib import Path


def trainguard_home() -> Path:
    home = os.environ.get("TRAINGUARD_HOME")
    return Path(home) if home else Path.cwd() / ".trainguard"


def broker_data_dir() -> Path:
    """The local broker's data directory (`trainguard broker start`): its status file,
    and in secured mode its credentials/ (one password file per principal, mode 0600)."""
    return trainguard_home() / "broker"


def broker_credentials_dir(data_dir: Path | None = None) -> Path:
    """A secured broker's password files, one per principal (mode 0600): `broker start
    --secure` writes them here, `broker grant-run` reads the admin's and adds the runs'."""
    return (data_dir or broker_data_dir()) / "credentials"
