"""The development harness that the tests, the benchmarks and the development commands
share (issue 48): synthetic telemetry streams for the policy core (`streams`,
`straggler_streams`, `group_streams`, `slowdown_streams`), a Kafka feeder (`feed`), host
agents on one machine for the multi-host runs (`hosts`), the labelled scenarios' scoring,
harms and oracle (`scoring`), and the development tooling (`devtools`: the local broker,
the local stack, the demo, the chaos soak, whose commands join `trainguard` through this
distribution's entry point).

Not part of the installed product: a distribution of its own (harness/pyproject.toml,
installed editable beside the product by scripts/setup), which the product's wheel does not
carry (tests/test_wheel.py); the product never imports it (tests/test_architecture.py),
and it imports nothing from `tests/`.
"""
