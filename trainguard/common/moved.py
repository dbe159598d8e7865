"""Names that moved to the public API (docs/api.md), kept working for a deprecation period.

A training script imports from the public modules (`trainguard.torch`, `trainguard.lightning`,
`trainguard.transformers`). Scripts written against the layout before them reach into the
package (`trainguard.producers.training.supervisor.Supervisor`, the pre-split
`trainguard.producers.checkpoint.CheckpointManager`, `trainguard.producers.train_state`): those
names keep working and warn with a :class:`DeprecationWarning` that names the new import.

Two cases:

- a name that is no longer where it was (a module that became a package, a renamed class, a
  module that moved): the old module answers it through :func:`forwarder`, a PEP 562
  ``__getattr__`` that warns and returns the new object;
- a name still defined in its implementation module, which the package itself imports from
  there: :func:`deprecate_names` makes reading it warn, but only when the reader's own source
  names it (``from module import Name``, ``module.Name``) and the reader is not trainguard's own
  code, its tests or its benchmarks. Pickle, ``hasattr``, ``inspect`` and the import system
  read the same attribute without warning.

Imports nothing of the project (trainguard/common).
"""

from __future__ import annotations

import dis
import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

#: How long a deprecated name keeps working (docs/api.md, "Compatibility").
REMOVAL = "at least two more minor releases"

#: Trainguard's own code, which imports its implementation modules by their paths.
_OWN_PREFIXES = ("trainguard.", "tests.", "bench.")
#: The repository's tests and benchmarks, whose scripts run as ``__main__`` (a rank program,
#: a bench): absent from an installed wheel, so a user's script is never taken for them.
_REPO = Path(__file__).resolve().parents[2]
_OWN_DIRS = tuple(str(_REPO / folder) + "/" for folder in ("tests", "bench"))
#: The instructions by which source code names an attribute (CPython 3.11+).
_NAMING_OPS = frozenset(
    dis.opmap[name] for name in ("IMPORT_FROM", "LOAD_ATTR", "LOAD_METHOD") if name in dis.opmap
)


def message(old: str, name: str, new_module: str, new_name: str | None = None) -> str:
    new_name = new_name or name
    renamed = "" if new_name == name else f" (renamed from {name})"
    return (
        f"{old}.{name} is deprecated; use `from {new_module} import {new_name}`{renamed} (docs/api.md). "
        f"The old path keeps working for {REMOVAL}."
    )


def warn(old: str, name: str, new_module: str, new_name: str | None = None, stacklevel: int = 3) -> None:
    warnings.warn(message(old, name, new_module, new_name), DeprecationWarning, stacklevel=stacklevel)


def forwarder(old: str, moved: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that left module `old`: `moved` maps each old name
    to where it is read from (``"impl.module:Name"``, or ``"impl.module"`` for a module) and
    the public module the warning names: ``{"Old": ("impl.module:New", "public.module")}``."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        source, public = moved[name]
        module_name, attribute, new_name = source.partition(":")
        module = importlib.import_module(module_name)
        if not _import_probe(sys._getframe(1)):  # `from old import name` asks twice
            warn(old, name, public, new_name or None)
        return getattr(module, new_name) if attribute else module

    return __getattr__


def _import_probe(frame: FrameType | None) -> bool:
    """Whether the reader is the import system checking a ``from module import name``'s
    names (the statement itself reads the name next, and warns then)."""
    return frame is not None and frame.f_globals.get("__name__") == "importlib._bootstrap"


def _named_by_outsider(frame: FrameType | None) -> bool:
    """Whether `frame` (the reader's) names the attribute in its own source and is not
    trainguard's own code: only then does reading a deprecated name warn."""
    if frame is None:
        return False
    module = frame.f_globals.get("__name__", "")
    if module == "trainguard" or module.startswith(_OWN_PREFIXES):
        return False
    if frame.f_code.co_filename.startswith(_OWN_DIRS):
        return False
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] in _NAMING_OPS


class _Deprecating(ModuleType):
    """A module whose listed names warn when an outsider's source reads them."""

    _trainguard_moved: dict[str, str] = {}


def deprecate_names(module_name: str, public: str, names: Mapping[str, str] | tuple[str, ...]) -> None:
    """Make each of `names`, defined in module `module_name`, warn when a user's code reads it
    there (module docstring): the new import is ``from <public> import <name>`` (a mapping:
    old name -> its public name). The module's own globals are untouched."""
    module = sys.modules[module_name]
    renamed = dict(names) if isinstance(names, Mapping) else {n: n for n in names}
    attrs: dict[str, Any] = {"_trainguard_moved": renamed}
    for name, new_name in renamed.items():
        attrs[name] = _warning_property(module_name, name, public, new_name)
    module.__class__ = type(f"Deprecating[{module_name}]", (_Deprecating,), attrs)


def _warning_property(module_name: str, name: str, public: str, new_name: str) -> property:
    def get(self: ModuleType) -> Any:
        try:
            value = self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None
        if _named_by_outsider(sys._getframe(1)):
            warn(module_name, name, public, new_name)
        return value

    def set_(self: ModuleType, value: Any) -> None:
        self.__dict__[name] = value

    def delete(self: ModuleType) -> None:
        del self.__dict__[name]

    return property(get, set_, delete)
