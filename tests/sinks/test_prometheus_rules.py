"""The shipped Prometheus rules: valid (`promtool check rules`), behaving as their unit
tests say (`promtool test rules`), and paging on every rule the metrics count.

promtool comes from the Debian package `prometheus` (scripts/setup installs it); without
it these tests fail rather than skip, so that CI cannot pass without checking the rules."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.processors.metrics import OTHER_RULE, PAGE_RULES

RULES_DIR = Path(__file__).resolve().parents[2] / "sinks" / "prometheus"
RULES = RULES_DIR / "trainguard.rules.yml"
RULES_TEST = RULES_DIR / "trainguard.rules.test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(
            "promtool is not on PATH: install the Debian package `prometheus` "
            "(apt-get install --no-install-recommends prometheus; scripts/setup does it as root)"
        )
    return subprocess.run(
        [exe, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120, check=False
    )


def assert_ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stdout}\n{done.stderr}"


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules_file() -> None:
    assert_ok(promtool("check", "rules", RULES.name))


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    assert_ok(promtool("test", "rules", RULES_TEST.name))


def test_every_page_rule_the_metrics_count_has_exactly_one_alert() -> None:
    paged = [re.findall(r'trainguard_pages_total\{rule="(\w+)"\}', a["expr"]) for a in alerts()]
    rules = [found[0] for found in paged if found]
    assert sorted(rules) == sorted((*PAGE_RULES, OTHER_RULE))
    assert all(len(set(found)) <= 1 for found in paged)  # one alert, one rule


def test_every_alert_has_a_severity_a_summary_and_a_description() -> None:
    for alert in alerts():
        assert alert["labels"]["severity"] == "page", alert["alert"]
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]
        if "trainguard_pages_total" in alert["expr"]:
            assert all("$labels.run_id" in alert["annotations"][k] for k in ("summary", "description"))
