"""What the launcher's stages share: its configuration, run dir, node pool, the run's
state and the stages the others call (the resume choice, the restart records, the
events). Built once by :class:`~.launcher.Launcher`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import LauncherConfig
from .events import LauncherEvents
from .plan import NodePool
from .restarts import RestartRecorder
from .resume import ResumeChoice
from .run_state import LauncherState


@dataclass
class LaunchContext:
    config: LauncherConfig
    run_dir: Path
    pool: NodePool
    state: LauncherState
    resume: ResumeChoice
    restarts: RestartRecorder
    events: LauncherEvents
    clock: Callable[[], float]
