"""Lazy public modules (PEP 562): `trainguard.torch`, `trainguard.lightning` and
`trainguard.transformers` name what a training script imports without importing torch or a
framework until a name is first read. Imports nothing of the project (trainguard/common)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    module_name: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module's ``__getattr__`` and ``__dir__``: `exports` maps each public name to the
    module that defines it (a name equal to its module's last part is that module itself).
    A name read once is stored in `namespace`, so later reads are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module = importlib.import_module(source)
        value = module if source.rpartition(".")[2] == name else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
