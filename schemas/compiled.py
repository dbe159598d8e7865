"""The schemas' hot modules compiled by mypyc (issue 20; trainguard/compiled_build.py:
when a build is used). Only the checks of a batch's common parts (a block's, the rows',
the header's): the models' modules define pydantic classes, which mypyc cannot compile."""

from __future__ import annotations

from pathlib import Path

from ..compiled_build import CompiledBuild

MODULES = ("block_check", "event_check")

BUILD = CompiledBuild("trainguard.schemas", Path(__file__).parent, MODULES)
