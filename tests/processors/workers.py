"""Processor workers (`trainguard process`, each its own process) started, stopped and
killed on one topic set, for the scenarios that fault the processor itself."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from harness.devtools.broker_config import free_ports
from harness.devtools.stack import scrape, start_processor
from trainguard.kafka.topics import TELEMETRY, TopicNames

APP_ID = "trainguard-processor"


def prefix_of(names: TopicNames) -> str:
    return names.telemetry.removesuffix(TELEMETRY)


@dataclass
class Workers:
    bootstrap: str
    names: TopicNames
    policy: Path
    secret: str
    logs: Path
    args: tuple[str, ...] = ()
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    @property
    def group(self) -> str:
        """The workers' consumer group (faust's app id)."""
        return prefix_of(self.names) + APP_ID

    def start(self) -> int:
        """A new worker; returns its number (workers are never renumbered)."""
        n = len(self.procs)
        proc, url = start_processor(
            self.bootstrap, self.policy, free_ports(1)[0], self.logs / f"worker-{n}.log",
            {"TRAINGUARD_SECRET": self.secret}, prefix_of(self.names), extra_args=self.args,
        )  # fmt: skip
        self.procs.append(proc)
        self.urls.append(url)
        return n

    def log(self, n: int) -> str:
        return (self.logs / f"worker-{n}.log").read_text(errors="replace")[-4000:]

    def stop(self, n: int, sig: signal.Signals = signal.SIGTERM) -> None:
        self.procs[n].send_signal(sig)
        self.procs[n].wait(60)

    def metric(self, n: int, name: str) -> float:
        return scrape(self.urls[n]).get(name, 0.0)

    def wait_processed(self, n: int, events: int, timeout_s: float = 90.0) -> None:
        """Until worker n has folded `events` events (counted from its own start)."""
        deadline = time.monotonic() + timeout_s
        while (done := self.metric(n, "trainguard_events_processed_total")) < events:
            assert time.monotonic() < deadline, f"worker {n} processed {done} of {events}:\n{self.log(n)}"
            time.sleep(0.3)

    def committed(self, partition: int) -> int:
        consumer = Consumer(
            {"bootstrap.servers": self.bootstrap, "group.id": self.group, "enable.auto.commit": False}
        )
        try:
            return consumer.committed([TopicPartition(self.names.telemetry, partition)], timeout=10)[0].offset
        finally:
            consumer.close()


@contextmanager
def workers_on(
    bootstrap: str, names: TopicNames, policy: Path, secret: str, logs: Path, args: tuple[str, ...] = ()
) -> Iterator[Workers]:
    """Workers on `names`; any still running when the block ends are killed."""
    workers = Workers(bootstrap, names, policy, secret, logs, args)
    try:
        yield workers
    finally:
        for proc in workers.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
