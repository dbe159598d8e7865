"""The local broker's toolchain and jars: a Java 17+ to run Kafka on, and Maven to copy the
runtime classpath of `kafka_2.13` (see `pom.xml` next to this file) from Maven Central into
a cache directory, once, under a file lock so that concurrent processes fetch it only once.
Apart from local_broker.py because finding tools and caching jars is its own job: tests and
the stack ensure the jars before any broker exists."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from trainguard.kafka.errors import BrokerError

KAFKA_VERSION = "4.1.1"
MIN_JAVA_MAJOR = 17
INSTALL_HINT = "on Debian/Ubuntu: apt-get install openjdk-17-jre-headless maven"

POM_PATH = Path(__file__).resolve().parent / "pom.xml"
_STAMP = "jars.ok"


class MissingToolError(BrokerError):
    """`java` (17+) or `mvn` is not installed."""


def cache_root() -> Path:
    """The development tooling's cache, shared by every clone on the machine:
    `$TRAINGUARD_CACHE`, else `~/.cache/trainguard`."""
    base = os.environ.get("TRAINGUARD_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "trainguard"


def default_cache_dir() -> Path:
    """`$TRAINGUARD_CACHE/kafka-4.1.1`, else `~/.cache/trainguard/kafka-4.1.1`."""
    return cache_root() / f"kafka-{KAFKA_VERSION}"


def parse_java_major(version_output: str) -> int:
    """Major version from `java -version` output: '17.0.15' -> 17, '1.8.0_392' -> 8."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        raise BrokerError(f"cannot read the Java version from: {version_output.strip()!r}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def java_major_version(java: str) -> int:
    """Run `java -version` (it prints on stderr) and return the major version."""
    proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    return parse_java_major(proc.stderr + proc.stdout)


def find_java() -> str:
    """Path of a `java` 17+ on PATH, or MissingToolError saying how to install one."""
    java = shutil.which("java")
    if java is None:
        raise MissingToolError(
            f"`java` not found on PATH: the local Kafka broker needs Java {MIN_JAVA_MAJOR}+ ({INSTALL_HINT})"
        )
    major = java_major_version(java)
    if major < MIN_JAVA_MAJOR:
        raise MissingToolError(
            f"{java} is Java {major}; Kafka {KAFKA_VERSION} needs Java {MIN_JAVA_MAJOR}+ ({INSTALL_HINT})"
        )
    return java


def find_mvn() -> str:
    """Path of `mvn` on PATH, or MissingToolError saying how to install it."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            "`mvn` (Apache Maven) not found on PATH: it fetches the Kafka jars from Maven "
            f"Central, once ({INSTALL_HINT})"
        )
    return mvn


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so that concurrent processes run mvn only once."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_jars(cache_dir: Path | None = None) -> Path:
    """Return a directory holding every jar the broker needs, fetching them once.

    Jars live in `<cache_dir>/<sha256 of pom.xml>/libs` (`cache_dir` defaults to
    `default_cache_dir()`); a stamp file next to them marks a complete copy, so later calls
    neither run `mvn` nor download anything. Editing pom.xml changes the key. Java 17+ is
    checked on every call; `mvn` only when the jars are missing.
    """
    find_java()
    pom = POM_PATH.read_bytes()
    target = (cache_dir or default_cache_dir()) / hashlib.sha256(pom).hexdigest()[:16]
    libs, stamp = target / "libs", target / _STAMP
    if stamp.is_file():
        return libs
    mvn = find_mvn()
    target.mkdir(parents=True, exist_ok=True)
    with _file_lock(target / ".lock"):
        if stamp.is_file():  # another process fetched them while we waited
            return libs
        partial = target / "libs.partial"
        shutil.rmtree(partial, ignore_errors=True)
        (target / "pom.xml").write_bytes(pom)  # mvn may write next to its pom: not in the package
        cmd = [
            mvn,
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(target / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={partial}",
            "-DincludeScope=runtime",
        ]
        proc = subprocess.run(cmd, cwd=target, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not (partial / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise BrokerError(f"mvn could not fetch the Kafka jars (exit {proc.returncode}):\n{tail}")
        shutil.rmtree(libs, ignore_errors=True)
        partial.rename(libs)
        jars = sorted(p.name for p in libs.glob("*.jar"))
        stamp.write_text(json.dumps({"kafka": KAFKA_VERSION, "jars": jars}, indent=1) + "\n")
    return libs
