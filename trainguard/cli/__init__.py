"""`trainguard`: one command line for every part of the pipeline.

This is the one place commands are registered: each module below adds its commands to
`app` when imported (app.py holds the app, its groups and the shared options). The
development tooling (local broker, demo, soak, the scenario evaluation) adds its own
through the `trainguard.cli` entry point group (pyproject.toml), so the product never
imports it. Heavy parts (faust, duckdb, torch) are imported inside the commands, so
`--help` is instant and one missing part does not break the others.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from . import admin, ending, pager, pipeline, replay, reports  # noqa: F401  (each registers its commands)
from .app import app

ENTRY_POINT_GROUP = "trainguard.cli"


def load_plugins() -> list[str]:
    """Let every installed `trainguard.cli` entry point register its commands on `app`."""
    loaded = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()(app)
        loaded.append(entry.name)
    return loaded


PLUGINS = load_plugins()


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ending.run_to_end(app)  # torch imported: its teardown, ~0.9 CPU-s, shows nobody anything


__all__ = ["PLUGINS", "app", "main"]
