"""scripts/pin-images (harness/devtools/pin_images.py), without a registry: the references
found and rewritten in fixtures shaped like docker-compose.yml and the Dockerfile, the
evidence table, and the registry HTTP exchange against a fake registry."""

from __future__ import annotations

import email.message
import hashlib
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.devtools import pin_images
from harness.devtools.pin_images import (
    ACCEPT,
    DOCKER_LIST,
    HttpResolver,
    ImageRef,
    PinError,
    Pins,
    Row,
    compose_references,
    dockerfile_references,
    read_table,
    rewrite,
    write_table,
)

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64

COMPOSE = f"""\
x-ours: &ours
  build: .
  image: ours:local          # built here
  user: "1000:1000"

services:
  app:
    <<: *ours
    command: ["serve"]
  kafka:
    image: apache/kafka:4.1.1
    user: appuser
  prometheus:
    image: "prom/prometheus:v2.55.1@{OLD}"   # pinned already
  grafana:
    image: 'ghcr.io/grafana/grafana:11.3.0'
"""

DOCKERFILE = f"""\
# syntax=docker/dockerfile:1
FROM python:3.11.16-trixie AS compiled
RUN true

FROM --platform=linux/amd64 python:3.11.16-slim-trixie@{OLD}
COPY --from=compiled /src /src
FROM compiled AS again
FROM scratch
"""

TABLE = f"""\
# images

<!-- pin-images: begin (scripts/pin-images rewrites this table) -->
| image | digest | evidence | recorded |
| --- | --- | --- | --- |
| `prom/prometheus:v2.55.1` | `{OLD}` | a record, somewhere | 2026-12-01 |
| `python:3.11.16-slim-trixie` | `{OLD}` | [repo-info](https://example.org/a|b) | 2026-12-01 |
<!-- pin-images: end -->

after the table
"""


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("python:3.11", None, "python", "3.11", None),
        (f"grafana/grafana:11.3.0@{OLD}", None, "grafana/grafana", "11.3.0", OLD),
        ("localhost:5000/team/app:1.2", "localhost:5000", "team/app", "1.2", None),
        ("ghcr.io/owner/repo", "ghcr.io", "owner/repo", None, None),
        (f"quay.io/prometheus/alertmanager@{OLD}", "quay.io", "prometheus/alertmanager", None, OLD),
        ("registry:5000/app", "registry:5000", "app", None, None),
    ],
)
def test_a_reference_is_parsed_and_written_back_as_it_was(
    text: str, registry: str | None, repository: str, tag: str | None, digest: str | None
) -> None:
    ref = ImageRef.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert str(ref) == text


@pytest.mark.parametrize("text", ["python:3.11@sha256:abc", "python:", "python@md5:" + "a" * 32, ":tag"])
def test_a_malformed_reference_is_refused(text: str) -> None:
    with pytest.raises(PinError):
        ImageRef.parse(text)


def test_docker_hub_names_get_their_library_path_and_other_registries_are_asked_themselves() -> None:
    assert ImageRef.parse("python:3.11").endpoint() == ("registry-1.docker.io", "library/python")
    assert ImageRef.parse("docker.io/grafana/grafana:1").endpoint() == (
        "registry-1.docker.io",
        "grafana/grafana",
    )
    assert ImageRef.parse("ghcr.io/o/r:1").endpoint() == ("ghcr.io", "o/r")
    assert str(ImageRef.parse(f"python:3.11@{OLD}").pinned(NEW)) == f"python:3.11@{NEW}"
    with pytest.raises(PinError):
        ImageRef.parse("python:3.11").pinned("sha256:short")


def test_compose_images_are_found_except_the_ones_compose_builds() -> None:
    found = compose_references(COMPOSE)
    assert [(f.line, str(f.ref)) for f in found] == [
        (11, "apache/kafka:4.1.1"),
        (14, f"prom/prometheus:v2.55.1@{OLD}"),
        (16, "ghcr.io/grafana/grafana:11.3.0"),
    ]
    assert all(COMPOSE[f.start : f.end] == str(f.ref) for f in found)


def test_dockerfile_base_images_are_found_but_not_its_stages_or_scratch() -> None:
    found = dockerfile_references(DOCKERFILE)
    assert [(f.line, str(f.ref)) for f in found] == [
        (2, "python:3.11.16-trixie"),
        (5, f"python:3.11.16-slim-trixie@{OLD}"),
    ]
    with pytest.raises(PinError, match="build argument"):
        dockerfile_references("ARG BASE=python:3.11\nFROM ${BASE}\n")


def test_rewriting_pins_each_tag_and_leaves_everything_else_as_it_was() -> None:
    digests = {
        "apache/kafka:4.1.1": NEW,
        "prom/prometheus:v2.55.1": NEW,
        # grafana not resolved: left as it is
    }
    text = rewrite(COMPOSE, compose_references(COMPOSE), digests)
    assert f"    image: apache/kafka:4.1.1@{NEW}\n    user: appuser\n" in text
    assert f'    image: "prom/prometheus:v2.55.1@{NEW}"   # pinned already\n' in text
    assert "    image: 'ghcr.io/grafana/grafana:11.3.0'\n" in text
    assert text.replace(NEW, OLD).replace(f"4.1.1@{OLD}", "4.1.1") == COMPOSE  # nothing else moved
    assert rewrite(text, compose_references(text), digests) == text  # idempotent

    docker = rewrite(DOCKERFILE, dockerfile_references(DOCKERFILE), {"python:3.11.16-trixie": OTHER})
    assert f"FROM python:3.11.16-trixie@{OTHER} AS compiled\n" in docker
    assert f"FROM --platform=linux/amd64 python:3.11.16-slim-trixie@{OLD}\n" in docker


def test_the_evidence_table_is_read_and_rewritten_between_its_markers() -> None:
    rows = read_table(TABLE)
    assert list(rows) == ["prom/prometheus:v2.55.1", "python:3.11.16-slim-trixie"]
    assert rows["python:3.11.16-slim-trixie"].source == "[repo-info](https://example.org/a|b)"
    new = write_table(TABLE, [Row("x:1", NEW, "registry HTTP API, `scripts/pin-images`", "2026-12-24")])
    assert new.startswith("# images\n\n<!-- pin-images: begin") and new.endswith(
        "<!-- pin-images: end -->\n\nafter the table\n"
    )
    assert read_table(new) == {
        "x:1": Row("x:1", NEW, "registry HTTP API, `scripts/pin-images`", "2026-12-24")
    }
    with pytest.raises(PinError, match="markers"):
        read_table("no table here")


class FakeResolver:
    name = "fake registry"

    def __init__(self, digests: dict[str, str]) -> None:
        self.digests = digests
        self.asked: list[str] = []

    def digest(self, ref: ImageRef) -> str:
        self.asked.append(str(ref))
        if ref.tagged not in self.digests:
            raise PinError(f"{ref.tagged}: HTTP 404")
        return self.digests[ref.tagged]


def _repository(tmp_path: Path) -> Path:
    (tmp_path / "docs/deploy").mkdir(parents=True)
    (tmp_path / "docker-compose.yml").write_text(COMPOSE)
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    (tmp_path / "docs/deploy/images.md").write_text(TABLE)
    return tmp_path


def test_a_refresh_rewrites_the_files_and_the_table_and_keeps_what_it_could_not_resolve(
    tmp_path: Path,
) -> None:
    pins = Pins(_repository(tmp_path))
    assert pins.problems() == [
        "docker-compose.yml:11: apache/kafka:4.1.1 carries no digest",
        "docker-compose.yml:16: ghcr.io/grafana/grafana:11.3.0 carries no digest",
        "Dockerfile:2: python:3.11.16-trixie carries no digest",
    ]
    resolver = FakeResolver(
        {
            "apache/kafka:4.1.1": NEW,
            "prom/prometheus:v2.55.1": OLD,  # unchanged
            "ghcr.io/grafana/grafana:11.3.0": NEW,
            "python:3.11.16-trixie": OTHER,
        }
    )
    before = pins.texts()
    changes, failures = pins.refresh(resolver, "2026-12-24", dry_run=True)
    assert pins.texts() == before  # a dry run writes nothing
    changes, failures = pins.refresh(resolver, "2026-12-24")
    assert resolver.asked[-5:] == [  # each tag once, without the digest it had
        "apache/kafka:4.1.1",
        "prom/prometheus:v2.55.1",
        "ghcr.io/grafana/grafana:11.3.0",
        "python:3.11.16-trixie",
        "python:3.11.16-slim-trixie",
    ]
    assert failures == ["python:3.11.16-slim-trixie: python:3.11.16-slim-trixie: HTTP 404"]
    assert changes == [
        f"docker-compose.yml:11: apache/kafka:4.1.1 -> apache/kafka:4.1.1@{NEW}",
        f"docker-compose.yml:16: ghcr.io/grafana/grafana:11.3.0 -> ghcr.io/grafana/grafana:11.3.0@{NEW}",
        f"Dockerfile:2: python:3.11.16-trixie -> python:3.11.16-trixie@{OTHER}",
    ]
    rows = read_table((tmp_path / "docs/deploy/images.md").read_text())
    source = "fake registry, `scripts/pin-images`"
    assert rows == {
        "apache/kafka:4.1.1": Row("apache/kafka:4.1.1", NEW, source, "2026-12-24"),
        "prom/prometheus:v2.55.1": Row("prom/prometheus:v2.55.1", OLD, source, "2026-12-24"),
        "ghcr.io/grafana/grafana:11.3.0": Row("ghcr.io/grafana/grafana:11.3.0", NEW, source, "2026-12-24"),
        "python:3.11.16-trixie": Row("python:3.11.16-trixie", OTHER, source, "2026-12-24"),
        # not resolved: the row as it was
        "python:3.11.16-slim-trixie": Row(
            "python:3.11.16-slim-trixie", OLD, "[repo-info](https://example.org/a|b)", "2026-12-01"
        ),
    }
    assert pins.problems() == []
    assert pin_images.main(["--check", "--root", str(tmp_path)]) == 0


def test_check_fails_on_a_table_that_disagrees_with_the_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _repository(tmp_path)
    assert pin_images.main(["--check", "--root", str(root)]) == 1
    (root / "docs/deploy/images.md").write_text(TABLE.replace(f"`{OLD}` | a record", f"`{NEW}` | a record"))
    problems = Pins(root).problems()
    assert f"docs/deploy/images.md: prom/prometheus:v2.55.1 is recorded as {NEW}, pinned as {OLD}" in problems
    assert "docs/deploy/images.md: no row for python:3.11.16-slim-trixie" not in problems
    assert "carries no digest" in capsys.readouterr().err


# --------------------------------------------------------------------------- the registry


class FakeResponse:
    def __init__(self, headers: dict[str, str], body: bytes = b"") -> None:
        self.headers = email.message.Message()
        for key, value in headers.items():
            self.headers[key] = value
        self.body = body

    def read(self) -> bytes:
        return self.body


class FakeRegistry:
    """Docker Hub's exchange: 401 with a Bearer challenge, an anonymous token, the digest."""

    def __init__(self, digest_header: bool = True) -> None:
        self.requests: list[urllib.request.Request] = []
        self.digest_header = digest_header
        self.manifest = b'{"mediaType": "' + DOCKER_LIST.encode() + b'", "manifests": []}'

    def __call__(self, request: urllib.request.Request, timeout: float) -> FakeResponse:
        self.requests.append(request)
        url = request.full_url
        if url.startswith("https://auth.docker.io/token?"):
            return FakeResponse({}, json.dumps({"token": "anonymous-token"}).encode())
        assert url == "https://registry-1.docker.io/v2/library/python/manifests/3.11.16-slim-trixie", url
        if request.get_header("Authorization") != "Bearer anonymous-token":
            headers = email.message.Message()
            headers["WWW-Authenticate"] = (
                'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                'scope="repository:library/python:pull"'
            )
            raise urllib.error.HTTPError(url, 401, "Unauthorized", headers, io.BytesIO())
        headers = {"Content-Type": DOCKER_LIST}
        if self.digest_header:
            headers["Docker-Content-Digest"] = NEW
        return FakeResponse(headers, self.manifest if request.get_method() == "GET" else b"")


def test_the_http_resolver_takes_an_anonymous_token_and_reads_the_index_digest() -> None:
    registry = FakeRegistry()
    ref = ImageRef.parse(f"python:3.11.16-slim-trixie@{OLD}")
    assert HttpResolver(opener=registry).digest(ref) == NEW
    first, token, second = registry.requests
    assert first.get_method() == "HEAD" and first.get_header("Accept") == ACCEPT
    assert ACCEPT.startswith("application/vnd.oci.image.index.v1+json, " + DOCKER_LIST)
    assert token.full_url == (
        "https://auth.docker.io/token?scope=repository%3Alibrary%2Fpython%3Apull&service=registry.docker.io"
    )
    assert second.get_method() == "HEAD" and second.get_header("Authorization") == "Bearer anonymous-token"


def test_without_the_digest_header_the_manifest_itself_is_hashed() -> None:
    registry = FakeRegistry(digest_header=False)
    digest = HttpResolver(opener=registry).digest(ImageRef.parse("python:3.11.16-slim-trixie"))
    assert digest == "sha256:" + hashlib.sha256(registry.manifest).hexdigest()
    assert registry.requests[-1].get_method() == "GET"


def test_a_registry_error_is_reported_with_the_image() -> None:
    def refusing(request: urllib.request.Request, timeout: float) -> FakeResponse:
        raise urllib.error.HTTPError(
            request.full_url, 404, "Not Found", email.message.Message(), io.BytesIO()
        )

    with pytest.raises(PinError, match=r"python:3.11.16-slim-trixie: .*HTTP 404"):
        HttpResolver(opener=refusing).digest(ImageRef.parse("python:3.11.16-slim-trixie"))
