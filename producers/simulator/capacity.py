"""The simulated launcher's elastic side (issue 45): replacements that take time to arrive
(Scenario.replacement_s), the processor's capacity decision for each interruption, and the
world each attempt trains at, kept out of the cluster's state machine (cluster.py).

A node quarantined while no spare is at hand is replaced `replacement_s` later. A restart
that finds a replacement still missing follows the processor's InterruptionDecided: wait
(stay down until it arrives, then restart at full size) or shrink (go on at once with the
survivors at the decision's world size, the ranks renumbered over the nodes left in their
order, each step W/W' as long for the same global batch). Without a decision after
`decision_wait_s` it applies the shared rule itself (trainguard/common/elastic.py), as a
launcher does when the processor does not answer. A shrunk world grows back at the first
checkpoint after every replacement is in (a planned stop, cluster.py's
``_stop_after_checkpoint``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...common.elastic import choose, worlds
from .scenario import Scenario


@dataclass(frozen=True, slots=True)
class World:
    """An attempt's world: its ranks, and the node indices (of the full layout) they run
    on, in rank order (rank r runs on node index slots[r // ranks_per_node])."""

    size: int
    slots: tuple[int, ...]


@dataclass
class Capacity:
    scenario: Scenario
    #: Node index -> when its replacement is in (only while replacements take time).
    arrival: dict[int, float] = field(default_factory=dict)
    #: The processor's capacity decision per interrupted attempt: (wait|shrink, world).
    decisions: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    #: Since when a restart waits for the decision of the attempt that ended (None: not).
    awaiting: float | None = None
    #: Decisions the launcher took itself, the processor silent: (attempt, action, reason).
    own: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def elastic(self) -> bool:
        return self.scenario.replacement_s > 0

    def spares(self) -> int:
        """Spares ready, as RunStarted says it: none while replacements take time; else one
        for every node (a pool that never runs dry)."""
        return 0 if self.elastic else self.scenario.node_count

    def lost(self, index: int, now: float) -> float | None:
        """Node `index` leaves the pool now: when its replacement arrives (None: at once)."""
        if not self.elastic:
            return None
        return self.arrival.setdefault(index, now + self.scenario.replacement_s)

    def missing(self, indices: set[int], now: float) -> list[int]:
        """Of the nodes to replace, those whose replacement is not in yet."""
        return sorted(i for i in indices if self.arrival.get(i, now) > now)

    def arrived(self, index: int, now: float) -> bool:
        return self.arrival.get(index, now) <= now

    def full(self) -> World:
        return World(self.scenario.world_size, tuple(range(self.scenario.node_count)))

    def plan(self, attempt: int, missing: list[int], now: float) -> World | float | None:
        """The next attempt's world with `missing` nodes' replacements not in: a smaller one
        (shrink), a time to restart at instead (wait: the last arrival), or None to wait
        for the processor's decision of `attempt` (the attempt that ended)."""
        decision = self.decisions.get(attempt)
        if decision is None:
            if self.awaiting is None:
                self.awaiting = now
            if now < self.awaiting + self.scenario.decision_wait_s:
                return None
            decision = self._own(attempt, missing, now)
        self.awaiting = None
        action, size = decision
        if action != "shrink":
            return max(self.arrival[i] for i in missing)
        return self._smaller(missing, size)

    def _smaller(self, missing: list[int], size: int | None) -> World:
        sc = self.scenario
        per = sc.ranks_per_node
        left = [i for i in range(sc.node_count) if i not in missing]
        ranks = [min(per, sc.world_size - i * per) for i in left]
        target = min(size or sum(ranks), sum(ranks))
        slots: list[int] = []
        count = 0
        for index, n in zip(left, ranks, strict=True):
            if count >= target:
                break
            slots.append(index)
            count += n
        return World(min(target, count), tuple(slots))

    def _own(self, attempt: int, missing: list[int], now: float) -> tuple[str, int | None]:
        """No answer from the processor: the shared rule, with what this launcher knows (the
        replacement's arrival; its own restart and checkpoint times as the costs)."""
        sc = self.scenario
        survivors = sum(
            min(sc.ranks_per_node, sc.world_size - i * sc.ranks_per_node)
            for i in range(sc.node_count)
            if i not in missing
        )
        eta = max(self.arrival[i] for i in missing) - now
        restart = sc.restart_delay_s
        choice = choose(
            sc.world_size,
            survivors,
            math.ceil(sc.world_size / 2),
            max(0.0, eta),
            restart,
            restart,
            restart + sc.checkpoint_validate_s,
            worlds(survivors, sc.ranks_per_node),
            boundary_s=sc.checkpoint_every * sc.step_time_s / 2,
        )
        action = "shrink" if choice.action == "shrink" else "wait"
        self.own.append((attempt, action, choice.reason))
        return action, choice.world_size if action == "shrink" else None
