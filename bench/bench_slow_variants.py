"""The scale cases the suite leaves out (tests/variants.py): the columnar fold against the
per-event fold on every scenario of the labelled library (up to 16,384 ranks and 2.2 M
events; the longest: 1-15 minutes of a core each), and capacity's shrink-or-wait on the
16,384-rank elastic scenario. Every end-to-end test is in the suite.

    .venv/bin/python bench/bench_slow_variants.py                     # every case
    .venv/bin/python bench/bench_slow_variants.py -k 16k -n 2 --dist loadgroup  # extra arguments go to pytest

Runs pytest on the modules that have slow variants with TRAINGUARD_SLOW_VARIANTS=1; exit
status is pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests/schemas/test_columnar.py", "tests/harness/scoring/test_capacity.py"]


def main(argv: list[str]) -> int:
    env = {**os.environ, "TRAINGUARD_SLOW_VARIANTS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "--durations=0", *MODULES, *argv]
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
