"""A chaos knob: one device of one node that computes wrong answers, deterministically.

``TRAINGUARD_INJECT_WRONG_DEVICE="node=node-0000,local_rank=1,from_step=40,bias=1e-3"``
makes the device at local rank 1 of node-0000 wrong from step 40 on: every matrix product
computed in a process on it (``torch.mm``, ``matmul``, ``bmm``, ``addmm``,
``nn.functional.linear``) comes out scaled by ``1 + bias``. It is wrong the same way every
time, so a bitwise replay on the same device agrees with itself (the seed's §7 failure 3:
the self-check passes), while a recomputation on another device (the cross-rank check)
and a known-answer test on it (the node self-test) disagree. The fault belongs to the
hardware, not to the rank: ranks moved to a spare compute right again.

``TRAINGUARD_INJECT_SLOW_DEVICE="node=node-0001,local_rank=0,from_step=20,delay_s=0.02"``
makes a device slow instead (a thermally throttled GPU, seed §7 failure 2): every matrix
product on it waits `delay_s` first and computes right. The rank's compute, before the
gradient collective, takes longer: a straggler, whatever loop or framework drives it.

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
ENV_SLOW_DEVICE = "TRAINGUARD_INJECT_SLOW_DEVICE"

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
    #: Seconds each matrix product waits first (a slow device; 0: a wrong one only).
    delay_s: float = 0.0

    def strikes(self, node: str, local_rank: int, step: int | None = None) -> bool:
        """Is the device at `local_rank` of `node` wrong (at `step`; None: any time after
        the onset, as for a self-test run once the fault has been caught)?"""
        here = node == self.node and local_rank == self.local_rank
        return here and (step is None or step >= self.from_step)


def wrong_device_from_env(environ: Mapping[str, str] = os.environ) -> WrongDevice | None:
    """The faulty device of TRAINGUARD_INJECT_WRONG_DEVICE or ..._SLOW_DEVICE (one of them)."""
    wrong, slow = (environ.get(name, "").strip() for name in (ENV_WRONG_DEVICE, ENV_SLOW_DEVICE))
    if wrong and slow:
        raise ValueError(
            f"{ENV_WRONG_DEVICE} and {ENV_SLOW_DEVICE} are both set: one faulty device at a time"
        )
    name, spec = (ENV_SLOW_DEVICE, slow) if slow else (ENV_WRONG_DEVICE, wrong)
    if not spec:
        return None
    try:
        fields = dict(part.split("=", 1) for part in spec.split(","))
        return WrongDevice(
            node=fields["node"],
            local_rank=int(fields["local_rank"]),
            from_step=int(fields.get("from_step", "0")),
            bias=float(fields.get("bias", "0" if slow else "1e-3")),
            delay_s=float(fields["delay_s"]) if slow else 0.0,
        )
    except (KeyError, ValueError) as exc:
        want = "[,from_step=N],delay_s=SECONDS" if slow else "[,from_step=N][,bias=X]"
        raise ValueError(f"{name}={spec!r}: want node=NAME,local_rank=N{want} ({exc})") from exc


def install_wrong_device(bias: float, delay_s: float = 0.0) -> None:
    """Make every matrix product of this process wrong by the factor ``1 + bias``, and
    wait `delay_s` before each (idempotent: a second call changes nothing)."""
    import importlib
    import time

    for module_name, attribute in _PRODUCTS:
        if (module_name, attribute) in _installed:
            continue
        module = importlib.import_module(module_name)
        right = getattr(module, attribute)

        @functools.wraps(right)
        def wrong(*args: Any, _right: Callable[..., Any] = right, **kwargs: Any) -> Any:
            if delay_s > 0:
                time.sleep(delay_s)
            return _right(*args, **kwargs) * (1.0 + bias) if bias else _right(*args, **kwargs)

        _installed[(module_name, attribute)] = right
        setattr(module, attribute, wrong)


def uninstall_wrong_device() -> None:
    """Undo :func:`install_wrong_device` (tests)."""
    import importlib

    for (module_name, attribute), right in list(_installed.items()):
        setattr(importlib.import_module(module_name), attribute, right)
        del _installed[(module_name, attribute)]
