"""`trainguard pager`: an example receiver for Alertmanager's webhook, printing each page
(firing and resolved) as one line per alert (sinks/pager.py; README: Alerts)."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import app, console, fail, stop_on_signals


@app.command()
def pager(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9095,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 in a container).")] = "127.0.0.1",
) -> None:
    """An example Alertmanager webhook receiver: prints every notification it is sent, one
    line per alert (FIRING or RESOLVED, the alert, its labels, its summary). Point the
    `page` receiver's webhook at it (TRAINGUARD_PAGE_WEBHOOK_URL=http://HOST:PORT/) to see
    what a pager would get; runs until SIGINT or SIGTERM."""
    from ..sinks.pager import Notification, PagerServer

    def show(notification: Notification) -> None:
        for line in notification.lines():
            print(line, flush=True)

    try:
        server = PagerServer(host, port, show).start()
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc}")
    console.print(f"receiving Alertmanager webhooks at {server.url}", markup=False, soft_wrap=True)
    stop_on_signals().wait()
    server.shutdown()
    server.server_close()
