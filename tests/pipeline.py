"""A real processor on a topic set of its own, for tests that drive the live pipeline."""

from __future__ import annotations

import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.devtools.stack import start_processor
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Processor:
    bootstrap: str
    prefix: str
    names: TopicNames
    log: Path
    metrics_url: str


@contextmanager
def running_processor(bootstrap: str, policy: Path, secret: str, log: Path) -> Iterator[Processor]:
    """Fresh topics under a random prefix, and `trainguard process` on them (its own
    process, as in production) until the block ends; then both are gone."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    try:
        proc, url = start_processor(
            bootstrap, policy, free_port(), log, {"TRAINGUARD_SECRET": secret}, topic_prefix=prefix
        )
        try:
            yield Processor(bootstrap, prefix, names, log, url)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        delete_topics(bootstrap, list(names.all()))
