"""What a PyTorch Lightning job imports from trainguard (docs/api.md)::

    from trainguard.lightning import TrainguardLightningCallback

    trainer = pl.Trainer(..., callbacks=[TrainguardLightningCallback()])

Lazy (PEP 562): importing this module imports neither torch nor Lightning (the
``lightning`` extra); the callback is imported the first time it is read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.producers.training.lightning import TrainguardLightningCallback

EXPORTS: dict[str, str] = {"TrainguardLightningCallback": "trainguard.producers.training.lightning"}

__all__ = ["TrainguardLightningCallback"]


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
