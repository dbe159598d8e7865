"""The example page receiver (sinks/pager.py, `trainguard pager`): it reads Alertmanager's
webhook payload (version 4), prints one line per alert, and refuses what is not one with a
400, so that Alertmanager retries. Its delivery from a real Alertmanager is
tests/sinks/test_alert_delivery.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from trainguard.sinks.pager import Notification, NotificationError, PagerServer, parse_notification

from ..pipeline import free_port

#: A notification as Alertmanager 0.25 sends it (fields this receiver does not read included).
PAYLOAD = {
    "receiver": "page",
    "status": "firing",
    "alerts": [
        {
            "status": "firing",
            "labels": {"alertname": "TrainguardProcessorBlind", "group": "trainguard-processor",
                       "severity": "page"},
            "annotations": {"summary": "trainguard processors (trainguard-processor) are blind"},
            "startsAt": "2026-12-06T19:41:49.47Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph?g0.expr=...",
            "fingerprint": "2f0ad3f1e2d5a0c4",
        }
    ],
    "groupLabels": {"alertname": "TrainguardProcessorBlind", "group": "trainguard-processor"},
    "commonLabels": {},
    "commonAnnotations": {},
    "externalURL": "http://alertmanager:9093",
    "version": "4",
    "groupKey": '{}/{severity="page"}:{alertname="TrainguardProcessorBlind"}',
    "truncatedAlerts": 0,
}  # fmt: skip


def test_a_notification_is_parsed_and_printed_one_line_per_alert() -> None:
    notification = parse_notification(json.dumps(PAYLOAD).encode())
    assert notification.status == "firing" and notification.receiver == "page"
    (alert,) = notification.alerts
    assert alert.name == "TrainguardProcessorBlind" and alert.labels["group"] == "trainguard-processor"
    (line,) = notification.lines()
    assert " FIRING TrainguardProcessorBlind [page] group=trainguard-processor trainguard processors" in line


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[]", json.dumps({**PAYLOAD, "version": "3"}).encode(),
     json.dumps({**PAYLOAD, "alerts": {}}).encode(),
     json.dumps({**PAYLOAD, "alerts": [{"labels": {"a": 1}}]}).encode()],
)  # fmt: skip
def test_what_is_not_a_notification_is_refused(body: bytes) -> None:
    with pytest.raises(NotificationError):
        parse_notification(body)


def test_the_server_takes_notifications_and_answers_400_to_anything_else() -> None:
    received: list[Notification] = []
    server = PagerServer("127.0.0.1", 0, received.append).start()
    try:
        post = urllib.request.Request(server.url, data=json.dumps(PAYLOAD).encode(), method="POST")
        with urllib.request.urlopen(post, timeout=5) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(server.url, data=b"{}", method="POST"), timeout=5)
        assert refused.value.code == 400
        with urllib.request.urlopen(server.url, timeout=5) as response:  # the health check
            assert response.status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert [n.alerts[0].name for n in received] == ["TrainguardProcessorBlind"]


def test_trainguard_pager_prints_what_it_receives() -> None:
    port = free_port()
    command = [sys.executable, "-m", "trainguard", "pager", "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                post = urllib.request.Request(f"http://127.0.0.1:{port}/", data=json.dumps(PAYLOAD).encode())
                urllib.request.urlopen(post, timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.2)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "FIRING TrainguardProcessorBlind [page] group=trainguard-processor" in out, (out, err)
