"""The metrics an operator alerts on: every labelled counter exists at 0 from the start
(rate() over a series born at 1 misses the first event), the process families are there,
and the README names every family the processor and the archive writer export and every
alert the rules define, with the scrape jobs the rules expect."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from trainguard.kafka.lag_metrics import ConsumerLagCollector
from trainguard.processors.metrics import ProcessorMetrics
from trainguard.sinks.archive_metrics import ArchiveMetrics

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RULES = ROOT / "sinks" / "prometheus" / "trainguard.rules.yml"
#: Series that need a run to exist (their per-run series start at 0 with the run).
PER_RUN = {"trainguard_pages"}


def _families(registry: CollectorRegistry) -> dict[str, list]:
    return {m.name: m.samples for m in registry.collect()}


def _lag_families() -> dict[str, list]:
    collector = ConsumerLagCollector("127.0.0.1:1", "g", ["t"], "processor")  # never started
    try:
        return {m.name: m.samples for m in collector.collect()}
    finally:
        collector.close()


def test_every_labelled_counter_starts_at_zero() -> None:
    for registry in (ProcessorMetrics().registry, ArchiveMetrics().registry):
        for metric in registry.collect():
            if (
                metric.type != "counter"
                or metric.name in PER_RUN
                or not metric.name.startswith("trainguard_")
            ):
                continue
            totals = [s for s in metric.samples if s.name.endswith("_total")]
            assert totals, f"{metric.name} has no series before its first increment"
            assert all(s.value == 0 for s in totals), metric.name


def test_the_process_and_runtime_families_are_exported() -> None:
    for registry in (ProcessorMetrics().registry, ArchiveMetrics().registry):
        names = set(_families(registry))
        assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= names | {
            s.name for m in registry.collect() for s in m.samples
        }


def test_the_readme_names_every_exported_family_and_every_alert() -> None:
    families = {
        *_families(ProcessorMetrics().registry),
        *_families(ArchiveMetrics().registry),
        *_lag_families(),
    }
    ours = sorted(f for f in families if f.startswith("trainguard_"))
    missing = [f for f in ours if not re.search(rf"`{f}(_total)?[{{`]", README)]
    assert not missing, f"README's metrics table lacks {missing}"
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [r["alert"] for g in groups for r in g["rules"] if "alert" in r]
    assert [a for a in alerts if f"`{a}`" not in README] == []
    for job in re.findall(r'job="([\w-]+)"', RULES.read_text()):
        assert f"`{job}`" in README, job
