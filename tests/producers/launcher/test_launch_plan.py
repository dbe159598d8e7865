"""Placement: quarantined nodes never get ranks again, spares in order, world size kept."""

from __future__ import annotations

import pytest

from trainguard.producers.launcher.plan import PoolExhausted, make_pool, plan


def test_fresh_placement_uses_the_jobs_own_nodes() -> None:
    pool = make_pool(world_size=8, ranks_per_node=2, spares=2, nodes_per_rack=2)
    placed = plan(pool, set(), 8)
    assert placed.nodes == ("node-0000", "node-0001", "node-0002", "node-0003")
    assert [placed.node_of(r) for r in range(8)] == [n for n in placed.nodes for _ in range(2)]
    assert placed.moved == {}
    assert pool.racks["node-0002"] == "rack-01" and pool.racks["spare-0000"] == "rack-02"


def test_quarantined_nodes_move_to_spares_in_order_and_never_come_back() -> None:
    pool = make_pool(8, 2, spares=3)
    first = plan(pool, {"node-0001"}, 8)
    assert first.nodes == ("node-0000", "spare-0000", "node-0002", "node-0003")
    assert first.moved == {1: ("node-0001", "spare-0000")}
    # Slot-stable: a later quarantine moves only its own slot, to the next spare.
    second = plan(pool, {"node-0001", "node-0003"}, 8, previous=first)
    assert second.nodes == ("node-0000", "spare-0000", "node-0002", "spare-0001")
    assert second.moved == {3: ("node-0003", "spare-0001")}
    # A quarantined spare is replaced by the next one; quarantined nodes never return.
    third = plan(pool, {"node-0001", "node-0003", "spare-0000"}, 8, previous=second)
    assert third.nodes == ("node-0000", "spare-0002", "node-0002", "spare-0001")
    for placed in (first, second, third):
        assert len([r for n in placed.nodes for r in placed.ranks_of(n)]) == 8
    assert "node-0001" not in third.nodes and "node-0003" not in third.nodes


def test_partial_last_node_keeps_world_size() -> None:
    pool = make_pool(5, 2, spares=1)
    placed = plan(pool, {"node-0002"}, 5)
    assert placed.nodes == ("node-0000", "node-0001", "spare-0000")
    assert placed.ranks_of("spare-0000") == [4]


def test_clear_error_when_the_pool_runs_out() -> None:
    pool = make_pool(4, 2, spares=1)
    with pytest.raises(
        PoolExhausted, match=r"1 more healthy node\(s\) needed; quarantined: \['node-0000', 'node-0001'\]"
    ):
        plan(pool, {"node-0000", "node-0001"}, 4)
