"""Ready SQL for the operator's questions, over the archive's views (docs/queries.md).

Each query is plain DuckDB SQL with no parameters, so that what the docs show is exactly
what runs: ``trainguard query goodput_by_day``, or ``run_query(db, "goodput_by_day")``.
docs/queries.md holds the same text (a test keeps the two identical); add a query here and
there together.

Times are seconds since the epoch in the views; ``utc(ts)`` (a macro of the archive) shows
one as a UTC timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .archive_store import Db, query


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    question: str
    sql: str


def _q(name: str, question: str, sql: str) -> Query:
    return Query(name, question, sql.strip())


_ALL = (
    _q(
        "interruptions_by_cause_node",
        "Why and where did our jobs stop: interruptions by cause and culprit node, with their cost?",
        """
SELECT cause, node_id, interruptions, runs, round(restart_seconds, 1) AS restart_s,
       lost_steps, round(gpu_hours, 3) AS gpu_hours
FROM interruption_by_cause_node
ORDER BY interruptions DESC, cause, node_id
""",
    ),
    _q(
        "nodes_that_killed_more_than_one_job",
        "Which nodes killed more than one job (a crash, hang or SDC they caused), and are they quarantined?",
        """
SELECT node_id, jobs_killed, run_ids, causes, quarantined, quarantines
FROM node_kill
WHERE jobs_killed > 1
ORDER BY jobs_killed DESC, node_id
""",
    ),
    _q(
        "restart_seconds_by_phase",
        "Where does restart time go: seconds per restart phase (core: every interruption; "
        "launcher: runs under `trainguard launch`)?",
        """
SELECT source, phase, restarts, round(total_seconds, 2) AS total_s, round(mean_seconds, 2) AS mean_s,
       round(max_seconds, 2) AS max_s, round(share, 3) AS share
FROM restart_by_phase
ORDER BY source, phase_order
""",
    ),
    _q(
        "restart_cost_by_cause",
        "What does each kind of interruption cost: detection, restart, lost work, GPU-hours?",
        """
SELECT cause, count(*) AS interruptions, round(avg(detect_seconds), 2) AS mean_detect_s,
       round(avg(restart_seconds), 2) AS mean_restart_s, round(max(restart_seconds), 2) AS max_restart_s,
       sum(lost_steps) AS lost_steps, round(sum(gpu_hours), 3) AS gpu_hours
FROM interruption
GROUP BY cause
ORDER BY gpu_hours DESC, cause
""",
    ),
    _q(
        "goodput_by_day",
        "What was each run's goodput per UTC day, and where did the rest of the time go?",
        """
SELECT day, run_id, round(goodput, 3) AS goodput, round(worst_hour_goodput, 3) AS worst_hour,
       round(elapsed_s) AS elapsed_s, round(restart_s, 1) AS restart_s, round(lost_s, 1) AS lost_s,
       round(checkpoint_s, 2) AS checkpoint_s, round(straggler_s, 1) AS straggler_s
FROM goodput_day
ORDER BY day, run_id
""",
    ),
    _q(
        "runs",
        "What state is each run in, how often did it restart, and what is its goodput?",
        """
SELECT run_id, state, world_size, attempts, round(goodput, 3) AS goodput,
       utc(started_at) AS started_at, utc(last_ts) AS last_seen
FROM run
ORDER BY started_at, run_id
""",
    ),
    _q(
        "timeline",
        "What happened to each run, in order: cause, culprit, cost, and what trainguard did about it?",
        """
SELECT run_id, utc("at") AS "at", cause, node_id, round(restart_seconds, 1) AS restart_s,
       lost_steps, coalesce(decisions, []) AS decisions
FROM timeline
ORDER BY "at", interruption_id
""",
    ),
    _q(
        "checkpoints",
        "Which checkpoints does each run attempt have, and which are validated (resumable)?",
        """
SELECT run_id, attempt, step, state, last_verified_step, round(validate_seconds, 2) AS validate_s,
       ranks_written, shards, bytes
FROM checkpoint
ORDER BY run_id, step, attempt
""",
    ),
    _q(
        "resume_points",
        "Where would each run resume from: its newest validated checkpoint and its SDC watermark?",
        """
SELECT run_id, max(step) AS step, first(uri ORDER BY step DESC, attempt DESC) AS uri,
       first(last_verified_step ORDER BY step DESC, attempt DESC) AS last_verified_step,
       count(*) AS validated_checkpoints
FROM checkpoint
WHERE validated
GROUP BY run_id
ORDER BY run_id
""",
    ),
    _q(
        "failed_checkpoints",
        "Which checkpoints failed, and why?",
        """
SELECT run_id, attempt, step, utc(failed_at) AS failed_at, error
FROM checkpoint
WHERE state = 'failed'
ORDER BY run_id, step, attempt
""",
    ),
    _q(
        "quarantines",
        "Which nodes were taken out of the pool, when, by which decision, and why?",
        """
SELECT node_id, run_id, attempt, utc("at") AS "at", source, reason_code, rank, step
FROM quarantine
ORDER BY "at", node_id
""",
    ),
    _q(
        "sdc_checks_by_method",
        "How many silent-data-corruption checks ran, by method, on how many ranks, and how many failed?",
        """
SELECT method, count(*) AS checks, count(DISTINCT rank) AS ranks_checked,
       count(*) FILTER (WHERE passed) AS passed, count(*) FILTER (WHERE NOT passed) AS failed
FROM sdc_check
GROUP BY method
ORDER BY method
""",
    ),
    _q(
        "sdc_failures",
        "Which devices computed a wrong answer, at which step, caught by which check?",
        """
SELECT run_id, attempt, step, method, microbatch_id, culprit_rank, culprit_node, ranks
FROM sdc_check
WHERE NOT passed
ORDER BY "at", run_id
""",
    ),
    _q(
        "hot_gpus",
        "Which GPUs ran hot (85 C or more), thermally throttled or power-capped?",
        """
SELECT run_id, rank, node_id, count(*) AS readings, max(temperature_c) AS max_temp_c,
       min(sm_clock_mhz) AS min_sm_clock_mhz,
       count(*) FILTER (WHERE thermal_throttle) AS throttled,
       count(*) FILTER (WHERE power_capped) AS power_capped
FROM rank_health
GROUP BY run_id, rank, node_id
HAVING max(temperature_c) >= 85 OR bool_or(thermal_throttle) OR bool_or(power_capped)
ORDER BY max_temp_c DESC, run_id, rank
""",
    ),
    _q(
        "link_and_ecc_errors",
        "Which GPUs had NVLink lanes down or ECC errors?",
        """
SELECT run_id, rank, node_id, min(nvlink_width) AS min_nvlink_width,
       max(nvlink_expected_width) AS expected_width, max(nvlink_retries) AS nvlink_retries,
       max(ecc_corrected) AS ecc_corrected, max(ecc_uncorrected) AS ecc_uncorrected
FROM rank_health
GROUP BY run_id, rank, node_id
HAVING bool_or(nvlink_degraded) OR max(ecc_uncorrected) > 0
ORDER BY run_id, rank, node_id
""",
    ),
    _q(
        "stragglers",
        "Which ranks were flagged as stragglers, why were they slow, and what was decided? (raw_event)",
        """
SELECT f.run_id, f.rank, f.node, f.step AS flagged_at_step,
       round(CAST(f.payload->>'slowdown' AS DOUBLE), 2) AS slowdown,
       d.payload->>'diagnosis' AS diagnosis, e.payload->>'decision' AS decision
FROM raw_event f
LEFT JOIN raw_event d
  ON d.kind = 'straggler_diagnosed' AND list_contains(CAST(d.payload->'caused_by' AS VARCHAR[]), f.event_id)
LEFT JOIN raw_event e
  ON e.kind = 'eviction_decision' AND list_contains(CAST(e.payload->'caused_by' AS VARCHAR[]), d.event_id)
WHERE f.kind = 'straggler_flagged'
ORDER BY f.ts, f.rank
""",
    ),
    _q(
        "node_history",
        "What does the archive hold for or against each node across runs: the interruptions it "
        "caused, its quarantines and failed self-tests, the quarantines given back and the planned "
        "stops (the history `trainguard launch` keeps lemon nodes out by)?",
        """
SELECT node_id, run_id, attempt, utc("at") AS "at", kind, left(detail, 60) AS detail
FROM node_history
ORDER BY node_id, "at", kind, source_id
""",
    ),
)

#: The documented queries by name, in the order docs/queries.md shows them.
QUERIES: dict[str, Query] = {q.name: q for q in _ALL}


def run_query(db: Db, name: str) -> list[dict[str, Any]]:
    """The rows of the named query (KeyError names the known ones)."""
    try:
        sql = QUERIES[name].sql
    except KeyError:
        raise KeyError(f"no query {name!r}; known: {', '.join(QUERIES)}") from None
    return query(db, sql)
