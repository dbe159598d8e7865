"""The variables a rank's imports read (torch's OpenMP threads, ``OMP_NUM_THREADS`` read when
libgomp loads with torch), and the launcher's own import of torch made with the ranks'
values, so that its fork server can be its own fork (:func:`.fork_server.prefork`).

Imports no torch: the CLI uses it before its first import of torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

#: The variables a fork server starts with as the ranks get them: read when torch is imported.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: The import-time variables this process imported torch with, when imported under
#: :func:`importing_as_ranks` (None: imported otherwise, or not yet).
_torch_imported_with: dict[str, str] | None = None


def omp_threads(local_world: int) -> dict[str, str]:
    """torchrun's OMP_NUM_THREADS: the launcher's own if set, else 1 when a host runs
    more than one rank (so N ranks do not each start a thread per core), else unset."""
    if "OMP_NUM_THREADS" in os.environ:
        return {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    return {"OMP_NUM_THREADS": "1"} if local_world > 1 else {}


def import_time(env: Mapping[str, str] | None) -> dict[str, str]:
    """`env`'s variables that torch's import reads (a fork server's key among a launcher's)."""
    return {k: env[k] for k in IMPORT_TIME_ENV if env and k in env}


def with_import_time(env: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str]:
    """`env` with `wanted` as its import-time variables (a fork server's environment)."""
    return {**{k: v for k, v in env.items() if k not in IMPORT_TIME_ENV}, **wanted}


@contextmanager
def importing_as_ranks(local_world: int) -> Iterator[None]:
    """Within: torch, when this imports it, is imported with the import-time variables of
    ranks `local_world` to a host (this process's environment as it was, after). A launcher
    does no tensor work of its own; its fork (the fork server) then imports nothing again."""
    global _torch_imported_with
    if "torch" in sys.modules:  # imported before (a plugin, a test's process): not known how
        yield
        return
    saved = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
    os.environ.update(omp_threads(local_world))
    try:
        yield
    finally:
        if "torch" in sys.modules:
            _torch_imported_with = import_time(os.environ)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def torch_imported_with() -> dict[str, str] | None:
    """The import-time variables of this process's torch (None: not imported under
    :func:`importing_as_ranks`)."""
    return _torch_imported_with
