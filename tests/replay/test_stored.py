"""A run the archive keeps as columns (schemas/record_columns.py, replay/stored.py) folds to
the decisions, the counts and the whole core state of its records' bytes, record by record:
on runs where the events that are not quiet matter (a straggler diagnosed from its node's
GPU health, a hang, that hang in 8 shards), with records that are not common among them
(a bad row, a block of another run, a record of a run start), a record the writer stored
twice, and records whose batch claims another world size than the run's (folded from
their bytes, as the decoder checks their ranks against the run's)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from trainguard.kafka.topics import topic_names
from trainguard.processors.core import CorePolicy
from trainguard.processors.driver import CoreDriver
from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay.backtest import backtest
from trainguard.replay.log import Recording, read_archived_recording
from trainguard.replay.replay import replay, replayed_decisions
from trainguard.schemas import encode
from trainguard.schemas.codec import decode_parts
from trainguard.schemas.record_columns import record_columns
from trainguard.sinks.archive_store import Archive, Logged

from ..schemas.test_columnar import same
from ..simulated import START, packed_records

SECRET = b"stored-columns-test-secret-0123456789"
RUN = "stored-run"


def spoiled(values: list[bytes]) -> list[bytes]:
    """The run's records with some that are not common, or not what they claim: a block row
    with a negative compute time, a block of another run, a batch whose header claims twice
    the world size and a rank past the run's (checked against the run's: rejected)."""
    out = list(values)
    blocks = [i for i, v in enumerate(values) if b'"step_timings/1"' in v]
    for n, i in enumerate(blocks[len(blocks) // 3 :: max(1, len(blocks) // 7)]):
        batch = orjson.loads(out[i])
        block = next(r for r in batch["records"] if r["schema"] == "step_timings/1")
        if n % 3 == 0:
            block["compute_s"][0] = -1.0
        elif n % 3 == 1:
            block["run_id"] = "another-run"
        else:  # (a rank the header's world holds, the run's does not)
            block["rank"][0] = batch["world_size"] + block["rank"][0]
            batch["world_size"] *= 2
        out[i] = orjson.dumps(batch)
    return out


def archived(values: list[bytes], root: Path) -> Recording:
    """The records as the archive writer stores them (sinks/archive.py decode_message), in
    batches of 50, the first batch stored twice, and read back."""
    items = [
        Logged(RUN, 0, offset, START + offset, value, record_columns(decode_parts(value)))
        for offset, value in enumerate(values)
    ]
    with Archive(root) as archive:
        for first in range(0, len(items), 50):
            archive.write(items[first : first + 50])
        archive.write(items[:50])
    return read_archived_recording(root, topic_names(), RUN)


CASES = [("straggler-nvlink", 4096), ("hang-allreduce", 4096), ("hang-allreduce", 16)]


@pytest.mark.parametrize(("name", "shard_ranks"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_stored_columns_fold_as_the_records_bytes_fold(name: str, shard_ranks: int, tmp_path: Path) -> None:
    values = spoiled(list(packed_records(Scenario.builtin(name), RUN, shard_ranks, seconds=120)))
    recording = archived(values, tmp_path / "archive")
    assert [v for _, _, v in recording.records] == values
    stored = recording.stored
    assert stored is not None
    assert 0.8 * len(values) < sum(s >= 0 for s in stored.slot) < len(values)  # most, not all

    def outputs(driver: CoreDriver, result: object) -> list[bytes]:
        assert result is not None
        derived, commands, rejections = result.derived, result.commands, result.rejections  # type: ignore[attr-defined]
        counts = f"{result.events} {result.duplicates} {result.state_key}".encode()  # type: ignore[attr-defined]
        return [counts, *(encode(o) for o in (*derived, *commands)), *(r.raw for r in rejections)]

    from_columns, from_bytes = CoreDriver(CorePolicy(), SECRET), CoreDriver(CorePolicy(), SECRET)
    by_columns = 0
    for i, (_, _, value) in enumerate(recording.records):
        result = from_columns.fold_stored(stored, i)
        by_columns += result is not None
        mine = outputs(from_columns, result or from_columns.handle(value))
        assert mine == outputs(from_bytes, from_bytes.handle(value)), f"record {i}"
    assert by_columns > 0.7 * len(values)  # (a claimed world size unlike the run's: its bytes)
    same(from_columns.state, from_bytes.state)


def test_a_replay_from_the_archive_decides_as_one_from_the_bytes(tmp_path: Path) -> None:
    values = spoiled(list(packed_records(Scenario.builtin("straggler-thermal"), RUN, seconds=150)))
    recording = archived(values, tmp_path / "archive")
    columns, as_bytes = replay(recording, CorePolicy()), replay(recording, CorePolicy(), columns=False)
    assert [encode(d) for d in replayed_decisions(columns)] == [
        encode(d) for d in replayed_decisions(as_bytes)
    ]
    assert any(b"straggler_flagged" in encode(d) for d in replayed_decisions(columns))
    counts = ("records", "events", "duplicates", "rejections", "goodput", "breakdown")
    assert [getattr(columns, c) for c in counts] == [getattr(as_bytes, c) for c in counts]
    assert as_bytes.rejections > 0


def test_an_archive_without_columns_replays_from_the_bytes(tmp_path: Path) -> None:
    values = list(packed_records(Scenario.builtin("straggler-thermal"), RUN, seconds=20))
    with Archive(tmp_path / "archive") as archive:
        archive.write([Logged(RUN, 0, offset, START, value) for offset, value in enumerate(values)])
    recording = read_archived_recording(tmp_path / "archive", topic_names(), RUN)
    assert recording.stored is None and len(recording.records) == len(values)
    assert replay(recording, CorePolicy()).events == replay(recording, CorePolicy(), columns=False).events > 0


def test_a_backtest_from_the_archive_measures_and_prices_as_one_from_the_bytes(tmp_path: Path) -> None:
    """The backtest's log (replay/decoded.py LogColumns, what its cost model and charts read)
    is taken from the columns where a record has them (add_stored), the same as decoded."""
    values = spoiled(list(packed_records(Scenario.builtin("straggler-thermal"), RUN, seconds=150)))
    recording = archived(values, tmp_path / "archive")
    as_bytes = Recording(RUN, recording.records, recording.derived, recording.commands)
    eager = CorePolicy.model_validate({"straggler": {"consecutive_steps": 20}})
    policies = [("default", CorePolicy()), ("eager", eager)]
    a, b = backtest(recording, policies, processes=1), backtest(as_bytes, policies, processes=1)
    assert as_bytes.stored is None and recording.stored is not None
    same(a.log, b.log, "log")
    assert a.facts == b.facts and len(a.log) > 1000
    for mine, theirs in zip(a.runs, b.runs, strict=True):
        assert [encode(d) for d in replayed_decisions(mine.replayed)] == [
            encode(d) for d in replayed_decisions(theirs.replayed)
        ]
        assert (mine.rows, mine.saving_s, mine.goodput) == (theirs.rows, theirs.saving_s, theirs.goodput)
