"""Pin every image docker-compose.yml pulls and every base image of the Dockerfile by digest,
and refresh the pins (issue 49). `scripts/pin-images` runs it:

    scripts/pin-images              # resolve each reference's tag now, rewrite the digests
    scripts/pin-images --dry-run    # the same, printing what would change, writing nothing
    scripts/pin-images --check      # offline: every reference carries a digest, the table agrees

A reference is written `name:tag@sha256:<64 hex>`: the tag says which release it is, the
digest is what is pulled (a digest makes the tag inert, so an upstream re-push of the tag
changes nothing until the pins are refreshed). The digest is the tag's *index* digest (the
OCI image index or Docker manifest list), so the pin holds on every platform the image is
built for, not only on the machine that resolved it.

Resolving needs the registry: the HTTP API by default (an anonymous token from the
registry's WWW-Authenticate challenge, then a HEAD of the tag's manifest, reading
Docker-Content-Digest; Docker Hub, ghcr.io, quay.io alike), or `crane digest`, or `docker
buildx imagetools inspect` (`--resolver`). To move to another release, edit the tag and run
the script: the old digest is replaced by the new tag's.

Every digest is recorded with where it came from and when in docs/deploy/images.md, between
the `pin-images` markers; the script rewrites that table (a row it could not resolve keeps
its source). Images compose builds itself (a service with `build:`) carry no digest: their
base images are the Dockerfile's, pinned here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = "docker-compose.yml"
DOCKERFILE = "Dockerfile"
TABLE = "docs/deploy/images.md"
TABLE_BEGIN = "<!-- pin-images: begin (scripts/pin-images rewrites this table) -->"
TABLE_END = "<!-- pin-images: end -->"

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: What a manifest HEAD accepts: an index first (the multi-platform pin), a single manifest
#: only for an image built for one platform.
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
ACCEPT = ", ".join((OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST))
DOCKER_HUB = "registry-1.docker.io"

_COMPOSE_IMAGE = re.compile(
    r"""^(?P<lead>[ \t]*(?:-[ \t]+)?image:[ \t]*)(?P<q>["']?)(?P<ref>[^\s"'#]+)(?P=q)""", re.M
)
_FROM = re.compile(r"^(?P<lead>[ \t]*FROM[ \t]+(?:--\S+[ \t]+)*)(?P<ref>\S+)(?P<rest>[^\n]*)$", re.M | re.I)
_STAGE = re.compile(r"\bAS[ \t]+(\S+)", re.I)


class PinError(RuntimeError):
    """A reference that cannot be resolved or rewritten."""


@dataclass(frozen=True)
class ImageRef:
    """`[registry/]repository[:tag][@digest]`, as written."""

    registry: str | None
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        rest, _, digest = text.partition("@")
        registry: str | None = None
        first, slash, remainder = rest.partition("/")
        if slash and ("." in first or ":" in first or first == "localhost"):
            registry, rest = first, remainder
        repository, tag = rest, None
        if ":" in rest.rsplit("/", 1)[-1]:
            repository, tag = rest.rsplit(":", 1)
        if not repository or (digest and not DIGEST.fullmatch(digest)) or (tag is not None and not tag):
            raise PinError(f"not an image reference: {text!r}")
        return cls(registry, repository, tag, digest or None)

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}" if self.registry else self.repository

    @property
    def tagged(self) -> str:
        """The reference without its digest: what a registry resolves."""
        return f"{self.name}:{self.tag}" if self.tag else self.name

    def __str__(self) -> str:
        return f"{self.tagged}@{self.digest}" if self.digest else self.tagged

    def pinned(self, digest: str) -> ImageRef:
        if not DIGEST.fullmatch(digest):
            raise PinError(f"{self.tagged}: not a sha256 digest: {digest!r}")
        return replace(self, digest=digest)

    def endpoint(self) -> tuple[str, str]:
        """The registry host to ask and the repository's path on it."""
        if self.registry in (None, "docker.io", "index.docker.io"):
            path = self.repository if "/" in self.repository else f"library/{self.repository}"
            return DOCKER_HUB, path
        assert self.registry is not None
        return self.registry, self.repository


@dataclass(frozen=True)
class Found:
    """One reference in a file: where its text is."""

    file: str
    line: int
    start: int
    end: int
    ref: ImageRef


def compose_references(text: str, file: str = COMPOSE) -> list[Found]:
    """Every `image:` of the compose file except those compose builds (a service with
    `build:`, the x- anchors it merges included)."""
    document = yaml.safe_load(text) or {}
    built = {
        str(service.get("image"))
        for service in (document.get("services") or {}).values()
        if isinstance(service, dict) and "build" in service
    }
    found = []
    for match in _COMPOSE_IMAGE.finditer(text):
        if match.group("ref") in built:
            continue
        line = text.count("\n", 0, match.start()) + 1
        found.append(
            Found(file, line, match.start("ref"), match.end("ref"), ImageRef.parse(match.group("ref")))
        )
    return found


def dockerfile_references(text: str, file: str = DOCKERFILE) -> list[Found]:
    """Every `FROM` image of the Dockerfile: not `scratch`, not an earlier stage."""
    stages: set[str] = set()
    found = []
    for match in _FROM.finditer(text):
        ref = match.group("ref")
        stage = _STAGE.search(match.group("rest"))
        if ref.lower() not in stages and ref != "scratch":
            if "$" in ref:
                raise PinError(f"{file}: FROM {ref}: a build argument cannot be pinned here; write the image")
            line = text.count("\n", 0, match.start()) + 1
            found.append(Found(file, line, match.start("ref"), match.end("ref"), ImageRef.parse(ref)))
        if stage:
            stages.add(stage.group(1).lower())
    return found


def rewrite(text: str, found: Iterable[Found], digests: dict[str, str]) -> str:
    """`text` with each found reference pinned to its tag's digest in `digests` (keyed by
    the tagged reference); references not in `digests` are left as they are."""
    for item in sorted(found, key=lambda f: f.start, reverse=True):
        digest = digests.get(item.ref.tagged)
        if digest is not None:
            text = text[: item.start] + str(item.ref.pinned(digest)) + text[item.end :]
    return text


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    image: str  # the tagged reference
    digest: str
    source: str
    date: str  # ISO date the digest was recorded


_ROW = re.compile(
    r"^\|\s*`(?P<image>[^`]+)`\s*\|\s*`(?P<digest>[^`]+)`\s*\|\s*(?P<source>.*?)\s*\|\s*(?P<date>[\d-]+)\s*\|$"
)
_HEADER = "| image | digest | evidence | recorded |\n| --- | --- | --- | --- |"


def _table_bounds(text: str) -> tuple[int, int]:
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise PinError(f"{TABLE}: the pin-images markers are missing")
    return begin + len(TABLE_BEGIN), end


def read_table(text: str) -> dict[str, Row]:
    start, end = _table_bounds(text)
    rows = {}
    for line in text[start:end].splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[match["image"]] = Row(match["image"], match["digest"], match["source"], match["date"])
    return rows


def write_table(text: str, rows: Iterable[Row]) -> str:
    start, end = _table_bounds(text)
    body = "\n".join(f"| `{r.image}` | `{r.digest}` | {r.source} | {r.date} |" for r in rows)
    return f"{text[:start]}\n{_HEADER}\n{body}\n{text[end:]}"


# --------------------------------------------------------------------------- resolving


class Response(Protocol):
    headers: Any

    def read(self) -> bytes: ...


Opener = Callable[[urllib.request.Request, float], Response]


def _urlopen(request: urllib.request.Request, timeout: float) -> Response:
    response: Response = urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 (https only)
    return response


def parse_challenge(header: str) -> dict[str, str]:
    """`Bearer realm="...",service="...",scope="..."` as a dict (and `scheme`)."""
    scheme, _, params = header.strip().partition(" ")
    values = dict(re.findall(r'(\w+)="([^"]*)"', params))
    return {"scheme": scheme.lower(), **values}


class HttpResolver:
    """The registry's HTTP API (the distribution spec), anonymously."""

    name = "registry HTTP API"

    def __init__(self, opener: Opener = _urlopen, timeout: float = 30.0) -> None:
        self.opener = opener
        self.timeout = timeout

    def _token(self, challenge: dict[str, str], path: str) -> str:
        if challenge.get("scheme") != "bearer" or "realm" not in challenge:
            raise PinError(f"unsupported registry challenge: {challenge}")
        query = {"scope": challenge.get("scope") or f"repository:{path}:pull"}
        if "service" in challenge:
            query["service"] = challenge["service"]
        url = f"{challenge['realm']}?{urllib.parse.urlencode(query)}"
        body = json.loads(self.opener(urllib.request.Request(url), self.timeout).read())
        token = body.get("token") or body.get("access_token")
        if not token:
            raise PinError(f"{url}: no token in the answer")
        return str(token)

    def digest(self, ref: ImageRef) -> str:
        host, path = ref.endpoint()
        url = f"https://{host}/v2/{path}/manifests/{ref.tag or 'latest'}"
        headers = {"Accept": ACCEPT}
        for attempt in range(2):
            request = urllib.request.Request(url, headers=headers, method="HEAD")
            try:
                response = self.opener(request, self.timeout)
                break
            except urllib.error.HTTPError as error:
                if error.code != 401 or attempt:
                    raise PinError(f"{ref.tagged}: {url}: HTTP {error.code}") from error
                challenge = parse_challenge(error.headers.get("WWW-Authenticate", ""))
                headers["Authorization"] = f"Bearer {self._token(challenge, path)}"
        digest = response.headers.get("Docker-Content-Digest")
        if not digest:  # a registry may leave it out of a HEAD: the digest of the manifest itself
            get = urllib.request.Request(url, headers=headers)
            digest = "sha256:" + hashlib.sha256(self.opener(get, self.timeout).read()).hexdigest()
        kind = response.headers.get("Content-Type", "")
        if kind not in (OCI_INDEX, DOCKER_LIST):
            print(f"  note: {ref.tagged} is a single-platform manifest ({kind})", file=sys.stderr)
        if not DIGEST.fullmatch(digest):
            raise PinError(f"{ref.tagged}: the registry answered {digest!r}")
        return str(digest)


class CommandResolver:
    """`crane digest REF` or `docker buildx imagetools inspect REF`: both give the index
    digest, with the machine's own registry credentials and mirrors."""

    def __init__(self, tool: str) -> None:
        self.name = tool
        if tool == "crane":
            self.argv = ["crane", "digest"]
        elif tool == "docker":
            self.argv = ["docker", "buildx", "imagetools", "inspect", "--format", "{{json .Manifest}}"]
        else:
            raise PinError(f"unknown resolver {tool!r}")
        if shutil.which(self.argv[0]) is None:
            raise PinError(f"{self.argv[0]} is not on PATH")

    def digest(self, ref: ImageRef) -> str:
        out = subprocess.run(
            [*self.argv, ref.tagged], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode != 0:
            raise PinError(f"{ref.tagged}: {' '.join(self.argv)}: {out.stderr.strip()}")
        text = out.stdout.strip()
        digest = json.loads(text)["digest"] if self.name == "docker" else text
        if not DIGEST.fullmatch(str(digest)):
            raise PinError(f"{ref.tagged}: {self.name} answered {text!r}")
        return str(digest)


class Resolver(Protocol):
    name: str

    def digest(self, ref: ImageRef) -> str: ...


# --------------------------------------------------------------------------- the repository


@dataclass
class Pins:
    """The pinned files of a repository, read and rewritten together."""

    root: Path

    def texts(self) -> dict[str, str]:
        return {name: (self.root / name).read_text() for name in (COMPOSE, DOCKERFILE, TABLE)}

    def references(self, texts: dict[str, str] | None = None) -> list[Found]:
        texts = texts or self.texts()
        return compose_references(texts[COMPOSE]) + dockerfile_references(texts[DOCKERFILE])

    def problems(self) -> list[str]:
        """What `--check` reports: a reference without a digest, a table that disagrees."""
        texts = self.texts()
        found = self.references(texts)
        rows = read_table(texts[TABLE])
        problems = [f"{f.file}:{f.line}: {f.ref} carries no digest" for f in found if f.ref.digest is None]
        pinned = {f.ref.tagged: f.ref.digest for f in found if f.ref.digest}
        for image, digest in pinned.items():
            row = rows.get(image)
            if row is None:
                problems.append(f"{TABLE}: no row for {image}")
            elif row.digest != digest:
                problems.append(f"{TABLE}: {image} is recorded as {row.digest}, pinned as {digest}")
        problems += [f"{TABLE}: {image} is pinned nowhere" for image in rows if image not in pinned]
        return problems

    def refresh(self, resolver: Resolver, today: str, dry_run: bool = False) -> tuple[list[str], list[str]]:
        """Resolve every reference's tag and rewrite the files with the digests resolved;
        returns what changed and what could not be resolved (left as it was)."""
        texts = self.texts()
        found = self.references(texts)
        digests: dict[str, str] = {}
        failures: list[str] = []
        for tagged in dict.fromkeys(f.ref.tagged for f in found):
            try:
                digests[tagged] = resolver.digest(ImageRef.parse(tagged))
            except (PinError, OSError, ValueError, subprocess.SubprocessError) as error:
                failures.append(f"{tagged}: {error}")
        changes = [
            f"{f.file}:{f.line}: {f.ref} -> {f.ref.pinned(digests[f.ref.tagged])}"
            for f in found
            if f.ref.tagged in digests and f.ref.digest != digests[f.ref.tagged]
        ]
        rows = read_table(texts[TABLE])
        source = f"{resolver.name}, `scripts/pin-images`"
        table = []
        for tagged in dict.fromkeys(f.ref.tagged for f in found):
            if tagged in digests:
                table.append(Row(tagged, digests[tagged], source, today))
            elif tagged in rows:
                table.append(rows[tagged])
        new = {
            COMPOSE: rewrite(texts[COMPOSE], [f for f in found if f.file == COMPOSE], digests),
            DOCKERFILE: rewrite(texts[DOCKERFILE], [f for f in found if f.file == DOCKERFILE], digests),
            TABLE: write_table(texts[TABLE], table),
        }
        if not dry_run:
            for name, text in new.items():
                if text != texts[name]:
                    (self.root / name).write_text(text)
        return changes, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/pin-images", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="offline: every reference carries a digest")
    mode.add_argument("--dry-run", action="store_true", help="resolve and print, write nothing")
    parser.add_argument("--resolver", choices=("http", "crane", "docker"), default="http")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    pins = Pins(args.root)
    try:
        if args.check:
            problems = pins.problems()
            for problem in problems:
                print(problem, file=sys.stderr)
            print(f"{len(pins.references())} image references, {len(problems)} problems")
            return 1 if problems else 0
        resolver: Resolver = HttpResolver() if args.resolver == "http" else CommandResolver(args.resolver)
        today = dt.datetime.now(dt.UTC).date().isoformat()
        changes, failures = pins.refresh(resolver, today, dry_run=args.dry_run)
    except PinError as error:
        print(f"pin-images: {error}", file=sys.stderr)
        return 1
    for change in changes:
        print(change)
    for failure in failures:
        print(f"pin-images: not resolved, left as it was: {failure}", file=sys.stderr)
    print(
        f"{len(changes)} pins {'would change' if args.dry_run else 'changed'}, {len(failures)} not resolved"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
