"""What an agent across hosts tells its console (issue 44): one line per event of the run
as this host saw it, the spare's agent included, so that whichever host's output a user
reads says what happened to the run (docs/multihost.md, "Try it on one machine"):

- a world formed: its attempt, its hosts, this host's ranks and the checkpoint step they
  restore (``attempt 1 on host-a, spare-1 (rank 1 here) restores from checkpoint step 49``);
- a host lost, named, with why; on a survivor, in the same line, what it did to this host's
  ranks (``host-b lost: its agent left the rendezvous during attempt 0; so rank 0 here lost
  its peer (Read error [127.0.0.1]:6061: Connection reset by peer; traceback in
  .../stderr.log)``) instead of each rank's gloo traceback, which :mod:`.peer_tracebacks`
  keeps off the console (whole in the rank's stderr.log);
- the host that took a lost one's place and which ranks moved there (``spare-1 replaces
  host-b: rank 1 moves host-b -> spare-1``);
- a spare's wait, and why it joins (``host-b lost: its beat stopped 3.2 s ago, in attempt
  0; spare-1 takes its place``);
- the restart done: R, the fault to this host's ranks' first step, phase by phase.

The lines are this module's logger's (:data:`STORY`, INFO): ``trainguard launch`` prints
them on stderr as ``trainguard NODE: ...`` (:func:`tell_console`); a library user or a test
reads them through logging. On one host the launcher tells nothing here (its CLI prints
the run's interruptions at the end).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TextIO

from .plan import Placement
from .records import RestartCause, RestartPhases, peer_lost_of

STORY = logging.getLogger(__name__)
#: The last attempt's files per rank (startup.Reports): its error file, its stderr.log.
Reports = Mapping[int, tuple[Path | None, Path | None]]


class World(Protocol):
    """What the story reads of a world formed (world.World; world.py tells through here)."""

    @property
    def attempt(self) -> int: ...
    @property
    def placement(self) -> Placement: ...
    @property
    def resume(self) -> int: ...
    @property
    def local_ranks(self) -> tuple[int, ...]: ...
    @property
    def before(self) -> Placement | None: ...
    @property
    def left(self) -> Mapping[str, str]: ...


class Story:
    """This agent's lines (`enabled`: across hosts)."""

    def __init__(self, node: str, enabled: bool = True) -> None:
        self.node, self.enabled = node, enabled

    def say(self, text: str) -> None:
        if self.enabled:
            STORY.info("%s: %s", self.node, text)

    def world(self, world: World, pending: RestartPhases | None, run_dir: Path, reports: Reports) -> None:
        """A world formed (before its ranks are spawned): what ended the last one, who
        replaced whom, where this one starts. `reports`: the last attempt's rank files."""
        if not self.enabled:
            return
        peers: dict[int, str] = {}
        if pending is not None and world.before is not None and self.node in world.before.nodes:
            for rank in world.before.ranks_of(self.node):
                if error := peer_lost_of(run_dir, pending.from_attempt, rank):
                    peers[rank] = error
        logs = {rank: files[1] for rank, files in reports.items()}
        for line in world_lines(world, pending, peers, logs):
            self.say(line)

    def restarted(self, rec: RestartPhases) -> None:
        """Every rank of this host completed its first step after `rec`."""
        if rec.restart_s is not None:
            self.say(restart_line(rec))


def tell_console(stream: TextIO) -> None:
    """Print the story's lines on `stream` (the CLI: its stderr), once."""
    if not any(getattr(h, "trainguard_story", False) for h in STORY.handlers):
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("trainguard %(message)s"))
        handler.trainguard_story = True  # type: ignore[attr-defined]
        STORY.addHandler(handler)
    STORY.setLevel(logging.INFO)


def world_lines(
    world: World,
    pending: RestartPhases | None,
    peers: Mapping[int, str],
    logs: Mapping[int, Path | None],
) -> list[str]:
    """The lines of a world formed after `pending` (None: the first), on a host whose
    ranks `peers` lost a peer in the interrupted attempt (rank -> the error they noted)."""
    lines: list[str] = []
    if pending is not None and pending.cause is not RestartCause.HOST_LOST:  # a spare said why it came
        lines += ended_lines(world.left, pending, peers, logs)
    lines += replaced_lines(world)
    start = f"restores from checkpoint step {world.resume}" if world.resume >= 0 else "starts from scratch"
    hosts = ", ".join(world.placement.nodes)
    lines.append(f"attempt {world.attempt} on {hosts} ({ranks(world.local_ranks)} here) {start}")
    return lines


def ended_lines(
    left: Mapping[str, str],
    pending: RestartPhases,
    peers: Mapping[int, str],
    logs: Mapping[int, Path | None],
) -> list[str]:
    """How the last attempt ended: each host that left it, named (the first line also
    says what that did to this host's ranks); else the interruption itself."""
    here = peers_here(peers, logs)
    if not left:
        said = here if here else f"{pending.cause}: {pending.detail}"
        return [f"attempt {pending.from_attempt} ended: {said}"]
    lines = [gone(host, why) for host, why in sorted(left.items())]
    if here:
        lines[0] += f"; so {here}"
    return lines


def gone(host: str, why: str) -> str:
    """A host out of the world: lost (the survivors' reason says so), else quarantined."""
    lost = why.removeprefix("host lost: ")
    return f"{host} lost: {lost}" if lost != why else f"{host} out of the run: {why}"


def peers_here(peers: Mapping[int, str], logs: Mapping[int, Path | None]) -> str:
    """One clause for this host's ranks that died of a lost peer: the first one's error,
    short, and where its whole traceback is."""
    if not peers:
        return ""
    lost = sorted(peers)
    who = f"{ranks(lost)} here lost {'its' if len(lost) == 1 else 'their'} peer"
    where = f"; traceback in {logs[lost[0]]}" if logs.get(lost[0]) else ""
    return f"{who} ({short_peer_error(peers[lost[0]])}{where})"


def replaced_lines(world: World) -> list[str]:
    """Which host took each lost host's place and ranks; a world of another size says so."""
    before, after = world.before, world.placement
    if before is None or not world.left:
        return []
    if before.world_size != after.world_size:
        out, size = ", ".join(sorted(world.left)), f"{len(after.nodes)} hosts, {after.world_size} ranks"
        return [f"the world re-forms without {out}: {size}, renumbered"]
    lines = []
    for slot, (old, new) in sorted(after.moved.items()):
        moved = [r for r in range(after.world_size) if r // after.ranks_per_node == slot]
        verb = "moves" if len(moved) == 1 else "move"
        lines.append(f"{new} replaces {old}: {ranks(moved)} {verb} {old} -> {new}")
    return lines


def restart_line(rec: RestartPhases) -> str:
    """R and its phases, as this host measured them (records.collect_phases)."""
    phases = (
        ("detect", rec.detect_s),
        ("reschedule", rec.reschedule_s),
        ("of which rendezvous", rec.rendezvous_s),
        ("process start", rec.process_start_s),
        ("checkpoint load", rec.checkpoint_load_s),
        ("first step", rec.first_step_s),
    )
    told = ", ".join(f"{name} {max(0.0, s):.1f} s" for name, s in phases if s is not None)
    step = rec.resumed_from_step
    source = f" ({', '.join(sorted(rec.restore_from))})" if rec.restore_from else ""
    restored = f"restored from checkpoint step {step}{source}" if step >= 0 else "started from scratch"
    return (
        f"restart {rec.interruption} done: R {rec.restart_s or 0.0:.1f} s from the fault to attempt "
        f"{rec.to_attempt}'s first step here ({told}); {restored}"
    )


def headline(rec: RestartPhases) -> str:
    """`rec`'s detail led by the hosts the interruption lost and who took their ranks, its
    lost peer's error short: what the CLI's closing line and restarts.jsonl say of it."""
    lost = ", ".join(
        f"{h} (replaced by {rec.replaced_by[h]})" if h in rec.replaced_by else h for h in rec.hosts_lost
    )
    head, marker, error = rec.detail.partition("(lost a peer: ")
    detail = f"{head}{marker}{short_peer_error(error.removesuffix(')'))})" if marker else rec.detail
    return f"{lost} lost: {detail}" if lost else detail


def ranks(numbers: Sequence[int]) -> str:
    """ "rank 1", "ranks 2, 3"."""
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(map(str, numbers))}"


#: gloo's "[/path/to/pair.cc:545] " before its message, and torch's advice after it.
_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_peer_error(text: str) -> str:
    """A transport's lost-peer error, its first sentence without the source location:
    "Read error [127.0.0.1]:6061: Connection reset by peer"."""
    first = _SOURCE.sub("", text.strip()).split(". ", 1)[0]
    return first.rstrip(".") or text.strip()
