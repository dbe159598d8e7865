"""FSDP (``fully_shard``, FSDP2) under the supervisor: the self-check replay on every rank at
once, and the compute time before the gradient collectives.

Self-check. A sharded model's forward all-gathers its parameters, so a replay on the
commanded rank alone would wait in that collective for ranks that never join. The rank a
RunSelfCheck names therefore takes it in ``check()`` and offers it to the ranks'
agreement (one more integer of :mod:`.agreement`'s MAX all-reduce, no extra collective);
at the end of that step EVERY rank replays the step's batch twice, each with its own
batch. The replay runs under ``set_requires_gradient_sync(False)``: FSDP2 then skips the
reduce-scatter and leaves each parameter's gradient UNSHARDED and UNREDUCED on its
unsharded parameter (``FSDPParam._unsharded_param.grad``, the full-size gradient of this
rank's batch alone), and those are digested. A reduced gradient would carry a faulty
device's error to every rank and blame them all; the local one is this device's own
arithmetic, bitwise repeatable on a healthy device. The forwards' all-gathers only move
parameters, which every rank agrees on bitwise. After the replay the unsharded gradients
are dropped and FSDP's pending post-backward state is cleared, so the next step's
backward reduces only its own gradients: a run with a self-check continues bitwise like
one without (tests/producers/training/test_fsdp.py). The commanded rank reports the
result (SdcSelfCheck); another rank reports its own only on a mismatch (evidence is not
dropped). Without the agreement (no ``check()``, ``agree_on_skip=False``) the check is
dropped with a warning unless the world is one rank. A ring cross-rank check is
replayed the same way (every rank recomputes at the step agreed for it, its own batch and
its neighbour's, from its own unreduced gradients); so is a three-rank cross check, whose
ranks not named replay a batch of their own (value discarded), so that the named ranks'
all-gathers complete.

Compute time. FSDP2 has no communication hook, and its collectives sit all along the
step: each module's forward starts by all-gathering its parameters, and the backward
starts with the last module's all-gather (FSDP's pre-backward hook, on the forward's
output, runs before any hook registered after it), then reduce-scatters module by
module. A fast rank waits in those all-gathers for a slow one, so the time to the first
reduce-scatter makes every rank look as slow as the slowest (measured: on 2 gloo ranks,
a mark when backward reaches the output put half the slow rank's delay on the fast one).
On the host clock (CPU) :func:`instrument` measures compute as the time from the step's
start to the end of the model's forward, less the seconds spent in FSDP's pre-forward
hooks (the all-gathers and their waits), from two forward pre-hooks per FSDP module
around FSDP's own: public module hooks only. The closest real mark: the backward's
compute is not in it (its all-gather waits cannot be told apart from outside FSDP); a
slow device is slow in the forward too. On CUDA (events, not host time) it is not
instrumented: call ``compute_done()`` before ``loss.backward()``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .timing import _HostMarks

log = logging.getLogger(__name__)


def fsdp_modules(model: torch.nn.Module | None) -> list[Any]:
    """The FSDP2 (``fully_shard``) modules of `model`, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    if model is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(model: torch.nn.Module | None) -> Iterator[Any]:
    for module in fsdp_modules(model):
        yield from module._get_fsdp_state()._fsdp_param_groups


def unsharded_params(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """Each sharded parameter's unsharded twin (what autograd accumulates into when the
    reduce-scatter is off), in FSDP's parameter order; exists after the first forward."""
    params = []
    for group in _param_groups(model):
        for fsdp_param in group.fsdp_params:
            leaf = getattr(fsdp_param, "_unsharded_param", None)
            if leaf is not None:
                params.append(leaf)
    return params


@contextlib.contextmanager
def unsynced(model: torch.nn.Module) -> Iterator[None]:
    """Backward without the reduce-scatter; afterwards the unsharded gradients it left
    are dropped and FSDP's pending post-backward cleared (the next backward reduces only
    its own gradients), and gradient sync is on again."""
    roots = fsdp_modules(model)
    for module in roots:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for group in _param_groups(model):
            for fsdp_param in group.fsdp_params:
                leaf = getattr(fsdp_param, "_unsharded_param", None)
                if leaf is not None:
                    leaf.grad = None
            group._post_backward_pending = False
        for module in roots:
            module.set_requires_gradient_sync(True, recurse=False)


class ForwardWaits:
    """Seconds this rank spent in FSDP's pre-forward hooks (parameter all-gathers and
    their waits) in the current step (`current()`: the step's scope; a new one resets the
    count), from two forward pre-hooks around FSDP's own."""

    def __init__(self, clock: Callable[[], float], current: Callable[[], object]) -> None:
        self.clock = clock
        self.current = current
        self.seconds = 0.0
        self._step: object = None
        self._entered: list[float] = []

    def enter(self, module: Any, args: Any) -> None:
        step = self.current()
        if step is not self._step:
            self._step, self.seconds, self._entered = step, 0.0, []
        self._entered.append(self.clock())

    def ready(self, module: Any, args: Any) -> None:
        if self._entered:
            self.seconds += self.clock() - self._entered.pop()


class Timed(Protocol):
    """What :func:`instrument` reads of the supervisor."""

    _scope: Any
    _marks: Any


def instrument(sup: Timed, model: torch.nn.Module) -> ForwardWaits | None:
    """On the host clock: hooks that end the scope's compute at the end of the model's
    forward, less the step's seconds in FSDP's forward all-gathers (the module
    docstring). None: not instrumented (no FSDP module, or CUDA marks)."""
    modules = fsdp_modules(model)
    if not modules or not isinstance(sup._marks, _HostMarks):
        return None
    waits = ForwardWaits(sup._marks.clock, lambda: sup._scope)
    for module in modules:
        module.register_forward_pre_hook(waits.enter, prepend=True)  # before FSDP's unshard
        module.register_forward_pre_hook(waits.ready)  # after it: the parameters are here

    def forward_done(module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and sup._scope is not None and id(waits._step) == id(sup._scope):
            sup._scope.compute_done(excluding_s=waits.seconds)

    modules[0].register_forward_hook(forward_done)  # after FSDP's post-forward (a local reshard)
    return waits
