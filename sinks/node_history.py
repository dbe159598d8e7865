"""The lemon-node history read back from the archive (issue 46): the archive's
`node_history` view (sinks/archive_schema.py: every record that bears on a node's health
across runs) as the pure rule's input (trainguard/common/lemons.py), and the rule applied.

`trainguard launch` calls :func:`find_lemons` before its first attempt
(producers/launcher/lemons.py); the ready query ``node_history`` shows the same rows
(docs/queries.md).
"""

from __future__ import annotations

from trainguard.common.lemons import DAY_S, Lemon, LemonPolicy, NodeRecord, lemons

from .archive_schema import COMMAND, INTERRUPTION_DETECTED, RAW_EVENT
from .archive_store import Db, Reader

#: What the view reads: a root's snapshot shows only these tables (and this view).
TABLES = (RAW_EVENT, COMMAND, INTERRUPTION_DETECTED)

_SQL = """
SELECT node_id, run_id, attempt, "at", kind, coalesce(detail, '') AS detail
FROM node_history
WHERE $since IS NULL OR "at" >= $since
ORDER BY "at", node_id, run_id, kind, source_id
"""


def _view_ddl() -> str:
    from .archive_schema import VIEW_DDL

    (ddl,) = [s for s in VIEW_DDL if "VIEW node_history AS" in s]
    return ddl


def history(db: Db, since_ts: float | None = None) -> list[NodeRecord]:
    """Every node_history row at or after `since_ts` (None: all), oldest first, as the
    rule's records. `db`: an archive root (read as of its newest batch), an open Archive,
    or a connection on one."""
    with Reader(db, tables=TABLES) as con:
        if not con.execute("SELECT 1 FROM duckdb_views() WHERE view_name = 'node_history'").fetchall():
            con.execute(_view_ddl())  # a root's snapshot of these tables has no views
        rows = con.execute(_SQL, {"since": since_ts}).fetchall()
    return [
        NodeRecord(node, run, int(attempt), float(ts), kind, detail)
        for node, run, attempt, ts, kind, detail in rows
    ]


def find_lemons(db: Db, policy: LemonPolicy, now_ts: float) -> list[Lemon]:
    """The lemons the archive shows at `now_ts`. Read from a day before the policy's window:
    a failure's later records (its release, its retest) stay with it; the rule windows."""
    if policy.min_failures < 1:
        return []
    return lemons(history(db, now_ts - (policy.window_days + 1) * DAY_S), policy, now_ts)
