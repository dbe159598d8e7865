"""The schemas' hot modules compiled by mypyc (issue 20; trainguard/compiled_build.py:
when a build is used). Only the block checks: the models' modules define pydantic
classes, which mypyc cannot compile."""

from __future__ import annotations

from pathlib import Path

from ..compiled_build import CompiledBuild

MODULES = ("block_check",)

BUILD = CompiledBuild("trainguard.schemas", Path(__file__).parent, MODULES)
