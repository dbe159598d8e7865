"""The evaluation harness that the tests and the benchmarks share (issue 48): synthetic
telemetry streams for the policy core (`streams`, `straggler_streams`, `group_streams`,
`slowdown_streams`), a Kafka feeder (`feed`) and host agents on one machine for the
multi-host runs (`hosts`).

Not part of the installed product: pyproject's package list leaves it out of the wheel,
the product never imports it (tests/test_architecture.py), and it imports nothing from
`tests/`. The tests import it through pytest's ``pythonpath`` (pyproject.toml); a bench
script puts the repository root on ``sys.path`` first.
"""
