"""A chaos knob: one device of one node that computes wrong answers, deterministically.

``TRAINGUARD_INJECT_WRONG_DEVICE="node=node-0000,local_rank=1,from_step=40,bias=1e-3"``
makes the device at local rank 1 of node-0000 wrong from step 40 on: every matrix product
computed in a process on it (``torch.mm``, ``matmul``, ``bmm``, ``addmm``,
``nn.functional.linear``) comes out scaled by ``1 + bias``. It is wrong the same way every
time, so a bitwise replay on the same device agrees with itself (the seed's §7 failure 3:
the self-check passes), while a recomputation on another device (the cross-rank check)
and a known-answer test on it (the node self-test) disagree. The fault belongs to the
hardware, not to the rank: ranks moved to a spare compute right again.

For end-to-end tests and fire drills; unset (production), nothing is patched. Ranks read
it through the Supervisor (from its step on), the self-test when it runs on that node.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ENV_WRONG_DEVICE = "TRAINGUARD_INJECT_WRONG_DEVICE"

#: The torch entry points a matrix product goes through (module, attribute).
_PRODUCTS = (
    ("torch", "mm"),
    ("torch", "matmul"),
    ("torch", "bmm"),
    ("torch", "addmm"),
    ("torch.nn.functional", "linear"),
)
_installed: dict[tuple[str, str], Callable[..., Any]] = {}


@dataclass(frozen=True)
class WrongDevice:
    node: str
    local_rank: int
    from_step: int = 0
    bias: float = 1e-3

    def strikes(self, node: str, local_rank: int, step: int | None = None) -> bool:
        """Is the device at `local_rank` of `node` wrong (at `step`; None: any time after
        the onset, as for a self-test run once the fault has been caught)?"""
        here = node == self.node and local_rank == self.local_rank
        return here and (step is None or step >= self.from_step)


def wrong_device_from_env(environ: Mapping[str, str] = os.environ) -> WrongDevice | None:
    spec = environ.get(ENV_WRONG_DEVICE, "").strip()
    if not spec:
        return None
    try:
        fields = dict(part.split("=", 1) for part in spec.split(","))
        return WrongDevice(
            node=fields["node"],
            local_rank=int(fields["local_rank"]),
            from_step=int(fields.get("from_step", "0")),
            bias=float(fields.get("bias", "1e-3")),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"{ENV_WRONG_DEVICE}={spec!r}: want node=NAME,local_rank=N[,from_step=N][,bias=X] ({exc})"
        ) from exc


def install_wrong_device(bias: float) -> None:
    """Make every matrix product of this process wrong by the factor ``1 + bias``
    (idempotent: a second call changes nothing)."""
    import importlib

    for module_name, attribute in _PRODUCTS:
        if (module_name, attribute) in _installed:
            continue
        module = importlib.import_module(module_name)
        right = getattr(module, attribute)

        @functools.wraps(right)
        def wrong(*args: Any, _right: Callable[..., Any] = right, **kwargs: Any) -> Any:
            return _right(*args, **kwargs) * (1.0 + bias)

        _installed[(module_name, attribute)] = right
        setattr(module, attribute, wrong)


def uninstall_wrong_device() -> None:
    """Undo :func:`install_wrong_device` (tests)."""
    import importlib

    for (module_name, attribute), right in list(_installed.items()):
        setattr(importlib.import_module(module_name), attribute, right)
        del _installed[(module_name, attribute)]
