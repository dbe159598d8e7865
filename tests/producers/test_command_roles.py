"""Every command kind is executed by a real handler in every role that must execute it
(producers/command_roles.py): the rank process, the launcher, the simulated cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.producers.command_roles import EXECUTED_BY, CommandHandlers, Role, missing_handlers
from trainguard.producers.launcher.launcher import Launcher
from trainguard.producers.rank.agent import MemorySink, RankAgent
from trainguard.producers.rank.handlers import RankControl, RankHandlers
from trainguard.producers.simulator import Scenario, SimulatedCluster
from trainguard.producers.simulator.longrun import LongRun, _Sim, simulate
from trainguard.schemas import Envelope, Reason, ReasonCode
from trainguard.schemas.commands import COMMAND_KINDS, Abort, Command, QuarantineNode, SetCheckpointInterval

from .launcher.test_launcher import make_launcher

REASON = Reason(code=ReasonCode.OPERATOR, text="test")


class Registrations:
    """An actuator's `register` and `set_attempt`, recorded."""

    def __init__(self) -> None:
        self.kinds: list[type[Command]] = []

    def register(self, kind: type[Command], handler: Any) -> None:
        assert callable(handler)
        self.kinds.append(kind)

    def set_attempt(self, attempt: int) -> None:
        pass


def rank_role(tmp_path: Path) -> RankHandlers:
    agent = RankAgent(MemorySink(), "run-1", attempt=0, rank=0, node="node-0")
    return RankHandlers(agent, RankControl(), tmp_path)


def launcher_role(tmp_path: Path) -> Launcher:
    return make_launcher(tmp_path, MemorySink(), {})


def simulator_role(tmp_path: Path) -> SimulatedCluster:
    return SimulatedCluster(Scenario.builtin("demo"), 1_000.0, run_id="run-1")


ROLES = {Role.RANK: rank_role, Role.LAUNCHER: launcher_role, Role.SIMULATOR: simulator_role}


def test_every_command_kind_says_which_roles_execute_it() -> None:
    assert set(EXECUTED_BY) == set(COMMAND_KINDS)
    assert all(EXECUTED_BY[kind] for kind in COMMAND_KINDS)
    assert set(ROLES) == set(Role)  # a new role gets a row here


@pytest.mark.parametrize("role", list(Role))
def test_each_role_has_a_handler_for_every_kind_it_must_execute(role: Role, tmp_path: Path) -> None:
    handlers: CommandHandlers = ROLES[role](tmp_path)
    assert missing_handlers(role, handlers) == []


@pytest.mark.parametrize("role", [Role.RANK, Role.LAUNCHER])
def test_the_actuator_is_given_exactly_the_roles_table(role: Role, tmp_path: Path) -> None:
    handlers: Any = ROLES[role](tmp_path)
    actuator = Registrations()
    handlers.register(actuator)
    assert sorted(k.KIND for k in actuator.kinds) == sorted(k.KIND for k in handlers.command_handlers())


def test_a_missing_handler_is_named() -> None:
    class Partial:
        def command_handlers(self) -> dict[type[Command], Any]:
            kinds = [k for k in COMMAND_KINDS if Role.RANK in EXECUTED_BY[k]]
            return {k: print for k in kinds[1:]}

    first = next(k for k in COMMAND_KINDS if Role.RANK in EXECUTED_BY[k])
    assert missing_handlers(Role.RANK, Partial()) == [f"rank: no handler for {first.KIND}"]


def test_the_long_run_model_executes_its_kinds_through_its_table() -> None:
    """The month-long run-level model (simulator/longrun.py) keeps only the interval and
    the node pool; its table is the simulator role's for those kinds, and what the core
    sends reaches the run through it (other kinds are not modelled, and pass)."""
    run = LongRun(world_size=64, ranks_per_node=8, nodes_per_rack=4, days=2.0, mtbf_s=6 * 3600.0)
    sent: list[str] = []

    def core(event: Envelope) -> list[Command]:
        if sent:
            return []
        sent.append(event.KIND)
        common = dict(run_id=run.run_id, attempt=0, issued_ts=event.ts, reason=REASON)
        return [
            SetCheckpointInterval(command_id="i1", interval_s=900.0, **common),
            QuarantineNode(command_id="q1", node="n00003", **common),
            Abort(command_id="a1", **common),
        ]

    truth = simulate(run, core, interval_s=1800.0)
    assert [interval for _, interval in truth.intervals] == [1800.0, 900.0]
    assert truth.failures > 0 and truth.quarantined == ["n00003"]  # replaced at the first restart
    kinds = set(_Sim(run, 1800.0).command_handlers())
    assert kinds == {SetCheckpointInterval, QuarantineNode}
    assert all(Role.SIMULATOR in EXECUTED_BY[k] for k in kinds)
