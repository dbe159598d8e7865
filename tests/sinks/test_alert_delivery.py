"""A page reaches someone (issue 49): a real Prometheus and a real Alertmanager against the
live stack. A Kafka broker of this test's own (it stops it), a running `trainguard process`
exporting its metrics, Prometheus scraping it with the shipped rules, Alertmanager with the
shipped routing, and a webhook receiver here (sinks/pager.py, what `trainguard pager`
serves). The broker stopped -> TrainguardProcessorBlind fires -> the `page` receiver's
webhook gets it within FIRING_BOUND_S; the broker back -> the resolved notification within
RESOLVED_BOUND_S.

What is the shipped configuration and what the test changes, only to be fast:
- the rules are sinks/prometheus/trainguard.rules.yml with one change: the blind alert's
  `for: 3m` becomes BLIND_FOR (the rest of the file, every other alert included, as shipped);
- Alertmanager's configuration is sinks/prometheus/alertmanager.yml with group_wait and
  group_interval of 1 s, the webhook's `url_file` pointed at a file this test writes (as
  compose's secret does) and, for an Alertmanager older than 0.26 (Debian 12 ships 0.25,
  which has no `url_file`), that file's URL written as `url` instead;
- Prometheus's configuration is docker-compose.yml's, scraping and evaluating every second,
  its targets on this machine, and only the processor's job (no archive writer here).
The processor is unchanged: it reads its consumer lag, and whether the broker answers,
every 10 s (a read times out after 5 s), which is most of the time to fire.

The binaries come from Debian's packages `prometheus` and `prometheus-alertmanager`
(scripts/setup installs them as root); without them the test fails, it does not skip."""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.devtools.broker_jars import ensure_jars
from harness.devtools.local_broker import LocalBroker
from harness.devtools.stack import PROCESSOR_GROUP, builtin_policy, scrape, start_processor
from trainguard.kafka.topics import ensure_topics
from trainguard.sinks.pager import Notification, PagerServer

from ..pipeline import free_port

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "sinks" / "prometheus"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
BLIND = "TrainguardProcessorBlind"
BLIND_FOR = "2s"  # shipped: 3m
BROKER_UP = f'trainguard_consumer_broker_up{{group="{PROCESSOR_GROUP}",role="processor"}}'
SECRET_URL_FILE = "/run/secrets/page_webhook_url"
#: From the broker's stop (its port closed) to the firing page at the webhook: the
#: processor's next lag reading (every 10 s, failing after its 5 s timeout), a scrape, two
#: evaluations (pending, then firing after BLIND_FOR) and Alertmanager's group_wait (1 s).
FIRING_BOUND_S = 30.0
#: From the broker's restart (serving metadata again) to the resolved page: the
#: processor's next lag reading, once librdkafka reconnects (its backoff has grown to up to
#: 10 s during the outage), a scrape, an evaluation, Alertmanager's group_interval (1 s).
RESOLVED_BOUND_S = 40.0


def binary(*names: str) -> str:
    for name in names:
        if exe := shutil.which(name):
            return exe
    pytest.fail(
        f"{' or '.join(names)} is not on PATH: install Debian's packages `prometheus` and "
        "`prometheus-alertmanager` (apt-get install --no-install-recommends; scripts/setup "
        "does it as root)"
    )


def version(exe: str) -> tuple[int, ...]:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=True)
    found = re.search(r"version (\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    assert found, out
    return tuple(int(part) for part in found.groups())


def shortened_rules(dest: Path) -> Path:
    """The shipped rules, the blind alert's `for` shortened (nothing else changed)."""
    groups = yaml.safe_load((SHIPPED / "trainguard.rules.yml").read_text())
    blind = [r for g in groups["groups"] for r in g["rules"] if r.get("alert") == BLIND]
    assert len(blind) == 1 and blind[0]["for"] == "3m", blind
    blind[0]["for"] = BLIND_FOR
    dest.write_text(yaml.safe_dump(groups, sort_keys=False))
    return dest


def alertmanager_config(dest: Path, webhook_url: str, url_file: bool) -> Path:
    """The shipped Alertmanager configuration, its timers shortened, the webhook's URL file
    this test's (or, with `url_file` False, its URL inline)."""
    config = yaml.safe_load((SHIPPED / "alertmanager.yml").read_text())
    config["route"].update(group_wait="1s", group_interval="1s")  # the page route inherits both
    (page,) = [r for r in config["route"]["routes"] if r["matchers"] == ['severity="page"']]
    assert not {"group_wait", "group_interval"} & set(page), page
    (receiver,) = [r for r in config["receivers"] if r["name"] == page["receiver"]]
    (hook,) = receiver["webhook_configs"]
    assert hook == {"url_file": SECRET_URL_FILE, "send_resolved": True}, hook
    url_path = dest.parent / "page_webhook_url"
    url_path.write_text(webhook_url + "\n")  # as compose writes the secret
    if url_file:
        hook["url_file"] = str(url_path)
    else:
        del hook["url_file"]
        hook["url"] = webhook_url
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def prometheus_config(dest: Path, rules: Path, metrics_port: int, alertmanager_port: int) -> Path:
    """docker-compose.yml's Prometheus configuration, run here and every second."""
    config = yaml.safe_load(COMPOSE["configs"]["prometheus"]["content"])
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(rules)]
    (manager,) = config["alerting"]["alertmanagers"]
    manager["static_configs"] = [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "trainguard-processor"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    config["scrape_configs"] = [job]
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


@contextmanager
def server(argv: list[str], log: Path, ready_url: str, timeout_s: float = 60) -> Iterator[None]:
    """A server process, logging to `log`, once `ready_url` answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"{argv[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(ready_url, timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{ready_url} not ready:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        result: list[dict[str, Any]] = json.load(response)["data"]["result"]
    return result


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.2)


def next_page(inbox: queue.Queue[tuple[float, Notification]], status: str, timeout_s: float) -> float:
    """When the webhook received the blind alert with `status` (monotonic seconds); fails
    after `timeout_s`. Any other notification before it fails too: nothing else may page."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            at, notification = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no {status} {BLIND} page within {timeout_s:.0f} s")
        names = {(a.name, a.status) for a in notification.alerts}
        assert names == {(BLIND, status)}, notification
        assert notification.receiver == "page" and notification.status == status, notification
        (alert,) = notification.alerts
        assert alert.labels == {"alertname": BLIND, "group": PROCESSOR_GROUP, "severity": "page"}, alert
        assert "blind" in alert.annotations["summary"], alert
        return at


def test_the_broker_stopped_pages_through_prometheus_and_alertmanager(tmp_path: Path) -> None:
    prometheus = binary("prometheus")
    alertmanager = binary("prometheus-alertmanager", "alertmanager")  # Debian's name first
    amtool = binary("amtool")
    am_version = version(alertmanager)
    print(f"\nprometheus {version(prometheus)}, alertmanager {am_version}")
    ensure_jars()
    inbox: queue.Queue[tuple[float, Notification]] = queue.Queue()
    metrics_port, prom_port, am_port = free_port(), free_port(), free_port()
    with ExitStack() as stack:
        pager = PagerServer("127.0.0.1", 0, lambda n: inbox.put((time.monotonic(), n))).start()
        stack.callback(pager.server_close)
        stack.callback(pager.shutdown)
        am_config = alertmanager_config(tmp_path / "alertmanager.yml", pager.url, am_version >= (0, 26))
        routed = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={am_config}", "severity=page"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert routed.stdout.strip() == "page", routed
        stack.enter_context(server(
            [alertmanager, f"--config.file={am_config}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            tmp_path / "alertmanager.log", f"http://127.0.0.1:{am_port}/-/ready",
        ))  # fmt: skip
        broker = LocalBroker(tmp_path / "kafka")  # our own broker: this test stops it
        stack.callback(broker.stop)
        bootstrap = broker.start()
        ensure_topics(bootstrap)
        env = {"TRAINGUARD_SECRET": "alert-delivery-test-secret-0123456789", "TRAINGUARD_HOME": str(tmp_path)}
        log = tmp_path / "processor.log"
        proc, metrics_url = start_processor(bootstrap, builtin_policy("demo"), metrics_port, log, env)
        stack.callback(proc.wait, 30)
        stack.callback(proc.terminate)
        # Until its first lag reading (a second or two after its metrics endpoint answers)
        # the processor reports its broker down: blind, which the shipped `for: 3m` outlasts
        # and BLIND_FOR does not. Prometheus starts watching once the processor is connected.
        started = time.monotonic()
        wait_until(lambda: scrape(metrics_url).get(BROKER_UP) == 1.0, 60, "the processor's first lag reading")
        print(f"the processor's broker up {time.monotonic() - started:.1f} s after its start")
        rules = shortened_rules(tmp_path / "trainguard.rules.yml")
        prom_config = prometheus_config(tmp_path / "prometheus.yml", rules, metrics_port, am_port)
        prom_url = f"http://127.0.0.1:{prom_port}"
        stack.enter_context(server(
            [prometheus, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp_path / "prometheus.log", f"{prom_url}/-/ready",
        ))  # fmt: skip

        up = 'trainguard_consumer_broker_up{role="processor"} == 1'
        wait_until(lambda: query(prom_url, up), 60, "Prometheus scraping the processor, its broker up")
        time.sleep(3.0)  # > BLIND_FOR and the evaluations around it: nothing pages while all is well
        assert not query(prom_url, f'ALERTS{{alertname="{BLIND}"}}') and inbox.empty(), inbox.queue

        stopping = time.monotonic()
        broker.stop()
        stopped = time.monotonic()
        fired = next_page(inbox, "firing", FIRING_BOUND_S)
        assert proc.poll() is None, log.read_text()[-3000:]

        restarting = time.monotonic()
        assert broker.start() == bootstrap  # the same ports: the processor reconnects
        restarted = time.monotonic()
        resolved = next_page(inbox, "resolved", RESOLVED_BOUND_S)
        assert proc.poll() is None, log.read_text()[-3000:]
        print(
            f"broker stop {stopped - stopping:.1f} s, firing page {fired - stopped:.1f} s after it "
            f"(bound {FIRING_BOUND_S:.0f}); broker restart {restarted - restarting:.1f} s, resolved "
            f"page {resolved - restarted:.1f} s after it (bound {RESOLVED_BOUND_S:.0f})"
        )
