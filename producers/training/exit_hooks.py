"""How a supervised rank ends without :meth:`Supervisor.close`: an uncaught error (a
survivor of a peer's crash dies of gloo's "connection reset") or the launcher's SIGTERM
(its teardown). Either way the rank's last StepTimings leave the shipper first (bounded by
``exit_flush_s``), a lost peer is noted for the launcher (peer_loss.py), and then the
process ends at once: the launcher is waiting for it before it restarts the job (R), and
the rest of a dying interpreter's finalization (process groups, thread pools, a
checkpoint thread stuck in a collective with dead peers) is worth nothing to anyone.

A mixin of the Supervisor (its one home for these process-wide hooks, kept out of
supervisor.py): it reads the Supervisor's config, agent, shipper and phases file.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ..rank.agent import RankAgent
from ..rank.shipper import TelemetryShipper
from .config import SupervisorConfig
from .peer_loss import peer_lost
from .rank_files import note_exit

log = logging.getLogger(__name__)


class ExitHooks:
    # What the hooks read of the Supervisor.
    config: SupervisorConfig
    agent: RankAgent
    shipper: TelemetryShipper | None
    phases_file: Path | None
    _closed: bool

    def _close_telemetry(self, timeout_s: float) -> None:
        raise NotImplementedError  # the Supervisor's

    def _install_exit_hooks(self) -> None:
        self._sigterm_installed = False
        self._exit_flush_started = False
        self._exit_flush_done = False
        self._terminated = False  # a SIGTERM came while the exit flush ran
        atexit.register(self._flush_at_exit)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._note_uncaught
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self.take_sigterm()

    def _remove_exit_hooks(self) -> None:
        """close(): the rank ends the ordinary way; the hooks go."""
        atexit.unregister(self._flush_at_exit)
        if sys.excepthook == self._note_uncaught:
            sys.excepthook = self._previous_excepthook
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def take_sigterm(self) -> None:
        """SIGTERM (the launcher's teardown) ends this rank the supervisor's way, replacing a
        framework's handler (Lightning's runs a collective inside it: with peers gone it
        raises, and the launcher's requested stop would read as a lost peer)."""
        if self.shipper is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._exit_on_sigterm)
            self._sigterm_installed = True

    def _exit_on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM (the launcher's teardown): ship what is queued, bounded by exit_flush_s,
        then end at once as the default action would (no thread joins, no finalization).
        The flush runs on its own thread: the interrupted main thread may hold the
        shipper's lock. Already exiting of an error: end as soon as its flush is done (now,
        if it is). A rank blocked in a collective runs this once the call returns; the
        launcher's SIGKILL after its term timeout bounds that."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self._exit_flush_done:
            os._exit(128 + signum)
        if self._exit_flush_started:  # the main thread's atexit flush: it ends the process
            self._terminated = True
            return
        self.agent.exited = True  # no more heartbeats: the rank is going, not hung
        flush = threading.Thread(target=self._flush_at_exit, name="trainguard-exit-flush", daemon=True)
        flush.start()
        flush.join(self.config.exit_flush_s + 1.0)
        os._exit(128 + signum)

    def _note_uncaught(self, kind: type[BaseException], error: BaseException, tb: Any) -> None:
        """sys.excepthook: the rank is dying of `error`. A lost peer's error is noted in the
        phases file, so that the launcher's RankExit says so (not a culprit)."""
        why = peer_lost(error)
        if why is not None:
            note_exit(self.phases_file, why)
        self._previous_excepthook(kind, error, tb)

    def _flush_at_exit(self) -> None:
        """atexit: the process ends without close() (an exception, SIGTERM): ship what is
        queued within exit_flush_s. No RankExit: the launcher reports how it ended."""
        if self._closed or self._exit_flush_started:
            return
        self._exit_flush_started = True
        try:
            self._close_telemetry(self.config.exit_flush_s)
        except Exception:
            log.exception("trainguard: flushing telemetry at exit failed")
        self._exit_flush_done = True
        if self._terminated:  # the launcher's SIGTERM came meanwhile: go, as it asked
            os._exit(128 + signal.SIGTERM)
