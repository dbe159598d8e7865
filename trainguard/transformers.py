"""What a Hugging Face ``transformers`` Trainer job imports from trainguard (docs/api.md)::

    from trainguard.transformers import TrainguardTrainerCallback

    trainer = Trainer(..., callbacks=[TrainguardTrainerCallback()])

Lazy (PEP 562): importing this module imports neither torch nor transformers (the ``hf``
extra); the callback is imported the first time it is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.common.lazy import lazy_exports

if TYPE_CHECKING:
    from trainguard.producers.training.hf_trainer import TrainguardTrainerCallback

EXPORTS: dict[str, str] = {"TrainguardTrainerCallback": "trainguard.producers.training.hf_trainer"}

__all__ = ["TrainguardTrainerCallback"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), EXPORTS)
