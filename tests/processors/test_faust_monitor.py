"""processors/faust_monitor.py: faust's Monitor sensor leaves the processor's app when
faust adds it; the app's other sensors stay."""

from __future__ import annotations

import faust
from faust.sensors import Monitor, Sensor

from trainguard.processors import faust_monitor


def app_named(name: str) -> faust.App:
    return faust.App(name, broker="kafka://127.0.0.1:9", web_enabled=False)


def test_the_monitor_faust_adds_at_start_is_taken_out_and_other_sensors_stay() -> None:
    stock, ours = app_named("stock-sensors"), app_named("our-sensors")
    faust_monitor.drop(ours)
    mine = Sensor()
    ours.sensors.add(mine)
    stock_dependencies = list(stock.on_init_dependencies())
    our_dependencies = list(ours.on_init_dependencies())
    assert [type(s) for s in stock.sensors] == [Monitor]  # what faust does on its own
    assert list(ours.sensors) == [mine]
    assert len(our_dependencies) == len(stock_dependencies)  # the app starts the same services
