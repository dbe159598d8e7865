"""Deprecated: what was here before the split is `trainguard.torch`'s (docs/api.md). Kept
for a deprecation period so that a script's old imports run, with a warning."""

from ..common.moved import forwarder

__getattr__ = forwarder(
    __name__,
    {
        name: (f"trainguard.producers.checkpoint.train_state:{name}", "trainguard.torch")
        for name in ("TrainState", "ResumableSampler")
    },
)
