"""Lemon nodes kept out of a launch (issue 46): before its first attempt, the launcher
reads the nodes' failure history across runs from the archive (sinks/node_history.py;
the rule, trainguard/common/lemons.py: ``lemon_failures`` failures within
``lemon_days``) and keeps each lemon out of the run, with the rule's reason.

- On one host the lemons among the pool's modelled nodes leave the pool: the placement
  takes the next healthy node in their place, a spare when one of the job's own nodes is
  a lemon. Too few nodes left for the world: the run does not start, and says why.
- Across hosts (docs/multihost.md) each agent knows its own host only: an agent whose
  host is a lemon puts it on the run's shared quarantine list with the reason (the other
  agents read it there, and the agent itself, started again, is refused at once) and
  does not join.

Each exclusion is journaled before it takes effect, as a quarantine is (a ``command``
record keyed ``lemon:<node>``, its node in ``quarantine``): a relaunch keeps the same
nodes out whatever the archive says then, and adds the lemons it finds since. Each one
goes out as a NodeExcluded, whose id is the run's and the node's (a relaunch, or another
agent, repeats it and the core pages once), and is said on the console.

No archive (none configured, or none at the default place) or ``lemon_failures`` 0: no
node is kept out and nothing is said. An archive that cannot be read is warned about and
the launch goes on without the history: it informs the placement, it never stops a run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...common.lemons import Lemon, LemonPolicy
from ...schemas import NO_STEP, RUN_LEVEL_RANK, NodeExcluded, Reason, ReasonCode
from .config import LauncherConfig
from .events import LauncherEvents
from .liveness import newest_world
from .plan import NodePool, PoolExhausted, plan
from .run_state import LauncherState
from .shared_quarantine import SharedQuarantine
from .story import Story
from .world import NoWorld

log = logging.getLogger(__name__)

#: The journal's key of a node kept out (a ``command`` record; journal.py).
JOURNAL_KEY = "lemon:"
#: What a node kept out is listed for on the run's shared quarantine list (across hosts).
LISTED_AS = "kept out for its failure history: "


@dataclass(frozen=True)
class Exclusion:
    """A node kept out of the run, as journaled."""

    node: str
    failures: int
    window_days: float
    runs: tuple[str, ...]
    reason: str  # the rule's: "node-0007: 3 failures in 30 days across runs ...: crash in ..."
    #: The attempt its NodeExcluded names (_seen_attempt), the same whenever it is sent.
    attempt: int = 0

    @classmethod
    def of(cls, record: dict[str, Any]) -> Exclusion:
        lemon = record.get("lemon") or {}
        return cls(
            str(record["quarantine"]),
            int(lemon.get("failures", 0)),
            float(lemon.get("window_days", 0.0)) or 1.0,
            tuple(str(r) for r in lemon.get("runs", [])),
            str(record.get("detail", "")),
            int(record.get("attempt", 0)),
        )


class LemonGate:
    def __init__(
        self,
        config: LauncherConfig,
        pool: NodePool,
        state: LauncherState,
        events: LauncherEvents,
        story: Story,
        clock: Callable[[], float],
    ) -> None:
        self.config, self.pool, self.state, self.events = config, pool, state, events
        self.story, self.clock = story, clock

    def keep_out(self) -> None:
        """Before this launcher's first attempt (a relaunch's too): the lemons out of the
        run, journaled, sent and said. NoWorld: the run cannot start without them (one
        host), or this agent's host is one (across hosts)."""
        across = self.config.rendezvous is not None
        mine = {self.config.node} if across else set(self.pool.nodes)
        kept = self.journaled()
        if self.config.lemon_failures < 1:  # the history ignored, what was journaled included
            self._readmit(kept)
            return
        for lemon in self._found():
            if lemon.node in mine and lemon.node not in kept:
                kept[lemon.node] = self._journal(
                    Exclusion(lemon.node, len(lemon.failures), lemon.window_days, lemon.runs, lemon.reason)
                )
        for excluded in kept.values():
            self._announce(excluded, across)
        if across:
            if (own := kept.get(self.config.node)) is not None:
                self._refuse(own)
        elif kept:
            self._check_pool(kept)

    def journaled(self) -> dict[str, Exclusion]:
        """The nodes this run keeps out for their history, in the order they were decided."""
        with self.state.lock:
            records = [r for k, r in self.state.commands.items() if k.startswith(JOURNAL_KEY) and r.get("ok")]
        return {ex.node: ex for ex in map(Exclusion.of, records)}

    def _readmit(self, kept: dict[str, Exclusion]) -> None:
        """--lemon-failures 0: the nodes journaled as lemons are back (for this launcher: a
        relaunch with the rule on keeps them out again), unless out for another reason."""
        with self.state.lock:
            other = {
                r.get("quarantine")
                for k, r in self.state.commands.items()
                if r.get("ok") and not k.startswith(JOURNAL_KEY)
            }
            for node in kept:
                if node not in other:
                    self.state.quarantined.discard(node)

    def _found(self) -> list[Lemon]:
        cfg = self.config
        if not cfg.archive or cfg.lemon_failures < 1:
            return []
        try:
            from ...sinks.node_history import find_lemons  # DuckDB and Arrow: only with an archive

            return find_lemons(cfg.archive, LemonPolicy(cfg.lemon_failures, cfg.lemon_days), self.clock())
        except Exception as exc:  # the history informs the placement; it never stops a run
            log.warning(
                "trainguard: the archive at %s could not be read (%s): no node is kept out for its "
                "failure history",
                cfg.archive,
                exc,
            )
            return []

    def _journal(self, excluded: Exclusion) -> Exclusion:
        """Journaled before it takes effect, as a quarantine (journal.py's replay keeps it out)."""
        state, key = self.state, JOURNAL_KEY + excluded.node
        lemon = {
            "failures": excluded.failures,
            "window_days": excluded.window_days,
            "runs": list(excluded.runs),
        }
        with state.lock:
            state.commands[key] = state.journal.append(
                "command",
                key=key,
                kind=NodeExcluded.KIND,
                attempt=self._seen_attempt(),
                ok=True,
                detail=excluded.reason[:2000],
                quarantine=excluded.node,
                lemon=lemon,
            )
            state.quarantined.add(excluded.node)
        return Exclusion.of(state.commands[key])

    def _seen_attempt(self) -> int:
        """The newest attempt of the run that started (the core may have seen it begin), 0
        before any: the NodeExcluded goes out before the next attempt's RunStarted, and an
        event of an attempt the core has not seen would begin that attempt early there."""
        if self.config.rendezvous is not None:  # every host's journal on shared storage
            return max(0, newest_world(self.config.shared_dir)[0])
        spawned = [a.attempt for a in self.state.replayed.attempts.values() if a.spawned]
        return max(spawned, default=0)

    def _announce(self, excluded: Exclusion, across: bool) -> None:
        cfg = self.config
        rule = f"--lemon-failures {cfg.lemon_failures}, --lemon-days {cfg.lemon_days:g}"
        text = f"{excluded.reason}; kept out of run {cfg.run_id} (a lemon node: {rule})"
        self.events.emit(
            NodeExcluded,
            RUN_LEVEL_RANK,
            excluded.node,
            NO_STEP,
            key=f"excluded-{excluded.node}",
            attempt=excluded.attempt,
            shared=True,  # the run's decision about the node: one id whoever sends it
            failures=excluded.failures,
            window_days=excluded.window_days,
            runs=list(excluded.runs)[:64],
            reason=Reason(code=ReasonCode.LEMON_NODE, text=text[:2000]),
        )
        line = f"kept out of run {cfg.run_id}, {excluded.reason}"
        if across:
            self.story.say(line)
        else:
            log.warning("trainguard: %s", line)

    def _check_pool(self, kept: dict[str, Exclusion]) -> None:
        """One host: the world still fits the pool without the lemons, or the run stops."""
        with self.state.lock:
            out = set(self.state.quarantined)
        try:
            plan(self.pool, out, self.config.nproc)
        except PoolExhausted as exc:
            lemons, pool = sorted(n for n in kept if n in self.pool.nodes), len(self.pool.nodes)
            which = (
                f"every node of the pool ({pool}) is kept out for its failure history"
                if len(lemons) == pool
                else f"{len(lemons)} of the pool's {pool} nodes kept out for their failure history"
            )
            raise NoWorld(
                f"the run cannot start: {which} ({', '.join(lemons)}: each one's failures are said "
                f"above), and {exc}. Add spare nodes (--spares), or launch with --lemon-failures 0 "
                "to place ranks on them anyway",
                after_interruption=False,
            ) from None

    def _refuse(self, own: Exclusion) -> None:
        """Across hosts: this agent's host is a lemon. On the run's list for every agent (and
        for this one, started again: refused at once, shared_quarantine.refused_at_start)."""
        node = self.config.node
        SharedQuarantine(self.config.shared_dir).add(node, LISTED_AS + own.reason, by=node)
        raise NoWorld(
            f"{node} is kept out of run {self.config.run_id} for its failure history ({own.reason}): "
            "it does not join",
            after_interruption=False,
        )
