"""DrainNode, the launcher's side (issue 46; docs/prediction.md, "Draining a node"): take a
node out at a checkpoint boundary before it fails, so that a predicted failure costs a
planned stop instead of a crash, a restart and the work since the last checkpoint.

The command (commands.py) quarantines the node at once (journaled: a relaunched launcher
keeps it out) and puts the drain in force for the running attempt
(:class:`~.run_state.DrainRequest`). Then, in the attempt's watch (attempt.py):

- **In-process restart** (``--restart in-process``, ``--warm-spares K``, ``--min-nproc``):
  the mechanism of elastic training's grow-back (issue 45), one mechanism with a cause per
  use. :func:`ask` sets ``resize/<attempt>`` in the control store with the drain's deadline
  (hot.resize; the value names ``within_s`` from now, so the per-command deadline reaches
  the ranks, not only TRAINGUARD_GROW_WITHIN_S). Each rank's watch notes it; the per-step
  agreement carries it (checkpoint code 2) at the checkpoint the cadence makes due or, at
  the latest, at the first step after the deadline; the ranks save and validate that
  checkpoint and leave the attempt there, in their processes (``WorldResize``). The watch
  records the interruption (:func:`left_at_boundary`: cause drain, requested exits, no lost
  peer) and the next attempt resumes from exactly that step: the drained node's ranks on
  the next healthy spare node (plan.py), taken by warm spares when ready, else by new
  processes; under elastic training with fewer ready than the node's ranks, the survivors
  go on in a smaller world and grow back once the new processes are ready (elastic.py:
  a drain gets no capacity decision from the processor, which declares the planned
  interruption only when the next attempt starts, so the launcher applies its own choice
  for "no answer").
- **Full restarts**: no store reaches the ranks, so the eviction path: the attempt is torn
  down once a checkpoint newer than the newest at the command is validated
  (:func:`due_in_full`), and the next one resumes from it. The steps trained between that
  checkpoint and the teardown are redone, and ``within_s`` is not enforced (the cadence's
  next checkpoint is the boundary).
- **Across hosts** (``--nnodes``): every host's agent executes the command. Its ranks leave
  at the same boundary (the agreement is one all-reduce over every host's ranks); the
  drained host goes on the run's shared list only then (commands.py ``published``: earlier, a
  ``--spare`` agent would join at once, and without elastic training the world would
  re-form for it at once, losing steps); the drained host's agent refuses the next round
  (quarantined), the others form it, and a spare host joins in its place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .records import RestartCause, RestartPhases
from .run_state import DrainRequest, LauncherState

if TYPE_CHECKING:
    from .hot import HotRanks
    from .restarts import RestartRecorder
    from .resume import ResumeChoice
    from .story import Story

log = logging.getLogger(__name__)

#: Under full restarts: how often the watch lists the checkpoints while a drain waits.
POLL_LISTING_S = 0.5


def in_force(state: LauncherState, attempt: int) -> DrainRequest | None:
    """Under the lock: the drain in force for `attempt` (None: none)."""
    drain = state.drain
    return drain if drain is not None and drain.attempt == attempt else None


def draining(state: LauncherState, node: str) -> bool:
    """Under the lock: `node` leaves at the running attempt's next boundary (its
    quarantine must not end the attempt before: attempt.py's watch across hosts)."""
    drain = state.drain
    return drain is not None and node in drain.nodes


def ask(
    hot: HotRanks, state: LauncherState, attempt: int, clock: Callable[[], float], story: Story | None
) -> None:
    """In-process restart, in the watch: ask `attempt`'s ranks for a planned leave at the
    next checkpoint boundary, once per drain deadline (a later drain of the same attempt
    with an earlier deadline asks again)."""
    with state.lock:
        drain = in_force(state, attempt)
        if drain is None or drain.asked_by == drain.deadline_ts:
            return
        drain.asked_by = drain.deadline_ts
        nodes, deadline, why = ", ".join(drain.nodes), drain.deadline_ts, drain.why
    within = max(0.0, deadline - clock())
    hot.resize(attempt, within, f"drain {nodes}: {why}")
    line = (
        f"draining {nodes}: attempt {attempt}'s ranks leave at their next checkpoint boundary "
        f"(the cadence's, or one within {within:.0f} s), in their processes"
    )
    log.warning("trainguard: %s", line)
    if story is not None:
        story.say(line)


def left_at_boundary(
    restarts: RestartRecorder, state: LauncherState, attempt: int, left: str, now: float
) -> RestartPhases | None:
    """The ranks of `attempt` left at the checkpoint they agreed on (`left`: what the
    first one said, "the world is resized at the checkpoint of step N"): the drain's
    interruption when one is in force (None: a resize)."""
    with state.lock:
        drain = in_force(state, attempt)
        if drain is None:
            return None
        nodes, ids, why = list(drain.nodes), list(drain.command_ids), drain.why
    step = left.rpartition("step ")[2]
    detail = f"{', '.join(nodes)} drained at the checkpoint of step {step}: {why}"
    return restarts.interruption(
        RestartCause.DRAIN, detail, attempt, now, now, node=nodes[0], command_id=ids[0]
    )


def due_in_full(
    restarts: RestartRecorder, resume: ResumeChoice, state: LauncherState, attempt: int, now: float
) -> RestartPhases | None:
    """Full restarts, in the watch: once a checkpoint newer than the newest at the
    command is validated, the drain's interruption (the caller tears the attempt down)."""
    with state.lock:
        drain = in_force(state, attempt)
        if drain is None:
            return None
        after, nodes, ids, why = drain.after_step, list(drain.nodes), list(drain.command_ids), drain.why
    newest = resume.newest(max_age_s=POLL_LISTING_S)
    if newest <= after:
        return None
    detail = (
        f"{', '.join(nodes)} drained once the checkpoint of step {newest} was validated (full "
        f"restart: the steps after the one resumed from are redone): {why}"
    )
    return restarts.interruption(
        RestartCause.DRAIN, detail, attempt, now, now, node=nodes[0], command_id=ids[0]
    )
