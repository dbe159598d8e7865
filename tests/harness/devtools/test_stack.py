"""The local stack's processor start (harness/devtools/stack.py) refuses a metrics port
where a server already answers: that server would answer the start's health check for
a worker that died binding it (a bench then measured a pipeline without a processor)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from harness.devtools.stack import http_answers, start_processor


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_where_a_server_answers_is_refused_before_the_processor_starts(tmp_path: Path) -> None:
    server = HTTPServer(("127.0.0.1", 0), _NotFound)  # any answer counts, a 404 too
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert http_answers(port)
        with pytest.raises(RuntimeError, match=f"port {port} .* in use"):
            start_processor("127.0.0.1:1", Path("unused.yaml"), port, tmp_path / "processor.log")
        assert not (tmp_path / "processor.log").exists()  # refused before anything started
    finally:
        server.shutdown()
        server.server_close()
    assert not http_answers(port)  # closed: nothing answers
