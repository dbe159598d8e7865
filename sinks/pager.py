"""An example receiver for Alertmanager's webhook (`trainguard pager`): where the `page`
receiver of sinks/prometheus/alertmanager.yml can point until a real pager is wired in,
and what tests/sinks/test_alert_delivery.py receives pages with.

Alertmanager POSTs one JSON notification (payload version 4) per alert group and flush:
its `status` (firing or resolved), the receiver's name, the group's labels and the
alerts, each with its own status, labels, annotations and times. This server parses it,
hands it to a callback (the CLI prints one line per alert), and answers 200; a body that
is not such a notification gets 400, so Alertmanager logs the failure and retries."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: The webhook payload's version this parser reads (Alertmanager 0.x sends "4").
PAYLOAD_VERSION = "4"
#: The largest body accepted (Alertmanager's max_alerts: 0 sends every alert of the group).
MAX_BODY = 8 * 1024 * 1024


class NotificationError(ValueError):
    """A body that is not an Alertmanager webhook notification."""


@dataclass(frozen=True)
class Alert:
    status: str  # firing | resolved
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str
    ends_at: str

    @property
    def name(self) -> str:
        return self.labels.get("alertname", "")


@dataclass(frozen=True)
class Notification:
    status: str  # firing (some alert of the group fires) | resolved (all resolved)
    receiver: str
    group_labels: dict[str, str]
    alerts: tuple[Alert, ...]
    received_at: float = field(default_factory=time.time)

    def lines(self) -> list[str]:
        """One line per alert: status, name, the labels that say which, the summary."""
        out = []
        for alert in self.alerts:
            labels = " ".join(
                f"{k}={v}" for k, v in sorted(alert.labels.items()) if k not in ("alertname", "severity")
            )
            summary = alert.annotations.get("summary", "")
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.received_at))
            out.append(f"{stamp} {alert.status.upper()} {alert.name} [{self.receiver}] {labels} {summary}")
        return out


def _strings(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise NotificationError(f"{what} is not an object of strings")
    return {str(k): v for k, v in value.items()}


def parse_notification(body: bytes) -> Notification:
    """The notification in an Alertmanager webhook body (NotificationError if it is not one)."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotificationError(f"not JSON: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("version") != PAYLOAD_VERSION:
        raise NotificationError(f"not an Alertmanager webhook payload of version {PAYLOAD_VERSION}")
    raw_alerts = payload.get("alerts")
    if not isinstance(raw_alerts, list) or not all(isinstance(a, dict) for a in raw_alerts):
        raise NotificationError("alerts is not a list of objects")
    alerts = tuple(
        Alert(
            status=str(a.get("status", "")),
            labels=_strings(a.get("labels", {}), "an alert's labels"),
            annotations=_strings(a.get("annotations", {}), "an alert's annotations"),
            starts_at=str(a.get("startsAt", "")),
            ends_at=str(a.get("endsAt", "")),
        )
        for a in raw_alerts
    )
    return Notification(
        status=str(payload.get("status", "")),
        receiver=str(payload.get("receiver", "")),
        group_labels=_strings(payload.get("groupLabels", {}), "groupLabels"),
        alerts=alerts,
    )


class _Handler(BaseHTTPRequestHandler):
    server: PagerServer

    def do_GET(self) -> None:  # a health check
        self._answer(HTTPStatus.OK, b"ok\n")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(HTTPStatus.BAD_REQUEST, b"a notification needs a body of at most 8 MiB\n")
            return
        try:
            notification = parse_notification(self.rfile.read(length))
        except NotificationError as exc:
            self._answer(HTTPStatus.BAD_REQUEST, f"{exc}\n".encode())
            return
        self.server.on_notification(notification)
        self._answer(HTTPStatus.OK, b"ok\n")

    def _answer(self, status: HTTPStatus, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base's name)
        log.debug("%s %s", self.address_string(), format % args)


class PagerServer(ThreadingHTTPServer):
    """An HTTP server taking Alertmanager's webhook notifications on any path."""

    daemon_threads = True

    def __init__(self, host: str, port: int, on_notification: Callable[[Notification], None]) -> None:
        super().__init__((host, port), _Handler)
        self.on_notification = on_notification

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> PagerServer:
        """Serve on a daemon thread; shutdown() and server_close() stop it."""
        threading.Thread(target=self.serve_forever, name="pager", daemon=True).start()
        return self
