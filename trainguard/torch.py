"""What a torch training script imports from trainguard (docs/api.md)::

    from trainguard.torch import CheckpointManager, Supervisor, TrainState, inprocess, init_process_group

Lazy (PEP 562): importing this module imports neither torch nor the rank side; each name is
imported from its implementation module the first time it is read, so the processors, the
archive and the command line run without the ``train`` extra. The implementation modules'
paths are not public: they may move in any release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.common.lazy import lazy_exports

if TYPE_CHECKING:
    from trainguard.producers.checkpoint.manager import CheckpointError, CheckpointManager
    from trainguard.producers.checkpoint.train_state import ResumableSampler, TrainState
    from trainguard.producers.training import inprocess
    from trainguard.producers.training.config import NonFiniteLoss, SupervisorConfig, init_process_group
    from trainguard.producers.training.elastic import ElasticBatches, shards_from_env
    from trainguard.producers.training.grad_checks import flip_bit
    from trainguard.producers.training.supervisor import Supervisor

#: Each public name and the module it lives in (a module itself when the name is the
#: module's last part: `inprocess`).
EXPORTS: dict[str, str] = {
    "Supervisor": "trainguard.producers.training.supervisor",
    "SupervisorConfig": "trainguard.producers.training.config",
    "NonFiniteLoss": "trainguard.producers.training.config",
    "init_process_group": "trainguard.producers.training.config",
    "inprocess": "trainguard.producers.training.inprocess",
    "CheckpointManager": "trainguard.producers.checkpoint.manager",
    "CheckpointError": "trainguard.producers.checkpoint.manager",
    "TrainState": "trainguard.producers.checkpoint.train_state",
    "ResumableSampler": "trainguard.producers.checkpoint.train_state",
    "ElasticBatches": "trainguard.producers.training.elastic",
    "shards_from_env": "trainguard.producers.training.elastic",
    "flip_bit": "trainguard.producers.training.grad_checks",
}

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ElasticBatches",
    "NonFiniteLoss",
    "ResumableSampler",
    "Supervisor",
    "SupervisorConfig",
    "TrainState",
    "flip_bit",
    "init_process_group",
    "inprocess",
    "shards_from_env",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), EXPORTS)
