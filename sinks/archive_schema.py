"""The archive's schema: every table and view in one place (seed §4 data model; one file
on purpose: the views join tables defined next to them).

Tables are written as Delta Lake tables (sinks/lake.py) with the columns TABLE_DDL gives
(DuckDB types, read back as Arrow types), plus ``_seq``, the batch that stored a row, and
the partition column ``hour`` where PARTITIONS names it. Readers see each table as a DuckDB
view that keeps the first row stored of each key (KEYS): a redelivered Kafka record, a
record produced twice, or the same records written twice show once. Facts that arrive in
pieces are stored as separate facts and joined by views, never updated in place: an
interruption's restart seconds arrive later, on another record, possibly first, so
`interruption` is a view over `interruption_detected` LEFT JOIN `interruption_recovered`,
and it is correct whatever the arrival order and however often either record is stored.

`at` is a keyword in DuckDB 2.0 and must be quoted in SQL: ``SELECT "at" FROM interruption``.

The seed's data model (§4: run, checkpoint, interruption, rank_health, quarantine,
sdc_check) is made of VIEWS over those tables, mostly over `raw_event.payload` (the whole
record as JSON): nothing extra is written, so the views inherit the tables' deduplication
and are correct whatever order the records arrived in. Views that answer the operator's
questions build on them (VIEWS lists every one; docs/queries.md has the ready queries).

Tables keep their columns across versions: add a column at the end of its TABLE_DDL
statement and bump SCHEMA_VERSION (Delta merges the new column in; old rows read NULL).
Views are created by every reader: adding or changing one needs no version bump.
"""

from __future__ import annotations

#: Version of this schema; an archive written by a newer version is refused.
#: 2: telemetry_log (an older writer would leave replays from the archive short).
#: 3: telemetry_columns (an older writer's records replay from their bytes, more slowly).
SCHEMA_VERSION = 3

#: Tables written by Archive.write (append-only; readers deduplicate by KEYS).
RAW_EVENT = "raw_event"
RUN_ATTEMPT = "run_attempt"
RUN_ACTIVITY = "run_activity_batches"  # a row per run per batch; the run_activity view folds them
INTERRUPTION_DETECTED = "interruption_detected"
INTERRUPTION_RECOVERED = "interruption_recovered"
COMMAND = "command"
ACK = "ack"
DEAD_LETTER = "dead_letter"
TELEMETRY_LOG = "telemetry_log"
TELEMETRY_COLUMNS = "telemetry_columns"

#: Each table's key: readers see the first row stored of each key (a record stored twice,
#: produced twice, or handed to Archive.write twice shows once). None: every row counts.
KEYS: dict[str, tuple[str, ...] | None] = {
    RAW_EVENT: ("event_id",),
    RUN_ATTEMPT: ("run_id", "attempt"),
    RUN_ACTIVITY: None,
    INTERRUPTION_DETECTED: ("interruption_id",),
    INTERRUPTION_RECOVERED: ("interruption_id",),
    COMMAND: ("command_id",),
    ACK: ("command_id", "rank", "status"),
    DEAD_LETTER: ("id",),
    TELEMETRY_LOG: ("kafka_partition", "kafka_offset"),
    TELEMETRY_COLUMNS: ("kafka_partition", "kafka_offset"),
}
#: Columns every stored copy of a key shares (a copy is the same record stored again: same
#: run, same topic). The views deduplicate within them (the window partitioned by them and
#: the key), which keeps the same rows and lets DuckDB push a filter on them into the scan:
#: it pushes a filter through a window only on the window's partition columns. Without
#: them a run's query on raw_event or telemetry_log windowed over every run's rows (a
#: replay read its 41 decisions in 0.1-0.4 s among 250,000 telemetry events).
SCOPES: dict[str, tuple[str, ...]] = {
    RAW_EVENT: ("run_id", "topic"),
    INTERRUPTION_DETECTED: ("run_id",),
    INTERRUPTION_RECOVERED: ("run_id",),
    COMMAND: ("run_id",),
    ACK: ("run_id",),
    TELEMETRY_LOG: ("run_id",),
    TELEMETRY_COLUMNS: ("run_id",),
}

#: Each table's partitions in the lake: the bulk by run and UTC hour (so that a run's
#: queries read its files only and retention drops whole hours), the rest by run.
HOUR = "hour"
PARTITIONS: dict[str, list[str]] = {
    RAW_EVENT: ["run_id", HOUR],
    RUN_ATTEMPT: ["run_id"],
    RUN_ACTIVITY: ["run_id"],
    INTERRUPTION_DETECTED: ["run_id"],
    INTERRUPTION_RECOVERED: ["run_id"],
    COMMAND: ["run_id"],
    ACK: ["run_id"],
    DEAD_LETTER: [HOUR],
    TELEMETRY_LOG: ["run_id", HOUR],
    TELEMETRY_COLUMNS: ["run_id", HOUR],
}
#: Tables whose hours are dropped with another's unless given a retention of their own
#: (a record's columns are no use to a replay without its bytes, which it folds the rest from).
RETAINED_WITH = {TELEMETRY_COLUMNS: TELEMETRY_LOG}
#: Each table's time column, which gives the hour partition.
HOUR_OF = {RAW_EVENT: "ts", DEAD_LETTER: "ts", TELEMETRY_LOG: "ts", TELEMETRY_COLUMNS: "ts"}

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

#: Every view, in creation order (a view may use the ones before it).
VIEWS = (
    "interruption",
    "restart_phase",
    "interruption_phase",
    "restart_by_phase",
    "decision",
    "timeline",
    "goodput",
    "goodput_day",
    "quarantine",
    "node_quarantine",
    "interruption_by_cause_node",
    "node_kill",
    "node_history",
    "checkpoint",
    "rank_health",
    "rank_status",
    "sdc_check",
    "run",
)

#: Causes that blame the culprit node for a job's death (node_kill): not an eviction (the
#: node was slow, the stop was planned), an operator's restart, or a non-finite loss (its
#: first reporter is not evidence against its node, processors/core/decisions/quarantine.py).
NODE_KILL_CAUSES = ("crash", "hang", "sdc")
#: Planned stops that name a node (InterruptionCause): no failure of it (node_history).
PLANNED_CAUSES = ("eviction", "elastic", "drain")

# GpuHealth fields (schemas/events.py) and their column types: one JSON parse per reading.
_GPU_HEALTH_STRUCT = (
    '{"present": "BOOLEAN", "temperature_c": "DOUBLE", "sm_clock_mhz": "DOUBLE", '
    '"power_capped": "BOOLEAN", "thermal_throttle": "BOOLEAN", "nvlink_width": "BIGINT", '
    '"nvlink_expected_width": "BIGINT", "nvlink_retries": "BIGINT", "ecc_corrected": "BIGINT", '
    '"ecc_uncorrected": "BIGINT", "nic_utilization": "DOUBLE", "memory_temperature_c": "DOUBLE", '
    '"sm_clock_max_mhz": "DOUBLE", "memory_clock_mhz": "DOUBLE", "power_w": "DOUBLE", '
    '"power_limit_w": "DOUBLE", "throttle_reasons": "VARCHAR[]", "ecc_corrected_total": "BIGINT", '
    '"ecc_uncorrected_total": "BIGINT", "nvlink_crc_errors": "BIGINT"}'
)

TABLE_DDL: tuple[str, ...] = (
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
    # First and last event time of each run in each batch; the run_activity view folds them.
    """
    CREATE TABLE IF NOT EXISTS run_activity_batches (
        run_id   VARCHAR NOT NULL,
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
    # The telemetry topic's records verbatim, as the processor consumed them (a node's batch,
    # its columnar blocks, the processor's own ticks and forwards, bad records too): what a
    # replay folds, in (kafka_partition, kafka_offset) order (replay/log.py). raw_event cannot
    # stand in: it keeps an event once however often the log holds it (a forward repeats
    # events on shard 0's partition) and not its place inside its record.
    """
    CREATE TABLE IF NOT EXISTS telemetry_log (
        run_id          VARCHAR NOT NULL,  -- the record key's run ('' when none)
        kafka_partition INTEGER NOT NULL,
        kafka_offset    BIGINT  NOT NULL,
        ts              DOUBLE  NOT NULL,  -- Kafka record timestamp
        value           BLOB    NOT NULL,
        PRIMARY KEY (kafka_partition, kafka_offset)
    )""",
    # A common telemetry_log record again as columns (schemas/record_columns.py): what a
    # replay folds without parsing the record. Its batch header, its columnar block (if
    # any, at block_part among its parts), its other parts' objects as JSON, in order, and
    # those parts' fields as columns (a GPU health's are read from its object).
    """
    CREATE TABLE IF NOT EXISTS telemetry_columns (
        run_id          VARCHAR   NOT NULL,  -- the record key's run, as in telemetry_log
        kafka_partition INTEGER   NOT NULL,
        kafka_offset    BIGINT    NOT NULL,
        ts              DOUBLE    NOT NULL,  -- Kafka record timestamp
        batch_run_id    VARCHAR   NOT NULL,
        batch_node      VARCHAR   NOT NULL,
        world_size      BIGINT    NOT NULL,
        producer_id     VARCHAR   NOT NULL,
        seq             BIGINT    NOT NULL,
        shard           BIGINT    NOT NULL,
        shard_ranks     BIGINT    NOT NULL,
        block_part      INTEGER   NOT NULL,  -- -1: no block
        block_node      VARCHAR   NOT NULL,
        event_id        VARCHAR[] NOT NULL,
        attempt         BIGINT[]  NOT NULL,
        rank            BIGINT[]  NOT NULL,
        step            BIGINT[]  NOT NULL,
        step_ts         DOUBLE[]  NOT NULL,
        compute_s       DOUBLE[]  NOT NULL,
        total_s         DOUBLE[]  NOT NULL,
        rest            VARCHAR[] NOT NULL,
        row_event_id    VARCHAR[] NOT NULL,
        row_attempt     BIGINT[]  NOT NULL,
        row_rank        BIGINT[]  NOT NULL,
        row_node        VARCHAR[] NOT NULL,
        row_step        BIGINT[]  NOT NULL,
        row_ts          DOUBLE[]  NOT NULL,
        row_phase       VARCHAR[] NOT NULL,  -- a heartbeat's (NULL for another kind)
        row_loss        DOUBLE[]  NOT NULL,  -- step stats' (NULL for another kind)
        row_grad_norm   DOUBLE[]  NOT NULL,
        row_finite      BOOLEAN[] NOT NULL,
        PRIMARY KEY (kafka_partition, kafka_offset)
    )""",
)

#: The views over the tables (which readers see as deduplicated views of the Delta tables,
#: sinks/archive_store.py), in creation order.
VIEW_DDL: tuple[str, ...] = (
    # Event times are seconds since the epoch (DOUBLE); utc(ts) shows one as a UTC timestamp
    # whatever the session's time zone.
    "CREATE OR REPLACE MACRO utc(ts) AS make_timestamp(CAST(round(ts * 1e6) AS BIGINT))",
    # First and last event time seen per run.
    """
    CREATE OR REPLACE VIEW run_activity AS
    SELECT run_id, min(first_ts) AS first_ts, max(last_ts) AS last_ts
    FROM run_activity_batches
    GROUP BY run_id""",
    # Cost and restart phases come from the recovered record's payload (processors/core:
    # InterruptionRecovered): NULL until the run has recovered. Its lost steps and the
    # checkpoint resumed from are the restart's own, when it says (a validation that landed
    # after the crash moves both); the detection's count until then.
    """
    CREATE OR REPLACE VIEW interruption AS
    SELECT d.run_id, d.interruption_id, d."at", d.detected_by, d.cause, d.node_id, d.rank,
           coalesce(CAST(e.payload->>'lost_steps' AS BIGINT), d.lost_steps) AS lost_steps,
           coalesce(CAST(e.payload->>'resumed_from_step' AS BIGINT), d.last_checkpoint_step)
               AS last_checkpoint_step,
           r.restart_seconds, r.resumed_attempt,
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
    # The core's phases of every recovered interruption (InterruptionRecovered.phases): detect
    # (fault onset to detection, a hang's stall), reschedule (detection to the launch),
    # startup (launch to the first step). reschedule + startup = restart_seconds; detect
    # comes before it. Measured for every run, launched by trainguard or not.
    """
    CREATE OR REPLACE VIEW interruption_phase AS
    SELECT r.run_id, r.interruption_id, d.cause, d.node_id, d."at", p.key AS phase,
           p.id AS phase_order, CAST(p.value AS DOUBLE) AS seconds
    FROM interruption_recovered r
    JOIN raw_event e ON e.event_id = r.event_id
    CROSS JOIN json_each(e.payload->'phases') p
    LEFT JOIN interruption_detected d ON d.interruption_id = r.interruption_id""",
    # "Restart seconds by phase": source 'core' is the processor's coarse split of every
    # interruption, source 'launcher' the launcher's finer one (process_start, checkpoint_load,
    # pg_init, first_step) where runs are launched by `trainguard launch`. Never add the two:
    # they measure the same seconds. share = the phase's part of its source's total.
    """
    CREATE OR REPLACE VIEW restart_by_phase AS
    WITH phases AS (
        SELECT 'core' AS source, phase, phase_order, seconds FROM interruption_phase
        UNION ALL
        SELECT 'launcher', phase, phase_order, seconds FROM restart_phase
    )
    SELECT source, phase, count(*) AS restarts, sum(seconds) AS total_seconds,
           avg(seconds) AS mean_seconds, quantile_cont(seconds, 0.5) AS p50_seconds,
           max(seconds) AS max_seconds,
           sum(seconds) / nullif(sum(sum(seconds)) OVER (PARTITION BY source), 0) AS share,
           min(phase_order) AS phase_order
    FROM phases
    GROUP BY source, phase""",
    # Decisions: the core's commands and its decision events, each with its reason and the
    # ids of what caused it. The launcher's go-ahead (interruption_decided) is one only when
    # it carries a capacity decision (issue 45: wait for a replacement, or a smaller world).
    """
    CREATE OR REPLACE VIEW decision AS
    SELECT run_id, event_id AS decision_id, kind, ts AS "at",
           payload->'reason'->>'code' AS reason_code, payload->'reason'->>'text' AS reason_text,
           CAST(payload->'caused_by' AS VARCHAR[]) AS caused_by
    FROM raw_event
    WHERE kind IN ('quarantine', 'page', 'eviction_decision', 'interval_update', 'straggler_diagnosed',
                   'resume_rejected')
    UNION ALL
    SELECT run_id, command_id, kind, issued_ts, reason_code, reason_text,
           CAST(payload->'caused_by' AS VARCHAR[])
    FROM command
    WHERE kind <> 'interruption_decided' OR payload->>'capacity' IS NOT NULL""",
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
    # Goodput reports (processors/core/accounting/goodput.py): where each run's time went, per window.
    """
    CREATE OR REPLACE VIEW goodput AS
    SELECT run_id, ts AS "at",
           CAST(payload->>'window_s' AS DOUBLE)     AS window_s,
           CAST(payload->>'elapsed_s' AS DOUBLE)    AS elapsed_s,
           CAST(payload->>'checkpoint_s' AS DOUBLE) AS checkpoint_s,
           CAST(payload->>'lost_s' AS DOUBLE)       AS lost_s,
           CAST(payload->>'restart_s' AS DOUBLE)    AS restart_s,
           CAST(payload->>'straggler_s' AS DOUBLE)  AS straggler_s,
           CAST(payload->>'goodput' AS DOUBLE)      AS goodput,
           -- v2 (issue 45): training time lost to a smaller world; none before
           coalesce(CAST(payload->>'narrow_s' AS DOUBLE), 0.0) AS narrow_s
    FROM raw_event
    WHERE kind = 'goodput_report'""",
    # Goodput by UTC day, per run: the core's trailing 24-hour report (window_s = 86400), the
    # newest one of the day. With a report every 10 minutes (the default) its window is the
    # calendar day to within those 10 minutes; a run's first day covers only the time it ran.
    # worst_hour_goodput: the lowest 1-hour report of the day (NULL without 1-hour windows).
    """
    CREATE OR REPLACE VIEW goodput_day AS
    SELECT run_id, DATE '1970-01-01' + CAST(floor("at" / 86400) AS INTEGER) AS day,
           arg_max(goodput, "at") FILTER (WHERE window_s = 86400)      AS goodput,
           arg_max(elapsed_s, "at") FILTER (WHERE window_s = 86400)    AS elapsed_s,
           arg_max(checkpoint_s, "at") FILTER (WHERE window_s = 86400) AS checkpoint_s,
           arg_max(lost_s, "at") FILTER (WHERE window_s = 86400)       AS lost_s,
           arg_max(restart_s, "at") FILTER (WHERE window_s = 86400)    AS restart_s,
           arg_max(straggler_s, "at") FILTER (WHERE window_s = 86400)  AS straggler_s,
           max("at") FILTER (WHERE window_s = 86400)                   AS report_at,
           min(goodput) FILTER (WHERE window_s = 3600)                 AS worst_hour_goodput,
           count(*) FILTER (WHERE window_s = 86400)                    AS reports
    FROM goodput
    GROUP BY ALL""",
    # The seed's quarantine row, one per decision to take a node out of the pool: the core's
    # Quarantine event (a crash's or hang's culprit, with the QuarantineNode command it
    # caused), or a QuarantineNode command that no such event caused (the SDC detector's:
    # its cause is the SdcMismatch, whose rank and step are shown). A command archived
    # before its event shows as its own row until the event arrives, then merges into it.
    # A quarantine later released (QuarantineReleased: the failure repeated at the same step
    # on other nodes, data or code) is no evidence against its node and is not listed.
    """
    CREATE OR REPLACE VIEW quarantine AS
    WITH event AS (
        SELECT * FROM raw_event WHERE kind = 'quarantine'
    ), released AS (
        SELECT DISTINCT payload->>'quarantine_id' AS quarantine_id
        FROM raw_event WHERE kind = 'quarantine_released'
    ), cmd AS (
        SELECT c.*, CAST(c.payload->'caused_by' AS VARCHAR[]) AS causes
        FROM command c WHERE c.kind = 'quarantine_node'
    )
    SELECT e.event_id AS quarantine_id, 'quarantine' AS source, e.node AS node_id, e.run_id,
           e.attempt, e.rank, e.step, e.ts AS "at",
           e.payload->'reason'->>'code' AS reason_code, e.payload->'reason'->>'text' AS reason_text,
           CAST(e.payload->'run_ids_affected' AS VARCHAR[]) AS run_ids_affected,
           CAST(e.payload->'caused_by' AS VARCHAR[]) AS caused_by,
           (SELECT min(c.command_id) FROM cmd c
            WHERE c.run_id = e.run_id AND list_contains(c.causes, e.event_id)) AS command_id
    FROM event e
    WHERE e.event_id NOT IN (SELECT quarantine_id FROM released)
    UNION ALL
    SELECT c.command_id, 'quarantine_node', c.payload->>'node', c.run_id, c.attempt,
           coalesce(m.rank, -1), coalesce(m.step, -1), c.issued_ts, c.reason_code, c.reason_text,
           [c.run_id], c.causes, c.command_id
    FROM cmd c
    LEFT JOIN raw_event m ON m.event_id = c.causes[1]
    WHERE NOT EXISTS (
        SELECT 1 FROM event e WHERE e.run_id = c.run_id AND list_contains(c.causes, e.event_id)
    )""",
    # Quarantines per node: "which node was quarantined in the most jobs" is
    # `SELECT * FROM node_quarantine ORDER BY runs_affected DESC`.
    """
    CREATE OR REPLACE VIEW node_quarantine AS
    SELECT node_id,
           len(run_ids) AS runs_affected, quarantines, first_at, last_at, run_ids
    FROM (
        SELECT node_id,
               list_sort(list_distinct(flatten(list(list_append(run_ids_affected, run_id))))) AS run_ids,
               count(*)   AS quarantines,
               min("at")  AS first_at,
               max("at")  AS last_at
        FROM quarantine
        GROUP BY node_id
    )""",
    # Interruptions by cause and culprit node ('' when the culprit is unknown). recovered
    # counts those with a restart_seconds; the sums skip the others.
    """
    CREATE OR REPLACE VIEW interruption_by_cause_node AS
    SELECT cause, node_id,
           count(*)                              AS interruptions,
           count(DISTINCT run_id)                AS runs,
           count(restart_seconds)                AS recovered,
           sum(restart_seconds)                  AS restart_seconds,
           sum(lost_steps)                       AS lost_steps,
           sum(gpu_hours)                        AS gpu_hours,
           min("at")                             AS first_at,
           max("at")                             AS last_at,
           list(DISTINCT run_id ORDER BY run_id) AS run_ids
    FROM interruption
    GROUP BY cause, node_id""",
    # Nodes and the jobs they killed (seed §4: "node n0417 has killed six jobs"): the runs in
    # which the node was the culprit of an interruption whose cause blames it
    # (NODE_KILL_CAUSES), joined with its quarantines (whose affected runs count too, in
    # case the interruption itself is not archived).
    f"""
    CREATE OR REPLACE VIEW node_kill AS
    WITH killed AS (
        SELECT node_id,
               list(DISTINCT run_id ORDER BY run_id) AS run_ids,
               count(*)                              AS interruptions,
               list(DISTINCT cause ORDER BY cause)   AS causes,
               min("at")                             AS first_at,
               max("at")                             AS last_at
        FROM interruption
        WHERE node_id <> '' AND cause IN {NODE_KILL_CAUSES!r}
        GROUP BY node_id
    )
    SELECT node_id,
           len(n.run_ids)                  AS jobs_killed,
           n.run_ids,
           coalesce(k.interruptions, 0)    AS interruptions,
           coalesce(k.causes, [])          AS causes,
           q.node_id IS NOT NULL           AS quarantined,
           coalesce(q.quarantines, 0)      AS quarantines,
           q.first_at                      AS quarantined_since,
           k.first_at, k.last_at
    FROM (
        SELECT coalesce(k.node_id, q.node_id) AS node_id,
               list_sort(list_distinct(list_concat(coalesce(k.run_ids, []), coalesce(q.run_ids, []))))
                   AS run_ids
        FROM killed k FULL JOIN node_quarantine q USING (node_id)
    ) n
    LEFT JOIN killed k USING (node_id)
    LEFT JOIN node_quarantine q USING (node_id)""",
    # What the archive holds for or against each node across runs, one row per record (the
    # lemon-node history, trainguard/common/lemons.py, whose rule counts the failures in it;
    # sinks/node_history.py reads it for `trainguard launch`). kind: the interruption's cause
    # when it names the node as culprit (NODE_KILL_CAUSES); quarantine, the core took it out
    # (its Quarantine event, its QuarantineNode command); self_test or retest, it failed a
    # known-answer self-test (retest: as a quarantined suspect); released, a quarantine the
    # core gave back (attempt: the quarantine's); planned, a planned stop (PLANNED_CAUSES, a
    # DrainNode). The launcher's own NodeExcluded is no evidence and is not listed.
    f"""
    CREATE OR REPLACE VIEW node_history AS
    WITH raw AS (
        SELECT event_id, kind, run_id, attempt, node, ts, payload FROM raw_event
        WHERE kind IN ('quarantine', 'quarantine_released', 'node_self_test_result')
    ), cmd AS (
        SELECT command_id, kind, run_id, attempt, payload->>'node' AS node, issued_ts, reason_text
        FROM command WHERE kind IN ('quarantine_node', 'drain_node')
    )
    SELECT node_id, run_id, attempt, "at",
           CASE WHEN cause IN {NODE_KILL_CAUSES!r} THEN cause ELSE 'planned' END AS kind,
           CASE WHEN cause IN {NODE_KILL_CAUSES!r} THEN reason_text ELSE cause || ': ' || reason_text END
               AS detail,
           interruption_id AS source_id
    FROM interruption_detected
    WHERE node_id <> '' AND cause IN {(*NODE_KILL_CAUSES, *PLANNED_CAUSES)!r}
    UNION ALL
    SELECT node, run_id, attempt, ts, 'quarantine', payload->'reason'->>'text', event_id
    FROM raw WHERE kind = 'quarantine'
    UNION ALL
    SELECT node, run_id, attempt, issued_ts, 'quarantine', reason_text, command_id
    FROM cmd WHERE kind = 'quarantine_node'
    UNION ALL
    SELECT node, run_id, attempt, issued_ts, 'planned', 'drain: ' || reason_text, command_id
    FROM cmd WHERE kind = 'drain_node'
    UNION ALL
    SELECT node, run_id, attempt, ts,
           CASE WHEN payload->>'purpose' = 'quarantine' THEN 'retest' ELSE 'self_test' END,
           (payload->>'purpose') || ' self-test: ' || (payload->'reason'->>'text'), event_id
    FROM raw WHERE kind = 'node_self_test_result' AND NOT CAST(payload->>'passed' AS BOOLEAN)
    UNION ALL
    SELECT r.node, r.run_id, coalesce(q.attempt, c.attempt, r.attempt), r.ts, 'released',
           r.payload->'reason'->>'text', r.event_id
    FROM raw r
    LEFT JOIN raw q
      ON q.kind = 'quarantine' AND q.run_id = r.run_id AND q.event_id = r.payload->>'quarantine_id'
    LEFT JOIN cmd c ON c.run_id = r.run_id AND c.command_id = r.payload->>'quarantine_id'
    WHERE r.kind = 'quarantine_released'""",
    # The seed's checkpoint row: one per checkpoint step of a run attempt, from the ranks'
    # CheckpointWritten (one per rank's part, or one for the whole: shards and bytes are
    # summed over the ranks, each rank's newest report counted once), CheckpointValidated and
    # CheckpointFailed. state: the newest verdict wins, so a write that failed and was
    # retried is 'written' again; 'validated' only if no failure came after it (a tie is a
    # failure: validity is established, never assumed). Only 'validated' is resumable.
    """
    CREATE OR REPLACE VIEW checkpoint AS
    WITH written AS (
        SELECT run_id, attempt, step,
               count(*)         AS ranks_written,
               sum(shards)      AS shards,
               sum(bytes)       AS bytes,
               max(blocking_s)  AS blocking_s,
               max(write_s)     AS write_s,
               min(ts)          AS first_written_at,
               max(ts)          AS written_at,
               arg_min(uri, rank) AS uri,
               list(digest ORDER BY rank) AS digests
        FROM (
            SELECT run_id, attempt, rank, ts,
                   CAST(payload->>'checkpoint_step' AS BIGINT) AS step,
                   CAST(payload->>'shards' AS BIGINT)          AS shards,
                   CAST(payload->>'bytes' AS BIGINT)           AS bytes,
                   CAST(payload->>'blocking_s' AS DOUBLE)      AS blocking_s,
                   CAST(payload->>'write_s' AS DOUBLE)         AS write_s,
                   payload->>'uri' AS uri, payload->>'digest' AS digest
            FROM raw_event
            WHERE kind = 'checkpoint_written'
            QUALIFY row_number() OVER (
                PARTITION BY run_id, attempt, step, rank ORDER BY ts DESC, event_id
            ) = 1
        )
        GROUP BY run_id, attempt, step
    ), validated AS (
        SELECT run_id, attempt, CAST(payload->>'checkpoint_step' AS BIGINT) AS step,
               max(ts) AS validated_at,
               arg_max(CAST(payload->>'last_verified_step' AS BIGINT), ts) AS last_verified_step,
               arg_max(payload->>'uri', ts) AS uri
        FROM raw_event WHERE kind = 'checkpoint_validated'
        GROUP BY ALL
    ), failed AS (
        SELECT run_id, attempt, CAST(payload->>'checkpoint_step' AS BIGINT) AS step,
               max(ts) AS failed_at, count(*) AS failures,
               arg_max(payload->>'error', ts) AS error, arg_max(payload->>'uri', ts) AS uri
        FROM raw_event WHERE kind = 'checkpoint_failed'
        GROUP BY ALL
    ), keys AS (
        SELECT run_id, attempt, step FROM written
        UNION SELECT run_id, attempt, step FROM validated
        UNION SELECT run_id, attempt, step FROM failed
    ), joined AS (
        SELECT k.run_id, k.attempt, k.step,
               CASE
                   WHEN v.validated_at IS NOT NULL AND (f.failed_at IS NULL OR v.validated_at > f.failed_at)
                       THEN 'validated'
                   WHEN f.failed_at IS NOT NULL AND (w.written_at IS NULL OR f.failed_at >= w.written_at)
                       THEN 'failed'
                   ELSE 'written'
               END AS state,
               coalesce(w.uri, v.uri, f.uri) AS uri,
               w.written_at, v.validated_at, f.failed_at, v.last_verified_step, f.error,
               coalesce(f.failures, 0) AS failures,
               w.ranks_written, w.shards, w.bytes, w.blocking_s, w.write_s, w.digests
        FROM keys k
        LEFT JOIN written w USING (run_id, attempt, step)
        LEFT JOIN validated v USING (run_id, attempt, step)
        LEFT JOIN failed f USING (run_id, attempt, step)
    )
    SELECT run_id, attempt, step, state, state = 'validated' AS validated, uri, written_at,
           validated_at, validated_at - written_at AS validate_seconds, failed_at,
           last_verified_step, error, failures, ranks_written, shards, bytes, blocking_s, write_s,
           digests
    FROM joined""",
    # One row per GpuHealth reading (NVML on the rank's GPU). present = false: no GPU, every
    # other field NULL. nvlink_degraded: fewer NVLink lanes up than expected.
    f"""
    CREATE OR REPLACE VIEW rank_health AS
    SELECT run_id, attempt, rank, node_id, step, "at", h.*,
           h.nvlink_width < h.nvlink_expected_width AS nvlink_degraded, event_id
    FROM (
        SELECT run_id, attempt, rank, node AS node_id, step, ts AS "at", event_id,
               json_transform(payload, '{_GPU_HEALTH_STRUCT}') AS h
        FROM raw_event
        WHERE kind = 'gpu_health'
    )""",
    # The seed's rank_health row, per run attempt and rank (and its node): its pace (median
    # step and compute time: the ewma's robust stand-in), its last sign of life, and a
    # summary of its GPU health (ECC counters are cumulative in NVML: the max is the total).
    """
    CREATE OR REPLACE VIEW rank_status AS
    WITH seen AS (
        SELECT run_id, attempt, rank, node AS node_id,
               max(ts) AS last_seen,
               max(ts) FILTER (WHERE kind IN ('heartbeat', 'step_timing')) AS last_heartbeat,
               max(step) FILTER (WHERE kind = 'step_timing') AS last_step,
               count(*) FILTER (WHERE kind = 'step_timing') AS steps,
               median(CAST(payload->>'total_s' AS DOUBLE)) FILTER (WHERE kind = 'step_timing')
                   AS median_step_s,
               median(CAST(payload->>'compute_s' AS DOUBLE)) FILTER (WHERE kind = 'step_timing')
                   AS median_compute_s
        FROM raw_event
        WHERE rank >= 0 AND kind IN ('heartbeat', 'step_timing', 'gpu_health')
        GROUP BY ALL
    ), health AS (
        SELECT run_id, attempt, rank, node_id,
               count(*)                                AS health_readings,
               max(temperature_c)                      AS max_temperature_c,
               min(sm_clock_mhz)                       AS min_sm_clock_mhz,
               count(*) FILTER (WHERE thermal_throttle) AS throttled_readings,
               count(*) FILTER (WHERE power_capped)     AS power_capped_readings,
               count(*) FILTER (WHERE nvlink_degraded)  AS nvlink_degraded_readings,
               max(ecc_corrected)                      AS ecc_corrected,
               max(ecc_uncorrected)                    AS ecc_uncorrected
        FROM rank_health
        GROUP BY ALL
    )
    SELECT * FROM seen LEFT JOIN health USING (run_id, attempt, rank, node_id)""",
    # The seed's sdc_check row, one per check a rank ran: SdcSelfCheck (the same microbatch
    # twice on one device: passed when both digests agree) and CrossRankCheck (2 or 3 ranks,
    # one microbatch: the processor judges it at its tolerance, so it failed when the
    # processor derived an SdcMismatch for it, and passed otherwise) and RingCheck (one per
    # rank per ring check, its own microbatch against its neighbour's recomputation: failed
    # when the processor named the rank, microbatch '<check_id>/r<rank>'). An SdcMismatch whose
    # check is not archived is a failed row of its own. culprit_rank/culprit_node: the
    # device the mismatch names (-1 / '' when it cannot name one). rank: who ran or reported
    # the check; ranks: every participant (the seed's replay_rank).
    """
    CREATE OR REPLACE VIEW sdc_check AS
    WITH checks AS (
        SELECT event_id, run_id, attempt, rank, node, step, ts, 'self_check' AS method,
               payload->>'microbatch_id' AS microbatch_id, [rank] AS ranks,
               (payload->>'digest_first') = (payload->>'digest_second') AS agreed
        FROM raw_event WHERE kind = 'sdc_self_check'
        UNION ALL
        SELECT event_id, run_id, attempt, rank, node, step, ts, 'cross_rank',
               payload->>'microbatch_id', CAST(payload->'ranks' AS BIGINT[]), NULL
        FROM raw_event WHERE kind = 'cross_rank_check'
        UNION ALL
        SELECT event_id, run_id, attempt, rank, node, step, ts, 'ring',
               (payload->>'check_id') || '/r' || CAST(rank AS VARCHAR),
               [rank, CAST(payload->>'peer_rank' AS BIGINT)], NULL
        FROM raw_event WHERE kind = 'ring_check'
    ), mismatch AS (
        SELECT event_id, run_id, attempt, rank, node, step, ts, payload->>'method' AS method,
               payload->>'microbatch_id' AS microbatch_id, payload->'reason'->>'text' AS reason_text
        FROM raw_event WHERE kind = 'sdc_mismatch'
    )
    SELECT coalesce(c.run_id, m.run_id)             AS run_id,
           coalesce(c.attempt, m.attempt)           AS attempt,
           coalesce(c.step, m.step)                 AS step,
           coalesce(c.ts, m.ts)                     AS "at",
           coalesce(c.method, m.method)             AS method,
           coalesce(c.microbatch_id, m.microbatch_id) AS microbatch_id,
           c.rank, c.node AS node_id, c.ranks,
           CASE WHEN c.event_id IS NULL THEN false
                WHEN c.method = 'self_check' THEN c.agreed
                ELSE m.event_id IS NULL END         AS passed,
           m.rank AS culprit_rank, m.node AS culprit_node, m.event_id AS mismatch_id,
           m.reason_text, c.event_id AS check_id
    FROM checks c
    FULL JOIN mismatch m
      ON m.run_id = c.run_id AND m.attempt = c.attempt AND m.method = c.method
     AND m.microbatch_id = c.microbatch_id""",
    # The seed's run row, from RunStarted: the newest attempt's shape, the first start.
    # state: 'finished' when every rank of the last attempt exited with code 0 unasked,
    # 'interrupted' while the newest interruption has no recovery, else 'running'.
    # goodput: the newest report of the longest window (NULL before the first report).
    """
    CREATE OR REPLACE VIEW run AS
    WITH attempts AS (
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
        GROUP BY a.run_id
    ), clean_exit AS (
        SELECT run_id, attempt, count(DISTINCT rank) AS ranks
        FROM raw_event
        WHERE kind = 'rank_exit' AND payload->>'exit_code' = '0'
          AND NOT coalesce(CAST(payload->>'requested' AS BOOLEAN), false)
        GROUP BY ALL
    ), newest_interruption AS (
        SELECT run_id, arg_max(restart_seconds IS NULL, "at") AS open FROM interruption GROUP BY run_id
    ), newest_goodput AS (
        SELECT run_id, first(goodput ORDER BY window_s DESC, "at" DESC) AS goodput
        FROM goodput GROUP BY run_id
    )
    SELECT a.*,
           CASE WHEN e.ranks >= a.world_size THEN 'finished'
                WHEN i.open THEN 'interrupted'
                ELSE 'running' END AS state,
           g.goodput
    FROM attempts a
    LEFT JOIN clean_exit e ON e.run_id = a.run_id AND e.attempt = a.last_attempt
    LEFT JOIN newest_interruption i ON i.run_id = a.run_id
    LEFT JOIN newest_goodput g ON g.run_id = a.run_id""",
)
