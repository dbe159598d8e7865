"""What the launcher records of a run: why an attempt ended (`RestartCause`), each rank's
end (`RankEnd`), each interruption and its restart phase by phase (`RestartPhases`), the
run's result, and the per-rank files the rank-side Supervisor writes (phases, progress)
that the launcher reads back (docs in producers/launcher/restarts.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal


class RestartCause(StrEnum):
    CRASH = "crash"  # a rank ended on its own with a non-zero status
    ABORT = "abort"  # Abort command
    PAUSE = "pause"  # PauseRun command: the attempt stops and nothing restarts
    ROLLBACK = "rollback"  # Rollback command
    RESUME = "resume"  # ResumeFrom command
    EVICTION = "eviction"  # EvictRank, at the next validated checkpoint
    LAUNCHER = "launcher"  # the launcher died with the attempt running; its successor ended it
    MEMBERSHIP = "membership"  # across hosts: a host waits to join (below MAX): the world re-forms
    QUARANTINED = "quarantined"  # across hosts: this host was quarantined mid-attempt: it leaves
    #: Across hosts, a spare's (--spare) share of an interruption: a host of the run was lost
    #: (or quarantined) and this agent joins in its place; its restart is measured as the
    #: survivors' is, from the lost host's last beat.
    HOST_LOST = "host_lost"
    #: Elastic training (issue 45): a planned change of the world's size at a checkpoint
    #: boundary, the ranks in their processes (grow back once a spare is ready).
    RESIZE = "resize"
    #: Failure prediction (issue 46): a DrainNode took a node out at a checkpoint boundary
    #: before it failed (planned: the ranks left at a step they agreed on, none lost).
    DRAIN = "drain"


@dataclass(frozen=True)
class RankEnd:
    attempt: int
    rank: int
    node: str
    returncode: int | None  # None: could not be reaped (abandoned after SIGKILL), or left
    ts: float
    requested: bool
    #: In-process restart: the rank left the attempt and its process lives on (a lost peer).
    left: bool = False
    #: The signal the process died of after its Supervisor closed with 0 (the interpreter's
    #: teardown, not the run's: `returncode` is 0 then); None otherwise.
    teardown_signal: int | None = None
    #: The rank had noted that it was dying of a lost peer when the launcher ended it
    #: (attempt._dying_of_a_lost_peer): its end is the lost peer's, whatever signal ended it.
    dying: bool = False

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None


@dataclass
class RestartPhases:
    """One interruption and the restart that followed, phase by phase (seconds; None:
    not measured: no phase file from the ranks, or no restart)."""

    run_id: str
    interruption: int  # 0, 1, ... within this launcher's run
    cause: RestartCause
    detail: str
    from_attempt: int
    to_attempt: int | None
    rank: int  # culprit rank, -1 when the cause is run-level (a command)
    node: str
    exit_code: int | None
    signal: int | None
    command_id: str
    fault_ts: float
    detected_ts: float
    spawn_ts: float | None = None
    resumed_from_step: int = -1
    detect_s: float = 0.0
    reschedule_s: float | None = None
    #: Across hosts, the part of reschedule spent in the rendezvous round (and its plan).
    rendezvous_s: float | None = None
    process_start_s: float | None = None
    #: A new process's imports (its start to the process-group init), and the model and
    #: DDP construction (the init's end to the Supervisor), slowest rank; None: not marked.
    import_s: float | None = None
    build_s: float | None = None
    checkpoint_load_s: float | None = None
    pg_init_s: float | None = None
    first_step_s: float | None = None
    restart_s: float | None = None
    ranks_reported: int = 0
    complete: bool = False
    #: How the ranks came back: "full" (every process spawned again) or "in-process" (the
    #: survivors stayed in their processes; the failed ranks' taken by warm spares or new ones).
    path: str = "full"
    #: In process: the failed ranks taken by a warm spare, and by a new process.
    warm_ranks: list[int] = field(default_factory=list)
    new_ranks: list[int] = field(default_factory=list)
    #: Where the ranks restored from: {"own": n, "peer": n, "storage": n} (their phase files).
    restore_from: dict[str, int] = field(default_factory=dict)
    #: A crash: the error its rank reported (its error file or its stderr's last exception)
    #: and that error normalised (startup.py); "" when it reported none (a signal).
    error: str = ""
    error_signature: str = ""
    #: The crash came before any rank of the attempt completed a step; the nodes whose
    #: ranks reported the same error then.
    startup: bool = False
    error_nodes: list[str] = field(default_factory=list)
    #: The launcher's own decision after this interruption when it was not the usual
    #: restart: "pause" (the same start-up error again: startup.py), and its reason.
    decision: str = ""
    decision_reason: str = ""
    #: Across hosts: the hosts of the interrupted world that the next one has not (lost or
    #: quarantined), and the host that took each one's ranks (none: the world shrank).
    hosts_lost: list[str] = field(default_factory=list)
    replaced_by: dict[str, str] = field(default_factory=dict)
    #: The world the restart resumed at (0: not started); under elastic training it may be
    #: smaller than the run's (decision "shrink") or grow back ("grow"), with the reason.
    world_size: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class LaunchResult:
    status: Literal["ok", "failed", "stopped", "paused"]
    reason: str
    attempts: int
    restarts: list[RestartPhases] = field(default_factory=list)
    exits: list[RankEnd] = field(default_factory=list)


def phases_path(run_dir: Path, attempt: int, rank: int) -> Path:
    return run_dir / f"attempt-{attempt}" / f"rank-{rank}.phases.json"


def progress_path(run_dir: Path, attempt: int, rank: int) -> Path:
    """The rank's newest completed step, rewritten by its Supervisor after every step."""
    return run_dir / f"attempt-{attempt}" / f"rank-{rank}.progress"


def peer_lost_of(run_dir: Path, attempt: int, rank: int) -> str:
    """The lost peer's error the rank noted before it died ('' none: its own fault)."""
    return str(read_json(phases_path(run_dir, attempt, rank)).get("peer_lost") or "")


def closed_cleanly(run_dir: Path, attempt: int, rank: int) -> bool:
    """The rank's Supervisor closed with exit code 0 (producers/training/rank_files.py)."""
    closed = read_json(phases_path(run_dir, attempt, rank)).get("closed")
    return closed == 0 and not isinstance(closed, bool)


def read_progress(path: Path) -> int | None:
    """The step in a progress file (None: absent, or no step completed yet). The rank
    rewrites it in place, so a read may race a write: read until two reads agree."""
    try:
        data = path.read_bytes()
        for _ in range(5):
            again = path.read_bytes()
            if again == data:
                break
            data = again
    except OSError:
        return None
    text = data.strip()
    return int(text) if text.isdigit() else None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent, or caught mid-write (writers should write-then-rename)
    return data if isinstance(data, dict) else {}


def num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def restart_indices(path: Path) -> set[int]:
    """Interruption indices already in restarts.jsonl; a torn last line is cut off."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return set()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as fh:
            fh.truncate(end)
    out = set()
    for line in data[:end].splitlines():
        try:
            index = json.loads(line).get("interruption")
        except (ValueError, AttributeError):
            continue
        if isinstance(index, int):
            out.add(index)
    return out


def collect_phases(rec: RestartPhases, run_dir: Path, ranks: Sequence[int]) -> None:
    """Fill `rec`'s phases from the new attempt's per-rank phase files: the slowest rank's
    process start, checkpoint load, group init and first step, and R (fault to the last
    rank's first step) once every rank has reported (`ranks`: those this launcher ran)."""
    if rec.to_attempt is None or rec.spawn_ts is None:
        return
    files = [read_json(phases_path(run_dir, rec.to_attempt, r)) for r in ranks]
    starts = [v for f in files if (v := num(f.get("start_ts"))) is not None]
    loads = [v for f in files if (v := num(f.get("checkpoint_load_s"))) is not None]
    inits = [v for f in files if (v := num(f.get("pg_init_s"))) is not None]
    firsts = [v for f in files if (v := num(f.get("first_step_ts"))) is not None]
    rec.ranks_reported = sum(1 for f in files if f)
    sources = [str(f["restore_from"]) for f in files if f.get("restore_from")]
    rec.restore_from = {s: sources.count(s) for s in sorted(set(sources))}
    rec.process_start_s = max(starts) - rec.spawn_ts if starts else None
    rec.checkpoint_load_s = max(loads) if loads else None
    rec.pg_init_s = max(inits) if inits else None
    own, imports, builds = [], [], []
    for f in files:
        first, start = num(f.get("first_step_ts")), num(f.get("start_ts"))
        init_ts, init_s, sup_ts = (
            num(f.get("pg_init_ts")),
            num(f.get("pg_init_s")),
            num(f.get("supervisor_ts")),
        )
        load = num(f.get("checkpoint_load_s")) or 0.0
        if init_ts is not None and start is not None:
            imports.append(max(0.0, init_ts - start))
        if sup_ts is not None and init_ts is not None and init_s is not None:
            builds.append(max(0.0, sup_ts - init_ts - init_s))
        if first is not None and sup_ts is not None:  # the checkpoint manager, the load, the step
            own.append(first - sup_ts - load)
        elif first is not None and start is not None:  # a file without the marks: all of it
            own.append(first - start - load - (init_s or 0.0))
    rec.import_s = max(imports) if imports else None
    rec.build_s = max(builds) if builds else None
    rec.first_step_s = max(0.0, max(own)) if own else None
    rec.complete = len(firsts) == len(ranks)
    rec.restart_s = max(firsts) - rec.fault_ts if rec.complete else None
