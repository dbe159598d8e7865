"""The archive's DuckDB schema: every table and view in one place (seed §4 data model).

The archive is append-only and keyed so that a redelivered Kafka record inserts nothing:
each table has the natural key of what it stores (an event_id, a command_id, a Kafka
position for dead letters). Facts that arrive in pieces are stored as separate facts and
joined by views, never updated in place: an interruption's restart seconds arrive later,
on another record, possibly first, so `interruption` is a view over
`interruption_detected` LEFT JOIN `interruption_recovered`, and it is correct whatever the
arrival order and however often either record is redelivered.

`at` is a keyword in DuckDB 2.0 and must be quoted in SQL: ``SELECT "at" FROM interruption``.

All statements are idempotent; `Archive` runs them on every open. Tables keep their
columns across versions; add a column with a new `ALTER TABLE ... ADD COLUMN IF NOT
EXISTS` statement and bump SCHEMA_VERSION.
"""

from __future__ import annotations

#: Version of this schema; a file written by a newer version is refused.
SCHEMA_VERSION = 1

#: Tables written by Archive.write (insert-only, ON CONFLICT DO NOTHING unless noted).
RAW_EVENT = "raw_event"
RUN_ATTEMPT = "run_attempt"
RUN_ACTIVITY = "run_activity"  # upserted with least/greatest: idempotent, one row per run
INTERRUPTION_DETECTED = "interruption_detected"
INTERRUPTION_RECOVERED = "interruption_recovered"
COMMAND = "command"
ACK = "ack"
DEAD_LETTER = "dead_letter"

#: Everything `summary()` counts: the tables above plus the views people query.
SUMMARY_RELATIONS = (
    RAW_EVENT,
    "run",
    "interruption",
    INTERRUPTION_RECOVERED,
    COMMAND,
    ACK,
    DEAD_LETTER,
)

DDL: tuple[str, ...] = (
    """
    CREATE TABLE IF NOT EXISTS archive_meta (
        key   VARCHAR PRIMARY KEY,
        value VARCHAR NOT NULL
    )""",
    # The whole log of events (telemetry and derived), one row per event_id.
    """
    CREATE TABLE IF NOT EXISTS raw_event (
        event_id        VARCHAR PRIMARY KEY,
        topic           VARCHAR NOT NULL,
        kind            VARCHAR NOT NULL,
        schema_version  INTEGER NOT NULL,
        run_id          VARCHAR NOT NULL,
        attempt         BIGINT  NOT NULL,
        rank            BIGINT  NOT NULL,
        node            VARCHAR NOT NULL,
        step            BIGINT  NOT NULL,
        ts              DOUBLE  NOT NULL,
        payload         JSON    NOT NULL,   -- the whole record, as on the wire
        kafka_partition INTEGER,
        kafka_offset    BIGINT
    )""",
    # One row per RunStarted (a run's attempt); `run` aggregates them.
    """
    CREATE TABLE IF NOT EXISTS run_attempt (
        run_id            VARCHAR NOT NULL,
        attempt           BIGINT  NOT NULL,
        world_size        BIGINT  NOT NULL,
        ranks_per_node    BIGINT  NOT NULL,
        nodes             JSON    NOT NULL,
        resumed_from_step BIGINT  NOT NULL,
        config_digest     VARCHAR NOT NULL,
        started_at        DOUBLE  NOT NULL,
        event_id          VARCHAR NOT NULL,
        PRIMARY KEY (run_id, attempt)
    )""",
    # First and last event time seen per run; maintained with least()/greatest().
    """
    CREATE TABLE IF NOT EXISTS run_activity (
        run_id   VARCHAR PRIMARY KEY,
        first_ts DOUBLE NOT NULL,
        last_ts  DOUBLE NOT NULL
    )""",
    """
    CREATE TABLE IF NOT EXISTS interruption_detected (
        interruption_id      VARCHAR PRIMARY KEY,
        run_id               VARCHAR NOT NULL,
        attempt              BIGINT  NOT NULL,
        "at"                 DOUBLE  NOT NULL,  -- detection time (event ts)
        detected_by          VARCHAR NOT NULL,
        cause                VARCHAR NOT NULL,
        node_id              VARCHAR NOT NULL,  -- culprit node ('' when unknown)
        rank                 BIGINT  NOT NULL,  -- culprit rank (-1 when unknown)
        lost_steps           BIGINT  NOT NULL,
        last_checkpoint_step BIGINT  NOT NULL,
        reason_code          VARCHAR NOT NULL,
        reason_text          VARCHAR NOT NULL,
        event_id             VARCHAR NOT NULL
    )""",
    """
    CREATE TABLE IF NOT EXISTS interruption_recovered (
        interruption_id VARCHAR PRIMARY KEY,
        run_id          VARCHAR NOT NULL,
        restart_seconds DOUBLE  NOT NULL,
        resumed_attempt BIGINT  NOT NULL,
        recovered_at    DOUBLE  NOT NULL,
        event_id        VARCHAR NOT NULL
    )""",
    """
    CREATE TABLE IF NOT EXISTS command (
        command_id      VARCHAR PRIMARY KEY,
        kind            VARCHAR NOT NULL,
        run_id          VARCHAR NOT NULL,
        attempt         BIGINT  NOT NULL,
        ranks           JSON,               -- NULL: every rank
        issued_ts       DOUBLE  NOT NULL,
        reason_code     VARCHAR NOT NULL,
        reason_text     VARCHAR NOT NULL,
        payload         JSON    NOT NULL,
        kafka_partition INTEGER,
        kafka_offset    BIGINT
    )""",
    """
    CREATE TABLE IF NOT EXISTS ack (
        command_id      VARCHAR NOT NULL,
        rank            BIGINT  NOT NULL,
        status          VARCHAR NOT NULL,
        command_kind    VARCHAR NOT NULL,
        run_id          VARCHAR NOT NULL,
        attempt         BIGINT  NOT NULL,
        node            VARCHAR NOT NULL,
        detail          VARCHAR NOT NULL,
        ts              DOUBLE  NOT NULL,
        kafka_partition INTEGER,
        kafka_offset    BIGINT,
        PRIMARY KEY (command_id, rank, status)
    )""",
    # id = topic:partition:offset[:index] of the record the archive read: re-reading the
    # log adds nothing, while the same bad bytes produced twice are two rows.
    """
    CREATE TABLE IF NOT EXISTS dead_letter (
        id     VARCHAR PRIMARY KEY,
        topic  VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        detail VARCHAR NOT NULL,
        raw    BLOB    NOT NULL,
        ts     DOUBLE  NOT NULL     -- Kafka record timestamp
    )""",
    # Cost and restart phases come from the recovered record's payload (processors/core:
    # InterruptionRecovered): NULL until the run has recovered.
    """
    CREATE OR REPLACE VIEW interruption AS
    SELECT d.run_id, d.interruption_id, d."at", d.detected_by, d.cause, d.node_id, d.rank,
           d.lost_steps, d.last_checkpoint_step, r.restart_seconds, r.resumed_attempt,
           d.reason_code, d.reason_text, d.attempt,
           CAST(e.payload->>'lost_s' AS DOUBLE)               AS lost_seconds,
           CAST(e.payload->>'gpu_hours' AS DOUBLE)            AS gpu_hours,
           CAST(e.payload->'phases'->>'detect' AS DOUBLE)     AS detect_seconds,
           CAST(e.payload->'phases'->>'reschedule' AS DOUBLE) AS reschedule_seconds,
           CAST(e.payload->'phases'->>'startup' AS DOUBLE)    AS startup_seconds
    FROM interruption_detected d
    LEFT JOIN interruption_recovered r USING (interruption_id)
    LEFT JOIN raw_event e ON e.event_id = r.event_id""",
    # The launcher's restart phases (schemas RestartPhases): one row per phase, in order, so
    # "restart seconds by phase" is a GROUP BY phase.
    """
    CREATE OR REPLACE VIEW restart_phase AS
    SELECT e.run_id, e.attempt, CAST(e.payload->>'interrupted_attempt' AS BIGINT) AS interrupted_attempt,
           e.payload->>'cause' AS cause, p.key AS phase, p.id AS phase_order,
           CAST(p.value AS DOUBLE) AS seconds, e.ts AS "at"
    FROM raw_event e, json_each(e.payload->'phases') p
    WHERE e.kind = 'restart_phases'""",
    # Decisions: the core's commands and its decision events, each with its reason and the
    # ids of what caused it.
    """
    CREATE OR REPLACE VIEW decision AS
    SELECT run_id, event_id AS decision_id, kind, ts AS "at",
           payload->'reason'->>'code' AS reason_code, payload->'reason'->>'text' AS reason_text,
           CAST(payload->'caused_by' AS VARCHAR[]) AS caused_by
    FROM raw_event
    WHERE kind IN ('quarantine', 'page', 'eviction_decision', 'interval_update', 'straggler_diagnosed')
    UNION ALL
    SELECT run_id, command_id, kind, issued_ts, reason_code, reason_text,
           CAST(payload->'caused_by' AS VARCHAR[])
    FROM command""",
    # The timeline (seed §3 /timeline): every interruption with its cost and the decisions it
    # caused (directly, or through a decision it caused: the quarantine's command), each
    # with its reason. A decision shares a cause with the interruption when both follow the
    # same detection (an SDC mismatch's rollback and its interruption).
    """
    CREATE OR REPLACE VIEW timeline AS
    WITH cause AS (
        SELECT i.interruption_id, i.run_id,
               list_concat(coalesce(CAST(e.payload->'caused_by' AS VARCHAR[]), []),
                           [i.interruption_id, i.event_id]) AS ids
        FROM interruption_detected i
        LEFT JOIN raw_event e ON e.event_id = i.event_id
    ), direct AS (
        SELECT c.interruption_id, d.*
        FROM cause c JOIN decision d ON d.run_id = c.run_id AND list_has_any(d.caused_by, c.ids)
    ), linked AS (
        SELECT * FROM direct
        UNION
        SELECT f.interruption_id, d.*
        FROM direct f JOIN decision d ON d.run_id = f.run_id AND list_contains(d.caused_by, f.decision_id)
    )
    SELECT i.*,
           list(l.kind ORDER BY l."at", l.kind, l.decision_id) FILTER (WHERE l.kind IS NOT NULL)
               AS decisions,
           list(l.kind || ': ' || l.reason_text ORDER BY l."at", l.kind, l.decision_id)
               FILTER (WHERE l.kind IS NOT NULL) AS decision_reasons
    FROM interruption i
    LEFT JOIN linked l USING (interruption_id)
    GROUP BY ALL""",
    # Goodput reports (processors/core/goodput.py): where each run's time went, per window.
    """
    CREATE OR REPLACE VIEW goodput AS
    SELECT run_id, ts AS "at",
           CAST(payload->>'window_s' AS DOUBLE)     AS window_s,
           CAST(payload->>'elapsed_s' AS DOUBLE)    AS elapsed_s,
           CAST(payload->>'checkpoint_s' AS DOUBLE) AS checkpoint_s,
           CAST(payload->>'lost_s' AS DOUBLE)       AS lost_s,
           CAST(payload->>'restart_s' AS DOUBLE)    AS restart_s,
           CAST(payload->>'straggler_s' AS DOUBLE)  AS straggler_s,
           CAST(payload->>'goodput' AS DOUBLE)      AS goodput
    FROM raw_event
    WHERE kind = 'goodput_report'""",
    # Quarantines (processors/core/quarantine.py and the SDC detector): "which node killed
    # the most jobs" is `SELECT * FROM node_quarantine ORDER BY runs_affected DESC`.
    """
    CREATE OR REPLACE VIEW node_quarantine AS
    SELECT node AS node_id,
           count(DISTINCT run_id) AS runs_affected,
           count(*)               AS quarantines,
           min(ts)                AS first_at,
           max(ts)                AS last_at,
           list(DISTINCT run_id ORDER BY run_id) AS run_ids
    FROM raw_event
    WHERE kind = 'quarantine'
    GROUP BY node""",
    # The seed's run row, from RunStarted: the newest attempt's shape, the first start.
    """
    CREATE OR REPLACE VIEW run AS
    SELECT a.run_id,
           arg_max(a.world_size, a.attempt)     AS world_size,
           arg_max(a.ranks_per_node, a.attempt) AS ranks_per_node,
           count(*)                             AS attempts,
           max(a.attempt)                       AS last_attempt,
           arg_max(a.config_digest, a.attempt)  AS config_digest,
           min(a.started_at)                    AS started_at,
           greatest(max(a.started_at), any_value(act.last_ts)) AS last_ts
    FROM run_attempt a
    LEFT JOIN run_activity act USING (run_id)
    GROUP BY a.run_id""",
)
