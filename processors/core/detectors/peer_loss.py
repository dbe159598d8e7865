"""Whose fault is a crash that every survivor reports? (issue 17)

When a whole host is lost (power, kernel panic, its agent killed with its ranks), nobody
reports its ranks' exits, and every other rank's collective fails at once ("connection
reset by peer"): the first RankExit to reach the core is an innocent survivor's. Taken
as the culprit, it would quarantine a healthy host and leave the lost one in the pool.

So an exit marked ``peer_lost`` (the rank's own error said a peer was lost:
producers/training/peer_loss.py) names nobody. It opens a wait, which ends with:

- the culprit's own exit (any crash not marked peer_lost, e.g. a rank killed by a
  signal, an exception of its own): the engine's usual crash path names it;
- the next attempt's start (its RunStarted names the hosts of the new world), or the
  policy's window after the first such exit: the hosts none of whose ranks reported an
  exit, and that are not in the new world, were lost. The first is the culprit (its
  node is quarantined by the usual policy), each other one is quarantined too;
- every rank reported, each of a lost peer (a network partition, a switch): culprit
  unknown, nothing quarantined.

A lost host can reach the core as a hang first: its ranks stop, and on a loaded machine the
watchdog fires before the survivors' collectives fail. Their peer-lost exits during the
hang's stack window open this wait all the same; when the window closes with no culprit in
the stacks and a host silent, the hang hands over to this wait (engine._maybe_conclude_hang),
which names the host as above; stacks that name a culprit keep the hang's verdict. The
survivors may never report a lost peer (the hang's Abort ended them first): the hang opens
the wait then, and if no host turns out lost, its own verdict stands. The next attempt's
start closes a hang's stack window still open (its ranks are gone). No new hang is declared
while the wait is open (watchdog.is_hung): the attempt has ended.

A rank's host is the one it reported from, else the attempt's placement (RunStarted);
silence alone never names a host unless other ranks' exits said a peer was lost, and a
host in the next world is alive: a slow launcher is not a lost host.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ....schemas import Derived, InterruptionCause, RankExit, Reason, ReasonCode
from ..decisions.quarantine import take_out
from ..outputs import abort_for
from ..policy import CrashPolicy
from ..state import PendingCrash, PendingHang, RunState


def on_exit(run: RunState, event: RankExit) -> None:
    """A rank died of a lost peer: the wait opens with the first such exit."""
    if run.pending_crash is None:
        run.pending_crash = PendingCrash(event.event_id, event.ts)


def after_hang(run: RunState, hang: PendingHang) -> None:
    """A hang's stacks named nobody while a host went silent (engine._maybe_conclude_hang):
    the wait opens with the hang, if no peer-lost exit opened it first. The survivors may
    never say they lost a peer: the hang's Abort can end them before their collectives fail."""
    if run.pending_crash is None:
        run.pending_crash = PendingCrash(hang.event_id, hang.detected_ts, hang=hang)


def hang_stands(run: RunState, next_nodes: Collection[str] | None) -> PendingHang | None:
    """The hang that opened the wait, when the wait ends with no host lost: its verdict
    stands (conclude would blame a lost peer that no rank reported)."""
    pending = run.pending_crash
    if pending is None or pending.hang is None or silent_hosts(run, next_nodes):
        return None
    return pending.hang


def due(run: RunState, policy: CrashPolicy) -> bool:
    """The wait is over: its window passed (the run's clock: the newest event or tick), or
    every rank of the attempt reported its exit."""
    pending = run.pending_crash
    if pending is None:
        return False
    if run.last_ts >= pending.first_ts + policy.peer_loss_window_s:
        return True
    world = run.world_size or len(run.ranks)
    return world > 0 and all(r in run.ranks and run.ranks[r].exited for r in range(world))


def node_of_rank(run: RunState, rank: int) -> str:
    """Where `rank` runs: the node it reported from, else the attempt's placement (a
    sharded run's coordinator hears other shards' ranks only through their exits)."""
    state = run.ranks.get(rank)
    if state is not None and state.node:
        return state.node
    index = rank // max(1, run.ranks_per_node)
    return run.nodes[index] if index < len(run.nodes) else ""


def silent_hosts(run: RunState, next_nodes: Collection[str] | None) -> list[str]:
    """Hosts none of whose ranks reported an exit, and that are not in the next world
    (when it is known)."""
    exited: dict[str, bool] = {}
    world = run.world_size or len(run.ranks)
    for r in sorted(set(range(world)) | set(run.ranks)):
        node = node_of_rank(run, r)
        if node:
            exited[node] = exited.get(node, False) or (r in run.ranks and run.ranks[r].exited)
    in_next = set(next_nodes) if next_nodes is not None else set()
    return sorted(n for n, any_exit in exited.items() if not any_exit and n not in in_next)


def conclude(
    run: RunState, next_nodes: Collection[str] | None, interruption: Callable[..., Any]
) -> list[Derived | Any]:
    """End the wait: the interruption, naming the lost host (or nobody), and its abort;
    every further lost host is quarantined as well. `interruption` is the engine's."""
    pending = run.pending_crash
    assert pending is not None
    run.pending_crash = None
    peers = sorted(r for r, s in run.ranks.items() if s.exited)
    lost = silent_hosts(run, next_nodes)
    world = run.world_size or len(run.ranks)
    every = sorted(set(range(world)) | set(run.ranks))
    ranks_of = {n: [r for r in every if node_of_rank(run, r) == n] for n in lost}
    if lost:
        hosts = ", ".join(f"{n} (ranks {ranks_of[n]})" for n in lost)
        culprit, reason = (
            ranks_of[lost[0]][0],
            Reason(
                code=ReasonCode.HOST_LOST,
                text=f"host lost: {hosts}: none of its ranks reported an exit while {len(peers)} ranks "
                + (
                    "of other hosts died of a lost peer"
                    if pending.hang is None
                    else "of other hosts answered the hang's stack dump"
                )
                + (" and the next world formed without it" if next_nodes is not None else ""),
            ),
        )
    else:
        culprit, reason = (
            -1,
            Reason(
                code=ReasonCode.PEER_LOST,
                text=f"{len(peers)} ranks died of a lost peer and no host went silent (every host "
                "reported exits): culprit unknown, nothing quarantined",
            ),
        )
    declared = interruption(
        run,
        cause=InterruptionCause.CRASH,
        detected_by="peer_loss",
        cause_id=pending.event_id,
        at=pending.first_ts,
        culprit=culprit,
        reason=reason,
    )
    if lost:  # placed, when its ranks never reported here
        declared = declared.model_copy(update={"node": lost[0]})
    outputs: list[Any] = [declared, abort_for(run, declared, stack_dump=False)]
    for node in lost[1:]:  # the engine's quarantine policy takes the culprit's node out
        why = Reason(
            code=ReasonCode.QUARANTINE,
            text=f"node {node} was lost with {lost[0]} in interruption {declared.interruption_id[:12]} "
            f"of run {run.run_id}; out of the pool before the restart",
        )
        found = take_out(
            run.run_id, run.attempt, ranks_of[node][0], node, declared.step, declared.ts, why,
            cause_id=f"{declared.interruption_id}:{node}",
        )  # fmt: skip
        outputs += found
    return outputs
