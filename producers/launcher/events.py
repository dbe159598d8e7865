"""The launcher's telemetry: RunStarted, RankExit, RestartPhases and NodeSelfTestResult
events, with ids deterministic per run dir.

Event ids are derived from the journal's nonce and what the event is about (the attempt,
the rank, the interruption), so that a relaunched launcher's re-report of the same exit
or restart is a duplicate that consumers drop (at-least-once, idempotent). Telemetry
never stops the launcher: an event with invalid values is logged and not sent.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ...schemas import NO_STEP, RUN_LEVEL_RANK, Envelope, NodeSelfTestResult, RankExit, Reason, ReasonCode
from ...schemas import RestartPhases as RestartPhasesEvent
from ..rank.agent import EventSink  # a TelemetryShipper satisfies EventSink
from .node_selftest import NodeSelfTestReport
from .records import RankEnd, RestartPhases, phases_path, progress_path, read_json, read_progress
from .story import Story

log = logging.getLogger(__name__)


class LauncherEvents:
    def __init__(
        self,
        sink: EventSink,
        run_id: str,
        nonce: str,
        run_dir: Path,
        nproc: int,
        attempt: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        self.sink = sink
        self.run_id = run_id
        self.run_dir = run_dir
        self.nproc = nproc
        self.attempt = attempt  # the current attempt: an event's default
        self.clock = clock
        self._id_prefix = hashlib.sha256(nonce.encode()).hexdigest()[:16]
        self._run_prefix = hashlib.sha256(f"run:{run_id}".encode()).hexdigest()[:16]
        self._published: set[int] = set()  # interruptions whose RestartPhases went out
        #: The console's line of a restart done (across hosts; the launcher sets it).
        self.story: Story | None = None

    def rank_exit(self, end: RankEnd, ranks: Sequence[int] | None = None) -> None:
        """The RankExit of one rank: its own newest completed step and the newest any rank
        of the attempt completed, both from the ranks' progress files (exact when the
        survivors' last StepTimings are still in their shippers; `ranks`: the attempt's
        ranks this launcher ran, default every rank of the configured world)."""
        info = read_json(phases_path(self.run_dir, end.attempt, end.rank))
        own = read_progress(progress_path(self.run_dir, end.attempt, end.rank))
        if own is None:  # a rank program without the progress file: its first step at most
            first = info.get("last_step")
            own = first if isinstance(first, int) and first >= NO_STEP else NO_STEP
        peers = range(self.nproc) if ranks is None else ranks
        steps = [read_progress(progress_path(self.run_dir, end.attempt, r)) for r in peers]
        job_step = max([own, *(s for s in steps if s is not None)])
        self.emit(
            RankExit,
            end.rank,
            end.node,
            own,
            key=f"exit-{end.attempt}-{end.rank}",
            attempt=end.attempt,
            exit_code=end.returncode,
            signal=end.signal,
            requested=end.requested,
            stack_dump_ref=str(info.get("stack_dump_ref", ""))[:2000],
            stack_signature=str(info.get("stack_signature", ""))[:2000],
            job_step=max(-1, job_step),
            peer_lost=not end.requested
            and (end.left or end.dying or (bool(info.get("peer_lost")) and end.signal is None)),
        )
        if not end.requested:
            self.ship_soon()  # the processor decides on it while the launcher waits

    def ship_soon(self) -> None:
        """What is queued goes out at once (the shipper's next poll), not at its next flush;
        nothing waits for the delivery."""
        if (wake := getattr(self.sink, "wake", None)) is not None:
            wake()

    def restart_phases(self, rec: RestartPhases) -> None:
        """The restart's phases as a RestartPhases telemetry event (once per interruption;
        only the phases measured), for the archive's `restart_phase` view."""
        if rec.to_attempt is None or rec.interruption in self._published:
            return
        self._published.add(rec.interruption)
        measured = {
            "detect": rec.detect_s,
            "reschedule": rec.reschedule_s,
            "rendezvous": rec.rendezvous_s,
            "process_start": rec.process_start_s,
            "import": rec.import_s,
            "build": rec.build_s,
            "checkpoint_load": rec.checkpoint_load_s,
            "pg_init": rec.pg_init_s,
            "first_step": rec.first_step_s,
        }
        self.emit(
            RestartPhasesEvent,
            RUN_LEVEL_RANK,
            "",
            rec.resumed_from_step,
            key=f"restart-{rec.interruption}",
            attempt=rec.to_attempt,
            interrupted_attempt=rec.from_attempt,
            cause=str(rec.cause),
            phases={name: max(0.0, s) for name, s in measured.items() if s is not None},
            resumed_from_step=rec.resumed_from_step,
        )
        if self.story is not None and rec.complete:
            self.story.restarted(rec)

    def self_test_result(self, report: NodeSelfTestReport, purpose: str, command_id: str) -> None:
        summary = report.summary()
        code = ReasonCode.NODE_SELF_TEST_PASSED if report.passed else ReasonCode.NODE_SELF_TEST_FAILED
        self.emit(
            NodeSelfTestResult,
            RUN_LEVEL_RANK,
            report.node,
            NO_STEP,
            key=f"selftest-{report.node}-{purpose}-{command_id or self.attempt()}",
            passed=report.passed,
            tests=report.tests,
            failed_tests=report.failed_tests,
            purpose=purpose,
            command_id=command_id,
            devices=len({r.local_rank for r in report.results}),
            wall_s=max(0.0, report.wall_s),
            reason=Reason(code=code, text=summary[:2000]),
        )

    def emit(
        self,
        cls: type[Envelope],
        rank: int,
        node: str,
        step: int,
        key: str,
        attempt: int | None = None,
        shared: bool = False,
        **fields: Any,
    ) -> None:
        """`shared`: the event is the run's, sent alike by every host's agent (its id is
        the run's, so consumers keep one); else this launcher's (its run dir's nonce)."""
        prefix = self._run_prefix if shared else self._id_prefix
        try:
            event = cls(
                event_id=f"launcher-{prefix}-{key}",
                run_id=self.run_id,
                attempt=self.attempt() if attempt is None else attempt,
                rank=rank,
                node=node,
                step=step,
                ts=self.clock(),
                **fields,
            )
        except ValidationError as exc:  # telemetry must never stop the launcher
            log.warning("launcher: %s not sent (invalid values): %s", cls.KIND, exc)
            return
        self.sink.submit(event)
