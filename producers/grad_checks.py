"""Deprecated: `flip_bit`, the drill's fault, is `trainguard.torch`'s (docs/api.md). Kept for
a deprecation period so that a script's old import runs, with a warning."""

from ..common.moved import forwarder

__getattr__ = forwarder(
    __name__, {"flip_bit": ("trainguard.producers.training.grad_checks:flip_bit", "trainguard.torch")}
)
