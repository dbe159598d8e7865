"""trainguard/devtools: development and evaluation tooling, apart from the product.

The local Kafka broker from Maven Central jars (`local_broker`), a whole local pipeline
for demos and benchmarks (`stack`), the demo, the chaos soak (`soak*`), the live
scenario evaluation (`evaluate_live`) and their commands (`cli`, loaded into `trainguard`
through the `trainguard.cli` entry point). Tooling may import the product; the product
never imports tooling (tests/test_architecture.py).
"""
