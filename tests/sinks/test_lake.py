"""The archive's storage (sinks/lake.py): a batch is visible whole or not at all, a writer
that died mid-batch leaves nothing behind once the next one opens, readers hold a snapshot
while the writer goes on, one writer per root, and maintenance (compaction, retention,
vacuum) changes no answer but the hours it drops. No broker: the lake alone."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from deltalake import DeltaTable, write_deltalake

from trainguard.schemas.record_columns import RecordColumns
from trainguard.sinks.archive_store import Archive, Logged, open_snapshot, summary
from trainguard.sinks.archive_tables import to_arrow

from .test_archive import T0, every_kind, run_started, step_timing


def _physical(root: Path, table: str) -> int:
    """Rows the table's newest version holds (what the files hold, before any view)."""
    return DeltaTable(str(root / table)).to_pyarrow_dataset().count_rows()


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_batch_cut_off_before_its_mark_is_never_seen_and_is_rolled_back(
    tmp_path: Path, as_uri: bool
) -> None:
    """Also through a URI root, where the tables are not found by listing (an object store)."""
    root = tmp_path / "archive"
    named: str | Path = f"file://{root}" if as_uri else root
    with Archive(named) as archive:
        archive.write(every_kind())
        # A writer killed between its table commits and its mark: rows reach raw_event only.
        cut = [step_timing(rank, 100) for rank in range(8)]
        columns = {
            "event_id": [e.event_id for e in cut], "topic": ["telemetry"] * 8, "kind": [cut[0].KIND] * 8,
            "schema_version": [cut[0].VERSION] * 8, "run_id": [cut[0].run_id] * 8, "attempt": [0] * 8,
            "rank": [e.rank for e in cut], "node": [e.node for e in cut], "step": [100] * 8,
            "ts": [e.ts for e in cut], "payload": ["{}"] * 8, "kafka_partition": [0] * 8,
            "kafka_offset": list(range(8)),
        }  # fmt: skip
        orphan = to_arrow("raw_event", columns, archive.mark.seq + 1)
        write_deltalake(str(root / "raw_event"), orphan, mode="append", partition_by=["run_id", "hour"])
    assert _physical(root, "raw_event") == 27 + 8
    assert summary(named)["raw_event"] == 27  # readers follow the mark: the cut batch is not there

    with Archive(named):  # the next writer rolls the table back to the mark
        assert _physical(root, "raw_event") == 27
    assert summary(named)["raw_event"] == 27


def test_a_reader_keeps_its_snapshot_while_the_writer_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    with Archive(root) as archive:
        archive.write([run_started(0), *(step_timing(r, 1) for r in range(8))])
        with contextlib.closing(open_snapshot(root)) as before:
            archive.write([step_timing(r, 2) for r in range(8)])
            archive.maintain({}, vacuum_hours=1)  # compaction replaces the files it read
            assert before.execute("SELECT count(*) FROM raw_event").fetchall() == [(9,)]
        assert summary(root)["raw_event"] == 17


def test_a_second_writer_on_the_same_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    with Archive(root), pytest.raises(RuntimeError, match="another archive writer"):
        Archive(root)
    with Archive(root):  # released with the first
        pass


def test_maintenance_compacts_and_drops_hours_past_retention_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    day = 24 * 3600.0
    with Archive(root) as archive:
        archive.write(every_kind())  # the run's start and its first hour, at T0
        for hour in range(1, 30):  # then a batch an hour for 29 hours: one file each
            archive.write([step_timing(r, int(hour * 3600)) for r in range(8)])
        files_before = len(DeltaTable(str(root / "raw_event")).file_uris())
        before = summary(root)
        archive.maintain({"raw_event": day}, vacuum_hours=0, now=T0 + 30 * 3600)
    after = summary(root)
    # Hours T0 .. T0+5h are past 24 h: the first batch's 24 step timings and its other events
    # (run start at T0, interruption at T0+200 s, recovery at T0+500 s) and hours 1-5.
    assert before["raw_event"] - after["raw_event"] == 27 + 5 * 8
    assert {k: v for k, v in after.items() if k != "raw_event"} == {
        k: v for k, v in before.items() if k != "raw_event"
    }  # the other tables keep every row
    assert len(DeltaTable(str(root / "raw_event")).file_uris()) < files_before
    assert len(DeltaTable(str(root / "_batches")).file_uris()) <= 2  # compacted, then the new mark
    with contextlib.closing(open_snapshot(root)) as con:
        (oldest,) = con.execute("SELECT min(ts) FROM raw_event").fetchall()[0]
    assert oldest >= T0 + 6 * 3600


def test_after_maintenance_the_batch_logs_newest_commit_is_a_mark(tmp_path: Path) -> None:
    """Maintenance commits to the batch log (its compaction, the vacuum of the files that
    replaced) carry no mark; readers look for the mark at the log's tail, so each pass ends
    with one, however long the archive then stays idle."""
    root = tmp_path / "archive"
    with Archive(root) as archive:
        for step in range(3):
            archive.write([step_timing(rank, step) for rank in range(8)])
            archive.maintain({}, vacuum_hours=0)
            (newest,) = DeltaTable(str(root / "_batches")).history(1)
            assert "trainguard.mark" in newest, newest["operation"]
    assert summary(root)["raw_event"] == 24


def test_an_object_store_uri_root_is_written_and_read(tmp_path: Path) -> None:
    """A root named by URI goes through the object-store path (here file://, which the same
    code serves as s3:// or gs:// with the credentials in the environment)."""
    uri = f"file://{tmp_path}/lake"
    with Archive(uri) as archive:
        archive.write(every_kind())
    assert summary(uri)["raw_event"] == 27


def test_a_runs_query_reaches_only_its_rows_and_still_sees_each_key_once(tmp_path: Path) -> None:
    """The views deduplicate within a run (archive_schema.SCOPES): DuckDB then pushes a
    filter on the run (and, for raw_event, the topic) into the scan instead of windowing
    over every run's rows first, and a record stored twice still shows once."""
    root = tmp_path / "archive"
    with Archive(root) as archive:
        for i, run in enumerate(("run-a", "run-b")):
            logged = Logged(run, 0, i, T0, b"{}")
            archive.write([run_started(0, run_id=run), *(step_timing(r, 1, run) for r in range(8)), logged])
        archive.write([*(step_timing(r, 1, "run-a") for r in range(8)), Logged("run-a", 0, 0, T0, b"{}")])
    with contextlib.closing(open_snapshot(root)) as con:
        assert con.execute("SELECT count(*) FROM raw_event WHERE run_id = 'run-a'").fetchall() == [(9,)]
        assert con.execute("SELECT count(*) FROM raw_event").fetchall() == [(18,)]
        assert con.execute("SELECT count(*) FROM telemetry_log").fetchall() == [(2,)]
        for table, where in (
            ("raw_event", "run_id = 'run-a' AND topic = 't'"),
            ("telemetry_log", "run_id = 'run-a'"),
        ):
            plan = con.execute(f"EXPLAIN SELECT * FROM {table} WHERE {where}").fetchall()[0][1]
            scan = plan[plan.index("ARROW_SCAN") :]
            assert "Filters:" in scan and "run_id" in scan, f"{table}: the run's filter stops above its scan"


def test_a_snapshot_of_some_tables_shows_those_alone(tmp_path: Path) -> None:
    """What a replay opens (replay/log.py): the tables it names, no other table or view."""
    root = tmp_path / "archive"
    with Archive(root) as archive:
        archive.write(every_kind())
    with contextlib.closing(open_snapshot(root, tables=("raw_event", "command"))) as con:
        assert con.execute("SELECT count(*) FROM raw_event").fetchall() == [(27,)]
        assert con.execute("SELECT count(*) FROM command").fetchall() == [(1,)]
        views = con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
        shown = {name for (name,) in views if not name.startswith("_lake_")}  # (the registered sources)
        assert shown == {"raw_event", "command"}


def test_a_records_columns_are_dropped_with_its_bytes(tmp_path: Path) -> None:
    """telemetry_columns keeps telemetry_log's retention unless given its own
    (archive_schema.RETAINED_WITH): a replay folds a record from its columns or its bytes,
    and columns left without their record would only take space."""
    root = tmp_path / "archive"
    columns = RecordColumns("run-a", "node-0", 8, "p", 0, 0, 0, -1, "", *([] for _ in range(18)))
    with Archive(root) as archive:
        for hour in range(6):
            archive.write([Logged("run-a", 0, hour, T0 + hour * 3600, b"{}", columns)])
        archive.maintain({"telemetry_log": 3 * 3600}, vacuum_hours=0, now=T0 + 6 * 3600)
    with contextlib.closing(open_snapshot(root)) as con:
        for table in ("telemetry_log", "telemetry_columns"):
            kept = con.execute(f"SELECT kafka_offset FROM {table} ORDER BY 1").fetchall()
            assert kept == [(3,), (4,), (5,)], table
