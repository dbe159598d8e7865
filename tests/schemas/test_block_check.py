"""The block checks (schemas/block_check.py) give the same verdict compiled as in Python,
on blocks of every kind a JSON reader can hand them (and a few it cannot): the compiled
build runs when scripts/setup made one, the Python source is loaded beside it here."""

from __future__ import annotations

import importlib.util
import random
from types import ModuleType
from typing import Any

from trainguard.compiled_build import pure_requested
from trainguard.schemas import block_check
from trainguard.schemas.compiled import BUILD

CASES: list[Any] = [
    "ok", "", "x" * 200, "x" * 201, 0, 1, -1, -2, 2**63 - 1, 2**63, 2**64, True, False,
    0.0, -0.0, 1.5, -1e-300, 1e308, float("inf"), float("nan"), None, [1], {"a": 1},
]  # fmt: skip


def python_source(name: str = "block_check") -> ModuleType:
    """The module's Python source, loaded beside whatever build the package uses."""
    spec = importlib.util.spec_from_file_location(
        f"trainguard.schemas.{name}_python", BUILD.source / f"{name}.py"
    )  # (named in the package: its relative import of base resolves)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common_block(rows: int, rng: random.Random) -> dict[str, Any]:
    return {
        "schema": "step_timings/1", "run_id": "r", "node": "n",
        "event_id": [f"e{i}" for i in range(rows)], "attempt": [0] * rows,
        "rank": list(range(rows)), "step": [rng.randrange(-1, 10**6)] * rows,
        "ts": [rng.uniform(0, 2e9) for _ in range(rows)], "compute_s": [rng.random() for _ in range(rows)],
        "total_s": [1.0 + rng.random() for _ in range(rows)],
    }  # fmt: skip


def test_compiled_and_python_checks_agree_on_every_kind_of_value() -> None:
    python, rng = python_source(), random.Random(20)
    assert python.__file__ is not None and python.__file__.endswith(".py")
    # A current build is the one in use here (else this compares the Python with itself).
    assert block_check.__file__.endswith(".py") == (pure_requested() or not BUILD.is_current())
    blocks = [common_block(rows, rng) for rows in (0, 1, 8, 64)]
    for _ in range(3000):  # a common block with one value replaced, or a key added or dropped
        block = common_block(rng.randrange(1, 6), rng)
        change = rng.random()
        if change < 0.85:
            column = rng.choice(block_check.COLUMNS)
            block[column][rng.randrange(len(block[column]))] = rng.choice(CASES)
        elif change < 0.9:
            block[rng.choice(["colour", "run_id", "node"])] = rng.choice(CASES)
        elif change < 0.95:
            del block[rng.choice([*block_check.COLUMNS, "run_id"])]
        else:
            block[rng.choice(block_check.COLUMNS)].append(1.0)
        blocks.append(block)
    verdicts = set()
    for block in blocks:
        mine, theirs = block_check.block_columns(block), python.block_columns(block)
        assert mine == theirs, block
        if not isinstance(mine, str):
            verdicts.add(block_check.common_rows(mine))
            assert block_check.common_rows(mine) == python.common_rows(theirs), block
        else:
            verdicts.add(mine.split(":")[1])
    assert len(verdicts) >= 6  # common, uncommon, and each shape error
