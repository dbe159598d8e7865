"""The processor's faust app without faust's own Monitor sensor (issue 20).

faust adds a ``Monitor`` to every app's sensors when the app starts
(``App.on_init_dependencies``): per record it counts messages and events by topic, stream
and partition, timestamps each one in and out, and a background task samples rates every
second, all for faust's own web pages. The processor serves none of them (its metrics are
prometheus-client's: processors/metrics.py), and the bookkeeping costs a draining worker
about 2% of its time by profile. Other sensors, should an operator add any, stay.
"""

from __future__ import annotations

from collections.abc import Iterable

import faust
from mode import ServiceT


def drop(app: faust.App) -> None:
    """Take faust's Monitor out of `app`'s sensors as soon as faust puts it in."""
    init_dependencies = app.on_init_dependencies

    def without_monitor() -> Iterable[ServiceT]:
        dependencies = init_dependencies()
        if app.monitor in app.sensors:
            app.sensors.remove(app.monitor)
        return dependencies

    app.on_init_dependencies = without_monitor  # type: ignore[method-assign]
