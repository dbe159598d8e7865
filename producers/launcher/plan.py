"""Where the ranks of an attempt run: the node pool, quarantine and spares (pure, no I/O).

One machine models a cluster: a *node* is a named group of ``ranks_per_node`` ranks
(the node of rank r is ``nodes[r // ranks_per_node]``, as in
:class:`~trainguard.schemas.RunStarted`). The pool is an ordered list of node names:
the first ``slots`` are the job's nodes, the rest are spares, used in pool order.

:func:`plan` maps (pool, quarantined nodes, world size) to a :class:`Placement`. It is
slot-stable: given the previous placement, a slot keeps its node while that node is
healthy, so only the ranks of a quarantined node move (to the next unused healthy
spare), never the ranks of healthy nodes. A quarantined node never gets a rank again.
When no healthy node is left for a slot, :class:`PoolExhausted` says which nodes are
out and how many more are needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class PoolExhausted(ValueError):
    """Too few healthy nodes left to place the whole world."""


@dataclass(frozen=True)
class NodePool:
    """The machines a run may use, in preference order, and each one's rack."""

    nodes: tuple[str, ...]
    ranks_per_node: int
    racks: dict[str, str]

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("node names in a pool must be unique")

    def slots(self, world_size: int) -> int:
        """Nodes a world of `world_size` ranks occupies (the last one may be partly used)."""
        return -(-world_size // self.ranks_per_node)


def make_pool(world_size: int, ranks_per_node: int, spares: int = 2, nodes_per_rack: int = 4) -> NodePool:
    """``node-0000``… for the job, then ``spare-0000``… (racks of `nodes_per_rack` nodes
    over the whole list, so spares sit in racks of their own after the job's)."""
    if world_size < 1 or spares < 0 or nodes_per_rack < 1:
        raise ValueError("world_size >= 1, spares >= 0 and nodes_per_rack >= 1 are required")
    slots = -(-world_size // ranks_per_node)
    names = [f"node-{i:04d}" for i in range(slots)] + [f"spare-{i:04d}" for i in range(spares)]
    racks = {name: f"rack-{i // nodes_per_rack:02d}" for i, name in enumerate(names)}
    return NodePool(tuple(names), ranks_per_node, racks)


@dataclass(frozen=True)
class Placement:
    """The node of every slot in one attempt."""

    nodes: tuple[str, ...]
    ranks_per_node: int
    world_size: int
    #: Slots whose node changed from the previous placement: slot -> (old, new).
    moved: dict[int, tuple[str, str]]

    def node_of(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return self.nodes[rank // self.ranks_per_node]

    def ranks_of(self, node: str) -> list[int]:
        return [r for r in range(self.world_size) if self.nodes[r // self.ranks_per_node] == node]


def plan(
    pool: NodePool,
    quarantined: Iterable[str],
    world_size: int,
    previous: Placement | None = None,
) -> Placement:
    """Place `world_size` ranks on healthy nodes of `pool`.

    Without `previous`, slot i gets pool node i when healthy; a slot whose node is
    quarantined (or any slot, if `previous` is given and its node is still healthy, keeps
    that node) takes the first healthy pool node not used by another slot, in pool order
    after the job's own nodes (the spares)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    out = frozenset(quarantined)
    slots = pool.slots(world_size)
    if previous is not None and (
        previous.world_size != world_size or previous.ranks_per_node != pool.ranks_per_node
    ):
        previous = None  # a different shape: nothing to keep stable
    wanted: list[str | None] = []
    for i in range(slots):
        keep = previous.nodes[i] if previous is not None else pool.nodes[i] if i < len(pool.nodes) else None
        wanted.append(keep if keep is not None and keep not in out else None)
    used = {n for n in wanted if n is not None}
    free = iter([n for n in pool.nodes if n not in out and n not in used])
    chosen: list[str] = []
    moved: dict[int, tuple[str, str]] = {}
    for i, node in enumerate(wanted):
        if node is None:
            node = next(free, None)
            if node is None:
                missing = sum(1 for n in wanted[i:] if n is None)
                raise PoolExhausted(
                    f"cannot place {world_size} ranks on {slots} nodes of {pool.ranks_per_node}: "
                    f"{missing} more healthy node(s) needed; quarantined: {sorted(out) or 'none'}; "
                    f"pool: {len(pool.nodes)} nodes"
                )
        chosen.append(node)
        before = previous.nodes[i] if previous is not None else pool.nodes[i] if i < len(pool.nodes) else ""
        if before and before != node:
            moved[i] = (before, node)
    return Placement(tuple(chosen), pool.ranks_per_node, world_size, moved)


def quarantine_effect(
    pool: NodePool, quarantined: Iterable[str], node: str, world_size: int, previous: Placement | None
) -> str:
    """What taking `node` out of the pool will do at the next restart (an ack's detail)."""
    try:
        nxt = plan(pool, {*quarantined, node}, world_size, previous)
    except PoolExhausted as exc:
        return f"{node} left the pool; the next restart will fail: {exc}"
    moved = ", ".join(f"{old}->{new}" for old, new in nxt.moved.values()) or "no rank moves"
    return f"{node} leaves the pool at the next restart ({moved})"
