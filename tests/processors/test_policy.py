"""The policy file: one typed, versioned document; every threshold has the seed's
default; a bad file is rejected with each field and the reason, never half-applied."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.devtools.stack import builtin_policy
from trainguard.processors.core.policy import (
    POLICY_VERSION,
    CorePolicy,
    PolicyError,
    dump_policy,
    load_policy,
    parse_policy,
)


@pytest.mark.parametrize("name", ["demo", "evaluate"])
def test_the_shipped_policies_load_and_declare_their_version(name: str) -> None:
    path = builtin_policy(name)
    assert yaml.safe_load(path.read_text())["version"] == POLICY_VERSION
    assert load_policy(str(path)).version == POLICY_VERSION


def test_defaults_are_the_seeds_and_the_dump_round_trips() -> None:
    policy = CorePolicy()
    assert policy.hang.p99_multiplier == 3 and policy.straggler.sigma == 3
    assert policy.sdc.grad_spike_multiplier == 10 and policy.paging.rate_multiple == 5
    assert parse_policy(yaml.safe_load(dump_policy(policy))) == policy


def test_every_bad_field_is_named_with_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nhang:\n  floor_s: -1\n  flor_s: 3\npaging:\n  rate_multiple: 0.5\n")
    with pytest.raises(PolicyError) as caught:
        load_policy(str(path))
    problems = caught.value.problems
    assert any(p.startswith("hang.floor_s: Input should be greater than 0") for p in problems)
    assert any(p.startswith("hang.flor_s: Extra inputs are not permitted") for p in problems)  # a typo
    assert any(p.startswith("paging.rate_multiple: Input should be greater than 1") for p in problems)
    assert str(path) in str(caught.value)


def test_incoherent_values_and_other_versions_are_rejected() -> None:
    with pytest.raises(PolicyError, match="min_s .* must not exceed max_s"):
        parse_policy({"interval": {"min_s": 7200, "max_s": 3600}})
    with pytest.raises(PolicyError, match="version: Value error, policy format 2"):
        parse_policy({"version": 2})
    with pytest.raises(PolicyError, match="expected a mapping"):
        parse_policy(["hang"])


def test_a_file_that_is_not_yaml_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("hang: [unclosed\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(str(path))
