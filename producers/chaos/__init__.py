"""Chaos knobs, behind one seam: the only module the product imports them from.

Fire drills and the tests inject faults into real runs through the environment; unset (in
production) every knob is inert. Three knobs:

- the launcher's kill points (``TRAINGUARD_LAUNCHER_FAULT``, `kill_points.py`): the
  launcher SIGKILLs itself at a named point of a restart or a command;
- a wrong or slow device (``TRAINGUARD_INJECT_WRONG_DEVICE`` / ``..._SLOW_DEVICE``,
  `device_fault.py`): one GPU of one node computes wrong answers (or slowly), in training
  and in the node self-test alike;
- rising GPU-health precursors (``TRAINGUARD_INJECT_HEALTH``, `health_inject.py`): a rank's
  health reader reports counters that grow, on CPU as on a GPU.

Product code calls ``from ..chaos import ...`` (tests/test_architecture.py checks that no
product module reaches past this seam), so every place a fault can be injected is one
grep away.
"""

from .device_fault import (
    ENV_SLOW_DEVICE,
    ENV_WRONG_DEVICE,
    WrongDevice,
    install_wrong_device,
    uninstall_wrong_device,
    wrong_device_from_env,
)
from .health_inject import ENV_INJECT_HEALTH, reader_for_rank
from .kill_points import FAULT_ENV, FAULT_POINTS, kill_at

__all__ = [
    "ENV_INJECT_HEALTH",
    "ENV_SLOW_DEVICE",
    "ENV_WRONG_DEVICE",
    "FAULT_ENV",
    "FAULT_POINTS",
    "WrongDevice",
    "install_wrong_device",
    "kill_at",
    "reader_for_rank",
    "uninstall_wrong_device",
    "wrong_device_from_env",
]
