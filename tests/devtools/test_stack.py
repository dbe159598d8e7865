"""The local stack's processor start (trainguard/devtools/stack.py) refuses a metrics port
that another process listens on: that process would answer the start's health check
for a worker that died binding it (a bench then measured a pipeline without a processor)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from trainguard.devtools.stack import port_free, start_processor


def test_a_port_another_process_listens_on_is_refused_before_the_processor_starts(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert not port_free(port)
        with pytest.raises(RuntimeError, match=f"port {port} .* in use"):
            start_processor("127.0.0.1:1", Path("unused.yaml"), port, tmp_path / "processor.log")
        assert not (tmp_path / "processor.log").exists()  # refused before anything started
    assert port_free(port)  # closed: free again
