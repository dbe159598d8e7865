"""The end-to-end tests' slow variants, which the suite leaves out to stay well under 30
minutes on 2 cores (tests/variants.py): the broker stopped with SIGTERM for 30 s under
load, a processor worker recovering from a snapshot behind its commit, a whole node of 4
ranks restoring from its peers, the chaos soak's 75 s of three runs, and two workers
sharing six runs with one SIGKILLed and restarted, a host lost and then a hang with no
spare left, two hosts checkpointing to a bucket, the hand-written loop's straggler (whole
modules), the README example's SIGKILL and the in-process restart across hosts (one test
each), and the columnar fold
against the per-event fold on every scenario of the labelled library (up to 16,384 ranks;
the longest cases: 1-15 minutes of a core each).

    .venv/bin/python bench/bench_slow_variants.py            # every test, slow cases included
    .venv/bin/python bench/bench_slow_variants.py -k sigterm  # extra arguments go to pytest

Runs pytest on the modules that have slow variants with TRAINGUARD_SLOW_VARIANTS=1, on the
broker named by TRAINGUARD_BOOTSTRAP or one the session starts; exit status is pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "tests/kafka/test_broker_outage.py",
    "tests/processors/test_processor_kill_broker.py",
    "tests/producers/checkpoint/test_peer_replica.py",
    "tests/harness/devtools/test_soak_broker.py",
    "tests/processors/test_rebalance_broker.py",  # whole modules (tests/variants.py: SLOW_MODULES)
    "tests/producers/launcher/test_multihost_hang_broker.py",
    "tests/producers/launcher/test_multihost_bucket.py",
    "tests/producers/test_supervised_straggler.py",
    "tests/producers/test_supervised_faults.py",  # the README example's SIGKILL (one test)
    "tests/producers/launcher/test_multihost_broker.py",  # in-process across hosts (one test)
    "tests/schemas/test_columnar.py",
]


def main(argv: list[str]) -> int:
    env = {**os.environ, "TRAINGUARD_SLOW_VARIANTS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "--durations=0", *MODULES, *argv]
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
