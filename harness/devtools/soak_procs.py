"""The pipeline's own processes under the chaos soak: each processor worker and the
archive writer is a slot that can be SIGKILLed and is restarted after a delay, on a
thread of its own so that the chaos loop keeps its schedule. Every incarnation logs
to a file of its own, so a restart never overwrites the log of the one killed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .broker_config import free_ports
from .soak_plan import Victim
from .stack import scrape, start_processor

log = logging.getLogger("harness.devtools.soak")

#: Starts an incarnation logging to the path; returns it and its metrics URL (if any).
Launch = Callable[[Path], tuple[subprocess.Popen[bytes], str | None]]
#: A worker's counters summed over its incarnations: each is read just before it is
#: killed or stopped, so that the soak can show the recoveries it caused.
COLLECTED = (
    "trainguard_events_processed_total",
    "trainguard_recoveries_total",
    "trainguard_recovery_records_total",
    "trainguard_redelivered_records_total",
    "trainguard_suppressed_outputs_total",
    "trainguard_snapshots_total",
    "trainguard_recovery_seconds_sum",
)


@dataclass
class Slot:
    """One restartable process. `launch(log_path)` starts an incarnation."""

    name: str
    victim: Victim
    launch: Launch
    logs: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kills: int = 0
    restarts: int = 0
    #: Seconds from each SIGKILL until the new incarnation was up (delay included).
    downtimes: list[float] = field(default_factory=list)
    #: Wall time of each SIGKILL (for the soak's abort timelines).
    killed_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _incarnation: int = 0
    _restarting: threading.Thread | None = None

    def start(self) -> None:
        path = self.logs / f"{self.name}.{self._incarnation}.log"
        self._incarnation += 1
        self.proc, self.url = self.launch(path)

    def collect(self) -> None:
        """Add the incarnation's counters to `metrics` (best effort: it may be dying)."""
        if self.url is None or self.proc is None or self.proc.poll() is not None:
            return
        try:
            values = scrape(self.url)
        except OSError:
            return
        for series, value in values.items():
            name = series.partition("{")[0]
            if name in COLLECTED:
                self.metrics[name] = self.metrics.get(name, 0.0) + value

    def alive(self) -> bool:
        restarting = self._restarting is not None and self._restarting.is_alive()
        return not restarting and self.proc is not None and self.proc.poll() is None

    def kill_and_restart(self, delay_s: float) -> None:
        assert self.proc is not None
        self.collect()
        self.proc.send_signal(signal.SIGKILL)
        self.killed_at.append(time.time())
        self.proc.wait(30)
        self.kills += 1
        killed_at = time.monotonic()

        def restart() -> None:
            time.sleep(delay_s)
            try:
                self.start()
            except Exception as exc:  # noqa: BLE001 - recorded: the soak's report shows it
                log.exception("%s did not restart", self.name)
                self.failures.append(f"{self.name}: {exc}")
                return
            self.restarts += 1
            self.downtimes.append(time.monotonic() - killed_at)

        self._restarting = threading.Thread(target=restart, name=f"restart-{self.name}", daemon=True)
        self._restarting.start()

    def wait_restarted(self, timeout_s: float = 120.0) -> None:
        if self._restarting is not None:
            self._restarting.join(timeout_s)

    def terminate(self) -> None:
        """Ask the incarnation to leave (it commits); kill it if it will not."""
        if self.proc is not None and self.proc.poll() is None:
            self.collect()
            self.proc.terminate()

    def reap(self, timeout_s: float = 60.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.failures.append(f"{self.name}: did not stop within {timeout_s:g} s of SIGTERM")
            self.proc.kill()
            self.proc.wait(30)


def worker_launcher(
    bootstrap: str, prefix: str, policy: Path, env: dict[str, str], extra: tuple[str, ...]
) -> Launch:
    """`trainguard process` on a fresh metrics port; returns once its endpoint answers."""

    def launch(path: Path) -> tuple[subprocess.Popen[bytes], str | None]:
        return start_processor(bootstrap, policy, free_ports(1)[0], path, env, prefix, extra_args=extra)

    return launch


def archive_launcher(bootstrap: str, prefix: str, db: Path, env: dict[str, str]) -> Launch:
    """`trainguard archive` on the soak's topics into `db`."""

    def launch(path: Path) -> tuple[subprocess.Popen[bytes], str | None]:
        command = [sys.executable, "-m", "trainguard", "archive", "--db", str(db),
                   "--bootstrap", bootstrap, "--topic-prefix", prefix, "--metrics-port", "0"]  # fmt: skip
        with path.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        return proc, None

    return launch
