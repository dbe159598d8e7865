"""harness/devtools: development and evaluation tooling, apart from the product.

The local Kafka broker from Maven Central jars (`local_broker`), a whole local pipeline
for demos and benchmarks (`stack`), the demo, the chaos soak (`soak*`), the live
scenario evaluation (`evaluate_live`), the mypyc build (`compile_core`), the image pins
(`pin_images`) and their commands (`cli`, loaded into `trainguard` through the harness
distribution's `trainguard.cli` entry point, harness/pyproject.toml). Tooling may import
the product; the product never imports tooling (tests/test_architecture.py), and its
wheel carries none of it (tests/test_wheel.py).
"""
