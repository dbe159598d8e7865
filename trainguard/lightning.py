"""What a PyTorch Lightning job imports from trainguard (docs/api.md)::

    from trainguard.lightning import TrainguardLightningCallback

    trainer = pl.Trainer(..., callbacks=[TrainguardLightningCallback()])

Lazy (PEP 562): importing this module imports neither torch nor Lightning (the
``lightning`` extra); the callback is imported the first time it is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.common.lazy import lazy_exports

if TYPE_CHECKING:
    from trainguard.producers.training.lightning import TrainguardLightningCallback

EXPORTS: dict[str, str] = {"TrainguardLightningCallback": "trainguard.producers.training.lightning"}

__all__ = ["TrainguardLightningCallback"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), EXPORTS)
