"""The elastic rule (trainguard/common/elastic.py, issue 45): wait for a replacement or go
on at a smaller world, by the full-world seconds each loses until the full world trains again."""

from __future__ import annotations

import math

import pytest

from trainguard.common.elastic import choose, shrink_loss_s, worlds

#: A 1,024-rank job that lost one node of 8: R 600 s, re-forming 120 s, growing back 180 s.
COSTS = {"restart_s": 600.0, "shrink_s": 120.0, "grow_s": 180.0}


def test_a_long_wait_shrinks_and_the_reason_names_the_numbers() -> None:
    choice = choose(1024, 1016, 512, 1800.0, **COSTS, boundary_s=300.0)
    assert choice.action == "shrink" and choice.world_size == 1016
    assert choice.wait_loss_s == 2400.0
    narrow = 8 / 1024
    assert choice.shrink_loss_s == pytest.approx(120 + narrow * 1680 + narrow * 300 + 180)
    assert choice.saving_s == pytest.approx(2400 - choice.shrink_loss_s)
    for text in ("1,016 of 1,024 ranks", "1,800 s", "2,400 s", "120 s re-forming", "180 s growing back"):
        assert text in choice.reason, text


def test_a_short_wait_waits() -> None:
    """A replacement in 10 s and a one-minute restart: waiting loses 70 s, shrinking at
    least its re-forming and growing back (300 s)."""
    choice = choose(1024, 1016, 512, 10.0, restart_s=60.0, shrink_s=120.0, grow_s=180.0)
    assert choice.action == "wait" and choice.world_size == 1024
    assert choice.wait_loss_s == 70.0 and choice.shrink_loss_s == pytest.approx(300.0)
    assert choice.reason.startswith("wait (230 s saved)")


def test_a_tie_waits() -> None:
    # shrink = 100 + 0.5 x 100 + 0 + 50 = 200 = wait (200 + 0)
    choice = choose(2, 1, 1, 200.0, restart_s=0.0, shrink_s=100.0, grow_s=50.0)
    assert choice.shrink_loss_s == choice.wait_loss_s == 200.0 and choice.action == "wait"


def test_a_world_too_narrow_to_pay_waits_when_the_replacement_is_near() -> None:
    """Half the world left, a replacement in 5 minutes and a one-minute restart: shrinking
    loses half of every second it trains, and its two re-formings, more than the wait."""
    choice = choose(16, 8, 8, 300.0, restart_s=60.0, shrink_s=120.0, grow_s=180.0)
    assert choice.action == "wait" and choice.wait_loss_s == 360.0
    assert choice.shrink_loss_s == pytest.approx(120 + 0.5 * 180 + 180)


def test_below_the_minimum_waits_for_an_expected_replacement() -> None:
    choice = choose(1024, 500, 512, 1800.0, **COSTS)
    assert choice.action == "wait" and choice.world_size == 1024 and choice.shrink_loss_s is None
    assert "no world the job can train at between the minimum 512 and the 500 survivors" in choice.reason


def test_below_the_minimum_with_no_replacement_stops_with_the_reason() -> None:
    choice = choose(1024, 500, 512, None, **COSTS)
    assert choice.action == "stop" and choice.world_size == 0 and math.isinf(choice.wait_loss_s)
    assert choice.reason.endswith("no replacement is expected: stop")


def test_no_replacement_expected_shrinks_for_good() -> None:
    choice = choose(1024, 1016, 512, None, **COSTS)
    assert choice.action == "shrink" and choice.world_size == 1016 and choice.saving_s == 0.0
    assert "0.8% of every second lost" in choice.reason


def test_only_an_allowed_world_is_chosen() -> None:
    """The job's 1,000 data shards must split evenly: of the 1,016 survivors, 1,000 ranks train."""
    allowed = worlds(1016, multiple=8, divides=1000)
    assert max(allowed) == 1000 and all(1000 % w == 0 and w % 8 == 0 for w in allowed)
    choice = choose(1024, 1016, 512, 1800.0, **COSTS, allowed=allowed)
    assert choice.action == "shrink" and choice.world_size == 1000
    assert choice.fraction == pytest.approx(1000 / 1024)


def test_nothing_lost_goes_on() -> None:
    choice = choose(1024, 1024, 512, None, **COSTS)
    assert (choice.action, choice.world_size, choice.wait_loss_s) == ("wait", 1024, 0.0)


def test_a_replacement_sooner_than_the_shrink_costs_the_whole_shrink() -> None:
    assert shrink_loss_s(0.5, eta_s=10.0, shrink_s=100.0, grow_s=50.0) == 150.0
    assert shrink_loss_s(0.5, eta_s=300.0, shrink_s=100.0, grow_s=50.0, boundary_s=100.0) == 300.0


def test_worlds() -> None:
    assert worlds(20, 8) == (8, 16) and worlds(7, 8) == () and worlds(6) == (1, 2, 3, 4, 5, 6)
    assert worlds(16, 1, divides=12) == (1, 2, 3, 4, 6, 12)
