"""CommandGate: the pure decision half of the actuator (no broker)."""

from __future__ import annotations

from pathlib import Path

from trainguard.producers.command_roles import Role, kinds_of
from trainguard.producers.rank.gate import CommandGate, GateOutcome, GateVerdict, RefuseReason
from trainguard.schemas import (
    RUN_LEVEL_RANK,
    CheckpointNow,
    Command,
    EvictRank,
    QuarantineNode,
    Reason,
    ReasonCode,
    auth,
    encode,
)

SECRET = b"s" * 32
RUN = "run-gate"
KEY = auth.run_key(SECRET, RUN)


def command(
    command_id: str = "cmd-1", run_id: str = RUN, attempt: int = 0, ranks: list[int] | None = None
) -> Command:
    return CheckpointNow(
        command_id=command_id,
        run_id=run_id,
        attempt=attempt,
        ranks=ranks,
        issued_ts=100.0,
        reason=Reason(code=ReasonCode.OPERATOR, text="test"),
    )


def signed(cmd: Command, key: bytes = KEY) -> bytes:
    return encode(auth.sign(cmd, key))


def gate(tmp_path: Path | None = None, attempt: int = 0, ranks: tuple[int, ...] = (0, 1)) -> CommandGate:
    journal = tmp_path / "journal.jsonl" if tmp_path is not None else None
    return CommandGate(RUN, attempt, ranks, KEY, journal_path=journal)


def test_valid_command_executes_once_per_targeted_rank() -> None:
    g = gate(ranks=(0, 1, 2))
    decision, verdicts = g.admit(signed(command(ranks=[0, 2, 7])))
    assert decision.outcome is GateOutcome.ACCEPTED
    assert decision.ranks == (0, 2)
    assert verdicts == {0: GateVerdict.EXECUTE, 2: GateVerdict.EXECUTE}
    assert g.counters.executed == 2


def test_redelivery_is_a_duplicate() -> None:
    g = gate()
    raw = signed(command())
    _, first = g.admit(raw)
    _, second = g.admit(raw)
    assert first == {0: GateVerdict.EXECUTE, 1: GateVerdict.EXECUTE}
    assert second == {0: GateVerdict.DUPLICATE, 1: GateVerdict.DUPLICATE}
    assert (g.counters.executed, g.counters.duplicate) == (2, 2)


def test_forged_command_is_refused() -> None:
    g = gate()
    forged = signed(command(), key=auth.run_key(b"x" * 32, RUN))
    decision, verdicts = g.admit(forged)
    assert decision.outcome is GateOutcome.REFUSED
    assert decision.reason is RefuseReason.BAD_SIGNATURE
    assert verdicts == {}
    assert g.counters.refused == {RefuseReason.BAD_SIGNATURE: 1}
    assert g.counters.executed == 0


def test_unsigned_command_is_refused() -> None:
    decision, _ = gate().admit(encode(command()))
    assert decision.reason is RefuseReason.BAD_SIGNATURE


def test_tampered_fields_are_refused() -> None:
    g = gate(attempt=1)
    original = auth.sign(command(ranks=[3]), KEY)
    for change in ({"ranks": [0, 1]}, {"attempt": 1}, {"command_id": "cmd-other"}):
        decision, verdicts = g.admit(encode(original.model_copy(update=change)))
        assert decision.outcome is GateOutcome.REFUSED, change
        assert decision.reason is RefuseReason.BAD_SIGNATURE, change
        assert verdicts == {}
    # A different kind with the same fields and signature is tampering too.
    as_evict = EvictRank(**original.model_dump(), rank=0)
    assert g.admit(encode(as_evict))[0].reason is RefuseReason.BAD_SIGNATURE
    assert g.counters.refused == {RefuseReason.BAD_SIGNATURE: 4}


def test_stale_attempt_is_refused() -> None:
    g = gate(attempt=0)
    g.set_attempt(2)
    decision, verdicts = g.admit(signed(command(attempt=1)))
    assert decision.outcome is GateOutcome.REFUSED
    assert decision.reason is RefuseReason.STALE_ATTEMPT
    assert "attempt 1" in decision.detail and "attempt 2" in decision.detail
    assert verdicts == {}
    assert g.admit(signed(command(attempt=2)))[1] == {0: GateVerdict.EXECUTE, 1: GateVerdict.EXECUTE}


def test_a_quarantine_from_an_earlier_attempt_is_accepted_a_later_one_is_not() -> None:
    """A node's fault outlives the attempt that found it (across hosts the lost host is
    named once the next attempt has started); a command for a future attempt is not."""
    g = CommandGate(RUN, 0, (0,), KEY, executes=kinds_of(Role.LAUNCHER))
    g.set_attempt(1)

    def quarantine(attempt: int) -> bytes:
        body = command(command_id=f"q-{attempt}", attempt=attempt).model_dump(exclude={"ranks"})
        return signed(QuarantineNode(**body, ranks=None, node="host-b"))

    assert g.admit(quarantine(0))[0].outcome is GateOutcome.ACCEPTED
    assert g.admit(quarantine(2))[0].reason is RefuseReason.STALE_ATTEMPT
    assert g.admit(signed(command(attempt=0)))[0].reason is RefuseReason.STALE_ATTEMPT  # not a node's


def test_other_run_is_ignored_silently() -> None:
    g = gate()
    other = signed(command(run_id="run-other"), key=auth.run_key(SECRET, "run-other"))
    decision, verdicts = g.admit(other)
    assert decision.outcome is GateOutcome.OTHER_RUN
    assert verdicts == {}
    assert g.counters.other_run == 1
    assert g.counters.refused_total == 0


def test_undecodable_bytes_are_refused_with_the_codec_reason() -> None:
    g = gate()
    cases = {
        b"\xff\x00 not json": "malformed",
        b"[1, 2]": "not_an_object",
        b'{"schema": "heartbeat/1", "run_id": "run-gate"}': "wrong_record_type",
        b'{"schema": "checkpoint_now/9", "run_id": "run-gate", "command_id": "c9"}': "unknown_version",
    }
    for raw, codec_reason in cases.items():
        decision, verdicts = g.admit(raw)
        assert decision.outcome is GateOutcome.REFUSED, raw
        assert decision.reason is RefuseReason.UNDECODABLE
        assert decision.detail.startswith(codec_reason), decision.detail
        assert verdicts == {}
    # Readable id of an undecodable command of this run, for its REFUSED ack.
    assert (
        g.check(b'{"schema": "checkpoint_now/9", "run_id": "run-gate", "command_id": "c9"}').command_id
        == "c9"
    )
    # An undecodable record that names another run is that run's business.
    assert g.check(b'{"schema": "checkpoint_now/9", "run_id": "elsewhere"}').outcome is GateOutcome.OTHER_RUN
    assert g.counters.refused == {RefuseReason.UNDECODABLE: 5}


def test_untargeted_command_needs_no_action() -> None:
    g = gate(ranks=(0, 1))
    decision, verdicts = g.admit(signed(command(ranks=[5])))
    assert decision.outcome is GateOutcome.ACCEPTED
    assert (decision.ranks, verdicts) == ((), {})
    assert g.counters.untargeted == 1


def test_journal_survives_a_new_gate(tmp_path: Path) -> None:
    raw = signed(command())
    first = gate(tmp_path)
    assert first.admit(raw)[1] == {0: GateVerdict.EXECUTE, 1: GateVerdict.EXECUTE}
    first.close()
    # A torn last line (crash mid-write) must not break the reload.
    with (tmp_path / "journal.jsonl").open("ab") as fh:
        fh.write(b'["run-gate", 0, "cmd-to')
    second = gate(tmp_path)
    assert second.admit(raw)[1] == {0: GateVerdict.DUPLICATE, 1: GateVerdict.DUPLICATE}
    assert second.admit(signed(command("cmd-2")))[1] == {0: GateVerdict.EXECUTE, 1: GateVerdict.EXECUTE}
    second.close()


def test_memory_is_bounded_per_rank(tmp_path: Path) -> None:
    g = CommandGate(RUN, 0, (0,), KEY, journal_path=tmp_path / "j", max_ids_per_rank=3)
    for i in range(5):
        g.admit(signed(command(f"c{i}")))
    assert g.admit(signed(command("c4")))[1] == {0: GateVerdict.DUPLICATE}
    assert g.admit(signed(command("c0")))[1] == {0: GateVerdict.EXECUTE}  # forgotten: oldest evicted
    g.close()


def test_journal_is_compacted_on_reload(tmp_path: Path) -> None:
    path = tmp_path / "j"
    g = CommandGate(RUN, 0, (0,), KEY, journal_path=path, max_ids_per_rank=3)
    cmd = command()
    for i in range(1500):
        g.claim(cmd.model_copy(update={"command_id": f"c{i}"}), 0)
    g.close()
    reloaded = CommandGate(RUN, 0, (0,), KEY, journal_path=path, max_ids_per_rank=3)
    assert len(path.read_bytes().splitlines()) == 3
    assert reloaded.claim(cmd.model_copy(update={"command_id": "c1499"}), 0) is GateVerdict.DUPLICATE
    reloaded.close()


def test_another_roles_command_is_passed_over_and_the_launcher_takes_it() -> None:
    """A QuarantineNode addressed to every rank is the launcher's: a rank's gate, given
    its role's kinds, passes it over (no rank to run it on, so no FAILED ack), while the
    launcher's gate runs it and a rank's kind still reaches the ranks."""
    quarantine = QuarantineNode(
        command_id="q-1", run_id=RUN, attempt=0, issued_ts=1.0, node="node-3",
        reason=Reason(code=ReasonCode.OPERATOR, text="test"),
    )  # fmt: skip
    rank_side = CommandGate(RUN, 0, (0, 1), KEY, executes=kinds_of(Role.RANK))
    launcher_side = CommandGate(RUN, 0, (RUN_LEVEL_RANK,), KEY, executes=kinds_of(Role.LAUNCHER))
    decision, verdicts = rank_side.admit(signed(quarantine))
    assert (decision.outcome, decision.ranks, verdicts) == (GateOutcome.ACCEPTED, (), {})
    assert rank_side.counters.other_role == 1 and rank_side.counters.executed == 0
    assert launcher_side.admit(signed(quarantine))[1] == {RUN_LEVEL_RANK: GateVerdict.EXECUTE}
    assert rank_side.admit(signed(command()))[1] == {0: GateVerdict.EXECUTE, 1: GateVerdict.EXECUTE}
    everything = CommandGate(RUN, 0, (0, 1), KEY)  # no role given: every kind reaches the ranks
    assert everything.admit(signed(quarantine))[0].ranks == (0, 1)
