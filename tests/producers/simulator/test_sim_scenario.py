"""Scenario files: the shipped ones load, bad ones fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.producers.simulator import FaultTruth, Scenario, ScenarioError

BASE = {
    "name": "t",
    "world_size": 64,
    "ranks_per_node": 8,
    "nodes_per_rack": 4,
    "step_time_s": 0.2,
    "steps": 100,
}


def test_shipped_demo_has_one_fault_of_each_kind() -> None:
    demo = Scenario.builtin("demo")
    assert demo.world_size == 64
    assert sorted(f.kind for f in demo.faults) == ["crash", "hang", "slow"]
    truth = demo.truth()
    assert truth[0] == FaultTruth("crash", 13, "node-0001", "rack-00", 80)
    assert truth[1] == FaultTruth("hang", 42, "node-0005", "rack-01", 200)
    assert truth[2] == FaultTruth("slow", 5, "node-0000", "rack-00", 30, 330, "thermal")
    # ~1-2 minutes of wall clock at speed 1
    assert 60 <= demo.steps * demo.step_time_s <= 100


def test_shipped_healthy_16k() -> None:
    big = Scenario.builtin("healthy-16k")
    assert (big.world_size, big.step_time_s, big.faults) == (16_384, 2.0, [])
    assert big.node_count == 2048 and len(set(big.racks().values())) == 128


def test_load_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: x\nworld_size: 8\nstep_time_s: 1\nsteps: 5\nfaults:\n  - {kind: crash, rank: 7, at_step: 2}\n"
    )
    scenario = Scenario.load(path)
    assert scenario.faults[0].kind == "crash" and scenario.node_of(7) == "node-0000"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"faults": [{"kind": "crash", "rank": 64, "at_step": 5}]}, "faults.0.rank"),
        ({"faults": [{"kind": "crash", "rank": 1, "at_step": 100}]}, "faults.0: step 100"),
        ({"faults": [{"kind": "explode", "rank": 1, "at_step": 5}]}, "faults.0"),
        ({"faults": [{"kind": "crash", "rank": 1}]}, "faults.0.crash.at_step"),
        ({"faults": [{"kind": "slow", "rank": 1, "node": "node-0001", "factor": 2}]}, "exactly one of rank"),
        ({"faults": [{"kind": "slow", "rank": 1, "from_step": 9, "to_step": 9, "factor": 2}]}, "to_step"),
        ({"faults": [{"kind": "slow", "rack": "rack-99", "factor": 2}]}, "faults.0.rack"),
        ({"faults": [{"kind": "slow", "rank": 1, "factor": 0.5}]}, "faults.0.slow.factor"),
        ({"step_time_s": 0}, "step_time_s"),
        ({"compute_fraction": 1.5}, "compute_fraction"),
        ({"stepz": 3}, "stepz"),
    ],
)
def test_invalid_scenarios_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario.parse({**BASE, **change}, source="bad.yaml")
    assert field in str(info.value)
    assert str(info.value).startswith("bad.yaml: invalid scenario")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nworld_size: 8\nstep_time_s: 1\nsteps: 5\nfaults: [{kind: hang, rank: 8, at_step: 1}]\n"
    )
    with pytest.raises(
        ScenarioError, match=r"(?s)bad\.yaml.*faults\.0\.rank: rank 8 is outside world_size 8"
    ):
        Scenario.load(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        Scenario.load(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="a YAML mapping"):
        Scenario.load(listed)
    with pytest.raises(ScenarioError, match="cannot read"):
        Scenario.load(tmp_path / "missing.yaml")


def test_rack_and_node_faults_resolve_in_truth() -> None:
    scenario = Scenario.parse(
        {
            **BASE,
            "faults": [
                {"kind": "slow", "rack": "rack-01", "factor": 1.3, "cause": "thermal"},
                {"kind": "slow", "node": "node-0002", "factor": 1.3, "to_step": 50},
            ],
        }
    )
    assert scenario.truth() == [
        FaultTruth("slow", None, None, "rack-01", 0, None, "thermal"),
        FaultTruth("slow", None, "node-0002", "rack-00", 0, 50, "unknown"),
    ]
