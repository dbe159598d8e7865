"""Command authentication: HMAC-SHA256 with a per-run key.

The per-run key is HMAC(master secret, run_id): processors and rank actuators that
share the master secret derive the same key, and a key leaked from one run cannot
sign commands for another. The signature covers the command's canonical JSON
(every field but `signature`, keys sorted), which includes `run_id`, `attempt` and
`command_id`, so a command replayed into another run or attempt fails verification
and a replay within the run is caught by the actuator's command_id dedupe.

The master secret never lives in the repository: it comes from the environment
variable TRAINGUARD_SECRET, or from the file named by TRAINGUARD_SECRET_FILE.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import TypeVar

import orjson

from .commands import Command

SECRET_ENV = "TRAINGUARD_SECRET"
SECRET_FILE_ENV = "TRAINGUARD_SECRET_FILE"
_MIN_SECRET_BYTES = 16

C = TypeVar("C", bound=Command)


class SecretError(RuntimeError):
    pass


def run_key(master_secret: bytes, run_id: str) -> bytes:
    return hmac.new(master_secret, b"trainguard-run:" + run_id.encode(), hashlib.sha256).digest()


def _canonical(command: Command) -> bytes:
    body = command.model_dump(mode="json", exclude={"signature"})
    body["schema"] = command.schema_name()
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def sign(command: C, key: bytes) -> C:
    mac = hmac.new(key, _canonical(command), hashlib.sha256).hexdigest()
    return command.model_copy(update={"signature": mac})


def verify(command: Command, key: bytes) -> bool:
    expected = hmac.new(key, _canonical(command), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, command.signature)


def load_master_secret(env: dict[str, str] | None = None) -> bytes:
    """The master secret from TRAINGUARD_SECRET or the file in TRAINGUARD_SECRET_FILE."""
    env = dict(os.environ) if env is None else env
    if value := env.get(SECRET_ENV):
        secret = value.encode()
    elif path := env.get(SECRET_FILE_ENV):
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise SecretError(f"{SECRET_FILE_ENV}={path}: cannot read the secret file ({exc})") from exc
    else:
        raise SecretError(
            f"no command-signing secret: set {SECRET_ENV} or point {SECRET_FILE_ENV} at a file "
            "(`trainguard secret init` writes one)"
        )
    if len(secret) < _MIN_SECRET_BYTES:
        raise SecretError(f"the command-signing secret is shorter than {_MIN_SECRET_BYTES} bytes")
    return secret


def write_secret_file(path: Path) -> Path:
    """Create a fresh random secret file readable by its owner only (kept if it exists)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
    return path
