"""Building blocks of the SDC checks: which ranks a cross-rank check uses, who is lying
when three of them answer, and the mismatch and quarantine outputs.

Rank choice and bisection are pure functions of world size, ranks per node and values.
Node identity follows the RunStarted contract: rank r lives on node r // ranks_per_node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Protocol

from ....schemas import (
    CrossRankCheck,
    QuarantineNode,
    Reason,
    ReasonCode,
    RunNodeSelfTest,
    SdcMismatch,
    SdcSelfCheck,
)
from ..ids import derived_id
from ..state import RunState
from .sdc_state import AttemptSdc, SdcState


def _nodes(world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """(ranks per node clamped to the world, node count)."""
    rpn = max(1, min(ranks_per_node, world_size))
    return rpn, math.ceil(world_size / rpn)


def _rank_on(node: int, local: int, world_size: int, rpn: int) -> int:
    first = node * rpn
    return first + local % min(rpn, world_size - first)  # the last node may be partial


def cross_pair(world_size: int, ranks_per_node: int, k: int) -> list[int] | None:
    """The k-th cross-rank check's two ranks, on different nodes whenever there are two.

    The first node rotates over all nodes, its partner sits half the job away (usually
    another rack), and the local rank advances once every node has been visited, so the
    checks sweep every rank. None when the job has fewer than two ranks."""
    if world_size < 2:
        return None
    rpn, nodes = _nodes(world_size, ranks_per_node)
    if nodes < 2:
        a = k % world_size
        return [a, (a + 1) % world_size]
    node_a = k % nodes
    node_b = (node_a + nodes // 2) % nodes
    local = (k // nodes) % rpn
    return [_rank_on(node_a, local, world_size, rpn), _rank_on(node_b, local, world_size, rpn)]


def third_rank(world_size: int, ranks_per_node: int, ranks: Sequence[int]) -> int | None:
    """A rank to bisect a two-rank disagreement: on a node neither of `ranks` is on when
    one exists, else any other rank; None when the job has no third rank."""
    if world_size < 3:
        return None
    rpn, nodes = _nodes(world_size, ranks_per_node)
    used = {r // rpn for r in ranks}
    start = ranks[0] // rpn
    for i in range(1, nodes):
        node = (start + i) % nodes
        if node not in used:
            return _rank_on(node, ranks[0] % rpn, world_size, rpn)
    return next(
        (start + i) % world_size for i in range(1, world_size) if (start + i) % world_size not in ranks
    )


@dataclass(frozen=True)
class Bisection:
    """The verdict on three values of the same microbatch."""

    #: Index (into the values) of the one value that disagrees with two that agree.
    liar: int | None
    #: Index pairs whose values agree within the tolerance.
    agreeing: list[tuple[int, int]]
    #: liar: its distance from the agreeing pair's midpoint; otherwise the largest pairwise gap.
    deviation: float

    @property
    def all_agree(self) -> bool:
        return len(self.agreeing) == 3


def bisect_three(values: Sequence[float], tolerance: float) -> Bisection:
    """Three ranks computed the same microbatch. If exactly one pair agrees, the third
    value is the liar. Every pair agreeing means nothing reproduces; no pair agreeing,
    or a chain (a~b, b~c, a!~c), names nobody. Non-finite values agree with nothing."""
    gaps = {(i, j): abs(values[i] - values[j]) for i, j in combinations(range(3), 2)}
    agreeing = [pair for pair, gap in gaps.items() if gap <= tolerance]  # NaN compares False
    if len(agreeing) == 1:
        (j, k) = agreeing[0]
        liar = 3 - j - k
        return Bisection(liar, agreeing, abs(values[liar] - (values[j] + values[k]) / 2))
    finite = [gap for gap in gaps.values() if math.isfinite(gap)]
    return Bisection(None, agreeing, max(finite, default=math.nan))


# --------------------------------------------------------------------------- outputs


def world_of(run: RunState) -> int:
    """The run's world size; before RunStarted, one more than the highest rank seen."""
    return run.world_size or (max(run.ranks) + 1 if run.ranks else 0)


def watermark_text(state: SdcState, rank: int = -1) -> str:
    """Where the rollback bound lies: for a device named by a cross-rank check (a
    deterministic fault), its own cross-rank watermark; otherwise the self-check one."""
    if rank >= 0:
        verified = state.cross_watermark(rank)
        if verified < 0:
            return f"No cross-rank check that covered rank {rank} ever passed: no clean ancestor is known"
        return (
            f"The last cross-rank check that covered rank {rank} passed at step {verified}: "
            "roll back to the newest checkpoint at or before it"
        )
    return (
        f"Verification watermark frozen at step {state.last_passing_check_step}: "
        "roll back to the newest checkpoint at or before it"
    )


class CheckEvent(Protocol):
    """What an SdcMismatch is derived from: a check report (or a ring check's verdict)."""

    @property
    def event_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def ts(self) -> float: ...
    @property
    def microbatch_id(self) -> str: ...


def mismatch(
    run: RunState,
    event: CheckEvent | SdcSelfCheck | CrossRankCheck,
    *,
    method: str,
    rank: int,
    node: str,
    code: ReasonCode,
    text: str,
    tolerance: float | None = None,
    deviation: float | None = None,
    caused_by: list[str] | None = None,
) -> SdcMismatch:
    """The SdcMismatch revealed by `event`; rank/node name the faulty device (-1/'' if unknown)."""
    return SdcMismatch(
        event_id=derived_id("sdc_mismatch", event.event_id),
        run_id=run.run_id,
        attempt=run.attempt,
        rank=rank,
        node=node,
        step=event.step,
        ts=event.ts,
        reason=Reason(code=code, text=text),
        caused_by=caused_by or [event.event_id],
        method=method,
        microbatch_id=event.microbatch_id,
        tolerance=tolerance,
        deviation=deviation if deviation is None or math.isfinite(deviation) else None,
    )


def quarantine(
    current: AttemptSdc, run: RunState, found: SdcMismatch
) -> list[QuarantineNode | RunNodeSelfTest]:
    """For the node that computed a wrong answer, once per node per attempt: QuarantineNode,
    and RunNodeSelfTest on its ranks (seed §SDC (c): a GEMM / collective test with known
    answers before the node may return to the pool)."""
    if not found.node or found.node in current.quarantined:
        return []
    current.quarantined.add(found.node)
    ranks = sorted({found.rank} | {r for r, state in run.ranks.items() if state.node == found.node} - {-1})
    return [
        QuarantineNode(
            command_id=derived_id("quarantine_node", run.run_id, run.attempt, found.node),
            run_id=run.run_id,
            attempt=run.attempt,
            ranks=None,
            issued_ts=found.ts,
            reason=found.reason,
            caused_by=[found.event_id],
            node=found.node,
        ),
        RunNodeSelfTest(
            command_id=derived_id("run_node_self_test", run.run_id, run.attempt, found.node),
            run_id=run.run_id,
            attempt=run.attempt,
            ranks=ranks or None,
            issued_ts=found.ts,
            reason=Reason(
                code=ReasonCode.NODE_SELF_TEST,
                text=f"{found.node} computed a wrong answer (rank {found.rank}, {found.method} at step "
                f"{found.step}): run a GEMM / collective self-test with known answers on it before it "
                "returns to the pool",
            ),
            caused_by=[found.event_id],
            node=found.node,
        ),
    ]
