"""docker-compose.yml starts (issue 19): its structure is checked, and each trainguard
service's command runs the way its container would, against the real test broker.

There is no Docker engine here, so "the way its container would" means: the command and
environment from the compose file and the image's ENV (Dockerfile), the secrets as files
readable by their owner alone, /data a fresh directory (the volume), and the working
directory and HOME read-only (a read-only tmpfs in a mount namespace of its own: as root,
file modes alone would not stop a write). A service that wrote next to its code, or
outside its volume, fails here as it would crash-loop in the container."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.devtools.pin_images import Pins, read_table
from trainguard.processors.metrics import ProcessorMetrics
from trainguard.sinks.archive_metrics import ArchiveMetrics

from .pipeline import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SERVICES = COMPOSE["services"]
OURS = [name for name, service in SERVICES.items() if service.get("image") == "trainguard:local"]
SECRET = "compose-test-secret-0123456789abcdef"
TOKEN = "compose-test-api-token-0123456789abcdef"


def _image_env() -> dict[str, str]:
    """The Dockerfile's ENV (one multi-line instruction)."""
    block = re.search(r"^ENV (.+?)\n\n", DOCKERFILE, re.S | re.M)
    assert block, "the Dockerfile sets no ENV"
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


# --------------------------------------------------------------------------- structure


#: A pulled image left without a digest, with the reason (issue 49: none today). An image
#: compose builds (`build:`) needs none: its base images are the Dockerfile's, checked below.
UNPINNED: dict[str, str] = {}
PINNED = re.compile(r"^[a-z0-9][\w./-]*:[\w][\w.-]*@sha256:[0-9a-f]{64}$")
#: A service that may run as root, with the reason (none today).
ROOT_ALLOWED: dict[str, str] = {}


def _from_images() -> list[str]:
    """The Dockerfile's base images (not its own stages)."""
    stages: set[str] = set()
    images = []
    for ref, stage in re.findall(r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", DOCKERFILE, re.M | re.I):
        if ref.lower() not in stages:
            images.append(ref)
        if stage:
            stages.add(stage.lower())
    return images


def test_every_image_is_pinned_by_digest_and_every_long_running_service_has_a_healthcheck() -> None:
    """`name:tag@sha256:<64 hex>` for every image pulled (docs/deploy/images.md)."""
    for name, service in SERVICES.items():
        image = service["image"]
        if "build" in service:
            assert "@" not in image and not image.endswith(":latest"), (name, image)
        elif image not in UNPINNED:
            assert PINNED.match(image), f"{name}: {image} is not pinned by digest"
        if service.get("restart") != "no":
            assert "healthcheck" in service, f"{name} has no healthcheck"
    froms = _from_images()
    assert len(froms) == 2, froms  # the build stage and the runtime stage
    for image in froms:
        assert image in UNPINNED or PINNED.match(image), f"Dockerfile: FROM {image} is not pinned by digest"


def test_both_python_stages_are_the_same_python_on_the_same_debian() -> None:
    """The compiled extensions of the build stage load in the runtime stage only if both
    have the same Python and the same Debian release: the tags say both, and agree."""
    tags = [image.split("@")[0].split(":")[1] for image in _from_images()]
    parsed = [re.fullmatch(r"(\d+\.\d+\.\d+)-(slim-)?([a-z]+)", tag) for tag in tags]
    assert all(parsed), tags
    (build, runtime) = [(m[1], bool(m[2]), m[3]) for m in parsed if m]
    assert (build[0], build[2]) == (runtime[0], runtime[2]) and (build[1], runtime[1]) == (False, True), tags
    assert build[0].startswith("3.11.")  # the Python the package is compiled and typed for


def test_the_pins_and_their_evidence_table_agree() -> None:
    """docs/deploy/images.md records each digest pinned, where it came from and when
    (`scripts/pin-images --check`)."""
    assert Pins(ROOT).problems() == []
    rows = read_table((ROOT / "docs/deploy/images.md").read_text())
    assert len(rows) == len([s for s in SERVICES.values() if "build" not in s]) + len(_from_images())
    for row in rows.values():
        assert row.source and re.fullmatch(r"\d{4}-\d{2}-\d{2}", row.date), row


def test_every_service_runs_as_a_user_other_than_root() -> None:
    """`user:` on every service (the image's own user, stated), and the trainguard image's
    last stage runs as that user too."""
    (image_user,) = re.findall(r"^USER (\S+)", DOCKERFILE.split("\nFROM ")[-1], re.M)
    for name, service in SERVICES.items():
        if name in ROOT_ALLOWED:
            continue
        user = str(service.get("user", ""))
        assert user, f"{name} sets no user"
        uid, _, gid = user.partition(":")
        assert uid not in ("", "0", "root") and gid != "root", f"{name} runs as {user}"
        if "build" in service:
            assert user == image_user, (name, user, image_user)


def test_grafanas_admin_password_is_a_compose_secret() -> None:
    """No default password: Grafana reads it from a secret that compose fills from the
    environment (TRAINGUARD_GRAFANA_ADMIN_PASSWORD), readable by Grafana's user alone."""
    grafana = SERVICES["grafana"]
    env = grafana["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    (secret,) = grafana["secrets"]
    mode = int(str(secret["mode"]).removeprefix("0o"), 8)
    assert (secret["source"], secret["uid"], mode) == ("grafana_admin_password", grafana["user"], 0o400)
    assert COMPOSE["secrets"]["grafana_admin_password"] == {
        "environment": "TRAINGUARD_GRAFANA_ADMIN_PASSWORD"
    }
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"^[ \t-]*GF_SECURITY_ADMIN_PASSWORD[ \t]*[:=]", text, re.M), (
        "a password in the file"
    )
    assert "admin/admin" not in text


def test_trainguard_runs_as_a_user_with_its_state_on_volumes_and_a_read_only_root() -> None:
    user = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert user and not user[-1].startswith(("0", "root")), "the image runs as root"
    assert _image_env()["TRAINGUARD_HOME"] == "/data"
    declared = set(COMPOSE["volumes"])
    for name in OURS:
        service = SERVICES[name]
        assert service["read_only"] is True, name
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert source in declared and target == "/data", (name, volume)
    assert {"processor", "archive"} <= {n for n in OURS if SERVICES[n].get("volumes")}


def test_secrets_come_through_compose_secrets_owned_by_the_service_user() -> None:
    for name, secret in COMPOSE["secrets"].items():
        assert set(secret) == {"environment"}, f"{name}: a file secret keeps the host file's owner and mode"
    processor = SERVICES["processor"]
    for entry in processor["secrets"]:
        mode = int(str(entry["mode"]).removeprefix("0o"), 8)  # PyYAML reads YAML 1.1: 0o400 is a string
        assert (entry["uid"], entry["gid"], mode) == ("1000", "1000", 0o400), entry
    env = processor["environment"]
    assert env["TRAINGUARD_SECRET_FILE"] == "/run/secrets/command_secret"
    assert env["TRAINGUARD_API_TOKEN_FILE"] == "/run/secrets/api_token"
    assert "--api-port" in processor["command"]  # the run API is on
    assert not any(re.search(r"secret|token", str(v), re.I) for v in env.values() if "/run/secrets/" not in v)


def test_prometheus_scrapes_both_jobs_the_alerts_expect_and_alertmanager_routes_pages() -> None:
    config = yaml.safe_load(COMPOSE["configs"]["prometheus"]["content"])
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert jobs == {"trainguard-processor": ["processor:9464"], "trainguard-archive": ["archive:9465"]}
    rules = (ROOT / "sinks/prometheus/trainguard.rules.yml").read_text()
    assert set(re.findall(r'job="([\w-]+)"', rules)) == set(jobs)
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    for name, item in COMPOSE["configs"].items():
        if "file" in item:
            assert (ROOT / item["file"]).is_file(), name
    manager = yaml.safe_load((ROOT / "sinks/prometheus/alertmanager.yml").read_text())
    (page,) = [r for r in manager["route"]["routes"] if r["matchers"] == ['severity="page"']]
    # The pages reach a webhook whose URL is a compose secret (TRAINGUARD_PAGE_WEBHOOK_URL),
    # readable by the image's user (nobody); tests/sinks/test_alert_delivery.py delivers one.
    (receiver,) = [r for r in manager["receivers"] if r["name"] == page["receiver"]]
    (hook,) = receiver["webhook_configs"]
    assert hook["url_file"] == "/run/secrets/page_webhook_url" and hook["send_resolved"] is True
    assert COMPOSE["secrets"]["page_webhook_url"] == {"environment": "TRAINGUARD_PAGE_WEBHOOK_URL"}
    (secret,) = SERVICES["alertmanager"]["secrets"]
    assert (secret["source"], secret["uid"], secret["gid"]) == ("page_webhook_url", "65534", "65534")
    assert SERVICES["pager"]["command"][0] == "pager"  # the example receiver: trainguard pager


def test_the_dashboard_queries_only_series_that_exist() -> None:
    dashboard = json.loads((ROOT / "sinks/grafana/trainguard.json").read_text())
    registries = (ProcessorMetrics().registry, ArchiveMetrics().registry)
    families = [m for r in registries for m in r.collect()]
    exported = {s.name for m in families for s in m.samples} | {m.name for m in families}
    exported |= {f"{m.name}_total" for m in families if m.type == "counter"}  # per-run, no series yet
    exported |= {"trainguard_consumer_lag_records", "trainguard_consumer_broker_up"}
    rules = yaml.safe_load((ROOT / "sinks/prometheus/trainguard.rules.yml").read_text())["groups"]
    recorded = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Goodput per run", "Interruptions by cause (per hour)", "Restart seconds (p50, p90, max bucket)",
            "Consumer lag (records waiting)"} <= titles  # fmt: skip
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = set(re.findall(r"\b((?:trainguard_|run_id:|group:)[\w:]+)", target["expr"]))
            unknown = {n for n in names if n not in exported and n not in recorded}
            assert names and not unknown, (panel["title"], unknown)


# --------------------------------------------------------------------------- the services, run


@dataclass
class Container:
    """Where a service's container paths live in this test."""

    root: Path
    bootstrap: str
    prefix: str

    def path(self, inside: str) -> str:
        for mount in ("/data", "/run/secrets"):
            if inside == mount or inside.startswith(mount + "/"):
                return str(self.root / mount.strip("/")) + inside[len(mount) :]
        return inside

    def env(self, service: dict[str, Any]) -> dict[str, str]:
        env = {**_image_env(), **service.get("environment", {})}
        env = {key: self.path(str(value)) for key, value in env.items()}
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
        return {**keep, **env, "HOME": str(self.root / "home")}

    def argv(self, service: dict[str, Any], ports: dict[str, int]) -> list[str]:
        argv = [self.path(a).replace("kafka:9092", self.bootstrap) for a in service["command"]]
        for option, port in ports.items():
            if option in argv:
                argv[argv.index(option) + 1] = str(port)
            else:
                argv += [option, str(port)]
        return [sys.executable, "-m", "trainguard", *argv, "--topic-prefix", self.prefix]

    def run(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """`argv` with the working directory and HOME read-only, as in the container."""
        mounts = 'mount -t tmpfs -o ro tmpfs "$1" && mount -t tmpfs -o ro tmpfs "$2"'
        script = mounts + ' && cd "$1" && shift 2 && exec "$@"'
        app, home = self.root / "app", self.root / "home"
        with log.open("wb") as out:
            return subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(app), str(home)]
                + argv,
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip


@pytest.fixture
def container(bootstrap: str, tmp_path: Path) -> Iterator[Container]:
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:  # a failure, not a skip: the services' container paths go unchecked
        pytest.fail(f"`unshare -m` is needed for the read-only working directory: {probe.stderr.strip()}")
    for folder in ("app", "home", "data", "run/secrets"):
        (tmp_path / folder).mkdir(parents=True)
    for name, value in (("command_secret", SECRET), ("api_token", TOKEN)):
        secret = tmp_path / "run/secrets" / name
        secret.write_text(value)
        secret.chmod(0o400)
    yield Container(tmp_path, bootstrap, f"c{uuid.uuid4().hex[:8]}.")


def _healthy(service: dict[str, Any], ports: dict[int, int], env: dict[str, str], timeout_s: float) -> bool:
    test = [str(a) for a in service["healthcheck"]["test"][1:]]
    for inside, outside in ports.items():
        test = [a.replace(f":{inside}/", f":{outside}/") for a in test]
    test = [sys.executable if a == "python" else a for a in test]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if subprocess.run(test, env=env, capture_output=True, timeout=30).returncode == 0:
            return True
        time.sleep(1.0)
    return False


@pytest.mark.broker
@pytest.mark.timeout(240)
def test_each_service_starts_as_its_container_would(container: Container) -> None:
    """topics completes; the processor (with its run API) and the archive writer pass their
    compose healthchecks and keep running, writing only under /data."""
    topics = SERVICES["topics"]
    log = container.root / "topics.log"
    done = container.run(container.argv(topics, {}), container.env(topics), log)
    assert done.wait(120) == 0, log.read_text()[-3000:]

    started: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for name, metrics_port, extra in (
            ("processor", 9464, {"--api-port": free_port()}),
            ("archive", 9465, {}),
        ):
            service, port = SERVICES[name], free_port()
            env = container.env(service)
            log = container.root / f"{name}.log"
            proc = container.run(container.argv(service, {"--metrics-port": port, **extra}), env, log)
            started.append((name, proc, log))
            assert _healthy(service, {metrics_port: port}, env, 90), f"{name}:\n{log.read_text()[-3000:]}"
        time.sleep(3.0)  # and they stay up
        for name, proc, log in started:
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        written = {str(p.relative_to(container.root)).split("/")[0] for p in container.root.rglob("*")}
        assert written <= {"app", "home", "data", "run", "topics.log", "processor.log", "archive.log"}, (
            written
        )
        assert (container.root / "data/archive/_writer.lock").is_file()  # the archive on the volume
        assert (container.root / "data/processor").is_dir()  # the processor's state on the volume
    finally:
        for _, proc, _ in started:
            proc.terminate()
        for _, proc, _ in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
