"""What a Hugging Face ``transformers`` Trainer job imports from trainguard (docs/api.md)::

    from trainguard.transformers import TrainguardTrainerCallback

    trainer = Trainer(..., callbacks=[TrainguardTrainerCallback()])

Lazy (PEP 562): importing this module imports neither torch nor transformers (the ``hf``
extra); the callback is imported the first time it is read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.producers.training.hf_trainer import TrainguardTrainerCallback

EXPORTS: dict[str, str] = {"TrainguardTrainerCallback": "trainguard.producers.training.hf_trainer"}

__all__ = ["TrainguardTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
