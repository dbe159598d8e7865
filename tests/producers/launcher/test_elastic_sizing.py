"""The launcher's size for the next world under elastic training (issue 45, producers/launcher/elastic.py)."""

from __future__ import annotations

from pathlib import Path

from trainguard.producers.launcher.config import LauncherConfig
from trainguard.producers.launcher.elastic import next_size, should_grow


def config(min_nproc: int | None, restart: str = "in-process") -> LauncherConfig:
    return LauncherConfig(("true",), 8, 1, "run", Path("ckpt"), restart=restart, min_nproc=min_nproc)  # type: ignore[arg-type]


def test_the_survivors_and_ready_spares_go_on_unless_the_policy_waits_or_too_few_are_left() -> None:
    elastic = config(min_nproc=4)
    assert elastic.elastic and not config(None).elastic and not config(4, restart="full").elastic
    assert next_size(elastic, survivors=7, ready=1, capacity=None).size == 8  # a spare fills it
    shrink = next_size(elastic, survivors=6, ready=1, capacity=None)
    assert shrink.size == 7 and "no decision from the processor" in shrink.reason
    assert next_size(elastic, survivors=6, ready=0, capacity="shrink").size == 6
    wait = next_size(elastic, survivors=6, ready=0, capacity="wait")
    assert wait.size == 8 and "waits for the replacement" in wait.reason
    few = next_size(elastic, survivors=3, ready=0, capacity="shrink")
    assert few.size == 8 and "below the minimum of 4" in few.reason
    assert next_size(config(None), survivors=6, ready=0, capacity="shrink").size == 8  # not elastic


def test_a_smaller_world_grows_back_once_the_spares_fill_it() -> None:
    elastic = config(min_nproc=4)
    assert not should_grow(elastic, size=6, ready=1)
    assert should_grow(elastic, size=6, ready=2)
    assert not should_grow(elastic, size=8, ready=3)  # full already
    assert not should_grow(config(None), size=6, ready=2)
