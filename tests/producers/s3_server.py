"""A local S3 endpoint for the object-store checkpoint tests: moto's S3 server, a real HTTP
server speaking the S3 protocol, reached through s3fs exactly as a bucket would be (no
rename, no directories, listings by prefix). Rank processes find it through the standard
AWS variables the fixture sets (`AWS_ENDPOINT_URL_S3` and dummy credentials)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

#: The standard AWS variables every client here (and every rank process) reads.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "trainguard-test",
    "AWS_SECRET_ACCESS_KEY": "trainguard-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3:
    endpoint: str

    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.endpoint}

    def bucket(self) -> str:
        """A new, empty bucket's URL (s3://name)."""
        import fsspec

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3").mkdir(name)
        return f"s3://{name}"


@pytest.fixture(scope="session")  # one endpoint: fsspec caches its S3 filesystem, endpoint and all
def s3() -> Iterator[S3]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server_env = S3(f"http://{host}:{port}")
    saved = {key: os.environ.get(key) for key in server_env.env()}
    os.environ.update(server_env.env())
    try:
        yield server_env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
