"""Elastic training across hosts (issue 45, docs/elastic.md): the survivors' roll call.

``trainguard launch --nnodes MIN:MAX --restart in-process`` with MIN < MAX. When a host is
lost, the other hosts' ranks leave the attempt alive (docs/inprocess.md). torch's
rendezvous would re-form the world without the lost host only once its keep-alives lapse
(``keep_alive_interval`` x ``keep_alive_max_attempt``, whole seconds, 3 s here) and a round
completes (its state polled once a second, then ``last_call_timeout``): 4-6 s. The
survivors need not wait for that: each one's agent answers a roll call in the store the
attempt's hosts already share (the round's own, hot.py's ``shared``), and the hosts that
answered within ``survivors_wait_s`` go on at once, in their processes, in a smaller world
(at least MIN hosts), without a new round. torch's round stays as it was (the lost host
drops out of it when its keep-alives lapse); a host that joins later waits in it, and the
world grows back at a checkpoint boundary (attempt.py's watch, hot.resize).

One decision per attempt, written once: the first agent that knows writes it with
``compare_set`` and every agent reads the same one, so two agents never go on in two
different worlds:

- every host of the attempt answered: no host was lost (a rank died on a host that is
  still there): ``rendezvous``, the restart goes through a round as before;
- ``survivors_wait_s`` passed: the hosts that answered, when at least MIN of them are not
  quarantined, form the next world (:func:`shrunk_plan`, the same plan a round's leader
  writes: the largest attempt proposed, the oldest resume step, rank 0 on the first host);
  fewer than MIN: ``rendezvous`` (a round waits for hosts to join);
- the processor said ``wait`` for this loss (InterruptionDecided.capacity): ``rendezvous``,
  a round of MIN..MAX hosts, which a host joining fills.

A host that answers after the decision and is not in it (slow, not lost) joins the next
round as a newcomer: the world grows back to it at the next checkpoint boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .rendezvous import Proposal, WorldPlan

log = logging.getLogger(__name__)

_ANSWER = "trainguard/roll/{}/{}"  # the interrupted attempt, a host's node name
_DECISION = "trainguard/roll/{}/decision"
#: The decision that the restart goes through a rendezvous round as before.
RENDEZVOUS = "rendezvous"
POLL_S = 0.02


@dataclass(frozen=True)
class RollCall:
    """The interrupted attempt and who was in it."""

    attempt: int
    hosts: tuple[str, ...]  # its hosts, in group-rank order
    min_nodes: int  # --nnodes MIN
    nproc_per_node: int
    wait_s: float  # survivors_wait_s


def shrunk_plan(call: RollCall, answers: Mapping[str, Proposal]) -> WorldPlan | None:
    """The next world of the hosts that answered, in their order, without the quarantined;
    None when none is missing or fewer than MIN would be left."""
    quarantined = tuple(sorted({n for p in answers.values() for n in p.quarantined}))
    going = tuple(h for h in call.hosts if h in answers and h not in quarantined)
    if all(h in answers for h in call.hosts) or len(going) < call.min_nodes:
        return None
    proposals = [answers[h] for h in going]
    first = proposals[0]
    return WorldPlan(
        attempt=max(p.next_attempt for p in proposals),
        resume=min((p.resume for p in proposals if p.resume is not None), default=-1),
        hosts=going,
        nproc_per_node=call.nproc_per_node,
        master_addr=first.addr,
        master_port=first.port,
        quarantined=quarantined,
    )


def roll_call(
    store: Any,
    call: RollCall,
    mine: Proposal,
    wait: bool = False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> WorldPlan | None:
    """Answer for this host (`mine`, with its address and a free port for rank 0's store)
    and return the attempt's decision: the plan of a smaller world (which may leave this
    host out), or None for a rendezvous round. `wait`: the processor's capacity decision
    says wait. The store is polled (a blocking get would hold its connection)."""
    decision = _DECISION.format(call.attempt)
    keys = {h: _ANSWER.format(call.attempt, h) for h in call.hosts}
    store.set(_ANSWER.format(call.attempt, mine.node), mine.to_json())
    deadline = clock() + call.wait_s
    answered: Sequence[str] = ()
    while not store.check([decision]):
        answered = [h for h, key in keys.items() if store.check([key])]
        if wait or len(answered) == len(keys):
            return _decided(store, decision, RENDEZVOUS)
        if clock() >= deadline:
            answers = {h: Proposal.from_json(bytes(store.get(keys[h]))) for h in answered}
            plan = shrunk_plan(call, answers)
            return _decided(store, decision, plan.to_json() if plan is not None else RENDEZVOUS)
        sleep(POLL_S)
    return _read(bytes(store.get(decision)).decode())


def _decided(store: Any, key: str, value: str) -> WorldPlan | None:
    """Write `value` unless a decision is there already; the one that stands."""
    return _read(bytes(store.compare_set(key, "", value)).decode())


def _read(value: str) -> WorldPlan | None:
    return None if value == RENDEZVOUS else WorldPlan.from_json(value)
