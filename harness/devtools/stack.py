"""A whole local pipeline for demos, evaluations and benchmarks: a Kafka broker in a
directory of its own, the topics, and the processor as a separate process (as in
production) serving Prometheus metrics. Stopped cleanly on exit, errors included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from trainguard.kafka.acl import PROCESSOR_APP
from trainguard.kafka.topics import TopicNames, ensure_topics, topic_names

from .broker_jars import ensure_jars
from .local_broker import LocalBroker

#: The faust app id of the processor (its consumer group).
PROCESSOR_GROUP = PROCESSOR_APP


def builtin_policy(name: str) -> Path:
    return Path(str(resources.files("trainguard.processors") / "policies" / f"{name}.yaml"))


@dataclass
class Stack:
    bootstrap: str
    names: TopicNames
    broker: LocalBroker
    processor: subprocess.Popen[bytes]
    processor_log: Path
    metrics_url: str

    def processor_alive(self) -> bool:
        return self.processor.poll() is None

    def processor_log_tail(self, chars: int = 3000) -> str:
        return self.processor_log.read_text(errors="replace")[-chars:]

    def scrape(self) -> dict[str, float]:
        """The processor's trainguard_* metrics (without the `_created` series)."""
        return scrape(self.metrics_url)


def scrape(url: str) -> dict[str, float]:
    """A processor's trainguard_* metrics from its endpoint (without `_created` series)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("trainguard_") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def http_answers(port: int) -> bool:
    """A server already answers HTTP on 127.0.0.1:`port` (any status). Only that is
    refused before a start: a port a client connection happens to hold a moment is not
    (a bind probe refused those, and the processor's own bind a second later succeeds)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the processor exited ({proc.returncode}); see {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the processor's metrics endpoint {url} did not come up; see {log}")


def start_processor(
    bootstrap: str,
    policy: Path,
    metrics_port: int,
    log: Path,
    secret_env: dict[str, str] | None = None,
    topic_prefix: str = "",
    api_port: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """One processor worker (`trainguard process`) in its own process, logging to `log`;
    returns once its metrics endpoint answers. Workers started on the same broker share
    the telemetry partitions (one consumer group). With `api_port`, it serves the run API
    there too (its token must be in `secret_env` or the environment)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    for port in (metrics_port, api_port):
        if port and http_answers(port):
            # Another process there would answer for this worker, whose own start then fails.
            raise RuntimeError(
                f"port {port} on 127.0.0.1 is in use: a server answers there (another processor?)"
            )
    command = [sys.executable, "-m", "trainguard", "process", "--bootstrap", bootstrap]
    command += ["--policy", str(policy), "--metrics-port", str(metrics_port), "--loglevel", "info"]
    command += ["--topic-prefix", topic_prefix] if topic_prefix else []
    command += ["--api-port", str(api_port)] if api_port else []
    command += list(extra_args)  # e.g. --snapshot-interval, --commit-interval
    with log.open("wb") as out:
        processor = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(secret_env or {})}
        )
    try:
        _wait_http(url, 60, processor, log)
    except BaseException:
        processor.kill()
        raise
    return processor, url


@contextmanager
def local_stack(
    workdir: Path, policy: Path, metrics_port: int, secret_env: dict[str, str] | None = None
) -> Iterator[Stack]:
    """Start broker + topics + processor under `workdir` (its broker data is reset);
    `secret_env` passes the command-signing secret to the processor (default: ours)."""
    ensure_jars()
    shutil.rmtree(workdir / "broker", ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    broker = LocalBroker(workdir / "broker")
    processor: subprocess.Popen[bytes] | None = None
    try:
        bootstrap = broker.start()
        ensure_topics(bootstrap)
        log = workdir / "processor.log"
        processor, url = start_processor(bootstrap, policy, metrics_port, log, secret_env)
        yield Stack(bootstrap, topic_names(), broker, processor, log, url)
    finally:
        if processor is not None and processor.poll() is None:
            processor.terminate()
            try:
                processor.wait(timeout=30)
            except subprocess.TimeoutExpired:
                processor.kill()
        broker.stop()
