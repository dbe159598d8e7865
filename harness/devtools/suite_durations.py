"""The suite's groups' durations (tests/durations.json), from a run's JUnit XML.

tests/conftest.py hands the longest test modules to the parallel workers first (longest
processing time first: none is left running alone at the end), and a module's length is
what this file says. Regenerate it after a full run when the suite changes much:

    scripts/test --junitxml=/tmp/suite.xml
    .venv/bin/python -m harness.devtools.suite_durations /tmp/suite.xml > tests/durations.json

Each module's total, and each test of ten seconds or more by node id (a slow variant left
out of a run is taken off its module's total). A module missing from the file counts
`UNKNOWN_S` a test."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

#: What a test of a module without a measurement counts for.
UNKNOWN_S = 1.0


def module_of(classname: str) -> str:
    """JUnit's ``tests.producers.test_x`` (or ``...test_x.Class``) -> ``producers/test_x.py``."""
    parts = classname.split(".")[1:]
    while parts and not parts[-1].startswith("test_"):  # a class inside the module
        parts.pop()
    return "/".join(parts) + ".py"


def durations(junit: Path) -> dict[str, float]:
    """Seconds per module (every test of it) and per test (node id, the cases of ten
    seconds or more)."""
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        seconds = float(case.get("time") or 0.0)
        module = module_of(case.get("classname", ""))
        out[module] += seconds
        if seconds >= 10.0:
            out[f"tests/{module}::{case.get('name')}"] = seconds
    return {key: round(value, 1) for key, value in sorted(out.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(durations(Path(argv[0])), sys.stdout, indent=0)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
