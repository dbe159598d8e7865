"""Gradient checks for silent data corruption (seed §7 failure 3, R3): a bitwise gradient
digest, the total gradient norm, and the self-check replay.

Digest. :func:`grad_digest` is a SHA-256 over every gradient's raw bytes in parameter
order, each preceded by its index, dtype and shape (a missing gradient hashes as a
marker), so it is bitwise: one flipped bit anywhere changes it, and equal gradients on
the same device always give the same digest. It copies the gradients to host memory,
so it costs one device-to-host transfer of the gradients: run it when commanded or
every N steps, not every step.

Self-check replay (R3). :func:`self_check` runs the user's step function twice on the
same microbatch, on the same device, with the same RNG state, and digests the
gradients each run produced. Same device + same kernels + same shapes => bitwise
determinism, so the comparison is ``==``, and any difference is a hardware fault. The
replay leaves the training state as it found it: the gradients present before it are
put back, module buffers (BatchNorm statistics) are restored, and so are the CPU and
CUDA RNG states, so a run with a self-check continues bitwise like one without.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...common.moved import deprecate_names
from . import inprocess

#: Digest algorithm, written in front of every digest ("sha256:<hex>").
DIGEST_PREFIX = "sha256:"


def param_list(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    params: Iterable[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """The parameters a Supervisor watches: `params`, else the model's, else the optimizer's."""
    if params is not None:
        return list(params)
    if model is not None:
        return list(model.parameters())
    if optimizer is not None:
        return [p for group in optimizer.param_groups for p in group["params"]]
    return []


def _params(params: Iterable[torch.Tensor] | torch.nn.Module) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return list(params.parameters())
    return list(params)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a sharded (DTensor, FSDP) one's local shard."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (of this rank's shard, for a DTensor), on the host (any
    dtype, bf16 and fp8 included)."""
    flat = local(t).detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def grad_digest(params: Iterable[torch.Tensor] | torch.nn.Module) -> str:
    """SHA-256 of the gradients in parameter order (bitwise; see the module docstring)."""
    h = hashlib.sha256()
    for i, p in enumerate(_params(params)):
        g = p.grad
        if g is None:
            h.update(f"{i}:none;".encode())
            continue
        h.update(f"{i}:{g.dtype}:{tuple(g.shape)};".encode())
        h.update(tensor_bytes(g))
    return DIGEST_PREFIX + h.hexdigest()


def grad_norm(params: Iterable[torch.Tensor] | torch.nn.Module) -> float:
    """Total L2 norm of the gradients (what ``clip_grad_norm_`` returns), as a float:
    nan/inf when a gradient is not finite. 0.0 when there are none."""
    grads = [p.grad.detach() for p in _params(params) if p.grad is not None]
    if not grads:
        return 0.0
    if any(isinstance(g, DTensor) for g in grads):  # sharded (FSDP): every rank gets the whole norm
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        return float(total.full_tensor() if isinstance(total, DTensor) else total)
    norms = torch.stack(
        [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32).to(grads[0].device) for g in grads]
    )
    return float(torch.linalg.vector_norm(norms, 2.0))


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element `index` of `t` (flattened), in place: the fault a test or a
    drill injects to show that the digest and the self-check catch a single bit."""
    size = t.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if not 0 <= bit < 8 * size:
        raise ValueError(f"bit {bit} is outside a {8 * size}-bit element")
    view = t.detach().view(-1).view(ints)
    mask = 1 << bit
    if ints is not torch.uint8 and mask >= 1 << (8 * size - 1):  # the sign bit of a signed int
        mask -= 1 << (8 * size)
    view[index] ^= mask


@dataclass(frozen=True)
class SelfCheckResult:
    step: int
    microbatch_id: str
    digest_first: str
    digest_second: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.digest_first == self.digest_second


@contextlib.contextmanager
def preserved_state(params: list[torch.Tensor], module: torch.nn.Module | None) -> Iterator[None]:
    """Stash gradients (by reference, no copy), buffers and RNG states; restore them after."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in module.buffers()] if module is not None else []
    cpu_rng = torch.get_rng_state()
    cuda_rng = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def self_check(
    replay_fn: Callable[[Any], object],
    batch: Any,
    params: Iterable[torch.Tensor] | torch.nn.Module,
    step: int,
    microbatch_id: str,
    module: torch.nn.Module | None = None,
    clock: Callable[[], float] | None = None,
) -> SelfCheckResult:
    """Run ``replay_fn(batch)`` (forward + backward, no optimizer step) twice from the same
    RNG state and digest the gradients of each run; see the module docstring.

    `module`: whose buffers to restore (default: `params` when it is a module). The
    function must not run a collective: with DDP pass the unwrapped ``ddp.module`` (its
    backward then runs no all-reduce: DDP's hooks only act after a DDP forward)."""
    clock = clock or time.perf_counter
    plist = _params(params)
    if module is None and isinstance(params, torch.nn.Module):
        module = params
    t0 = clock()
    with preserved_state(plist, module):
        rng = torch.get_rng_state()
        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        digests = []
        for _ in range(2):
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            for p in plist:
                p.grad = None
            replay_fn(batch)
            digests.append(grad_digest(plist))
    return SelfCheckResult(step, microbatch_id, digests[0], digests[1], max(0.0, clock() - t0))


def is_finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def per_parameter_allreduce(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that averages each parameter's gradient with its own all-reduce.

    DDP's first iteration in a process packs the gradients into different buckets than
    later iterations (buckets are rebuilt from the order gradients became ready), and a
    ring all-reduce sums each element in an order that depends on where it sits in the
    flattened bucket. With more than two ranks (a + b + c + d is not associative in floating
    point) a resumed run's first steps then differ in the last bits from the uninterrupted
    run's. Reducing parameter by parameter makes every element's sum independent of the
    bucket layout, so a resumed run is bitwise identical (tests/producers/test_example_job.py).
    Cost: one collective per parameter instead of per bucket."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    works, offset = [], 0
    for param in bucket.parameters():
        count = param.numel()
        works.append(dist.all_reduce(buffer[offset : offset + count], group=group, async_op=True))
        offset += count
    for work in works:
        inprocess.wait(work)  # work.wait(), unless the launcher ends the attempt meanwhile
    buffer.div_(dist.get_world_size(group))
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# A script's old path keeps working for a while, with a warning naming the public one.
deprecate_names(__name__, "trainguard.torch", ("flip_bit",))
