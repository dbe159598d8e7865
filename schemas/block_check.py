"""The checks of a columnar block of step timings (schemas/columnar.py) that every block
takes: its shape, then whether every row is common. Compiled by mypyc where a build is
there (schemas/compiled.py): a block of one node's flush holds a few rows, and these
checks as Python were ~4 us a block of builtin calls (a sixth of a replay's decode);
as C loops over the rows they are ~1 us.

Plain Python over lists and dicts, no pydantic (mypyc cannot compile a module that
defines a model; base's constant is read, not compiled) and nothing of the core.
"""

from __future__ import annotations

from typing import Any, Final

from .base import MAX_EVENT_ID, MAX_NAME, NO_STEP

#: The per-row columns, in the order a row lists its fields.
COLUMNS: Final = ("event_id", "attempt", "rank", "step", "ts", "compute_s", "total_s")
#: The keys a block may hold.
FIELDS: Final = frozenset({"schema", "run_id", "node", *COLUMNS})
#: A common row is checked against the envelope's own bounds (schemas/base.py: MAX_EVENT_ID,
#: MAX_NAME, NO_STEP); the per-row one as a constant of this module.
MAX_ID: Final = MAX_EVENT_ID
#: Ints past 64 bits (the model reads them too) take the row by row path: the fast path
#: keeps to what every JSON reader of the log agrees on.
INT_LIMIT: Final = 2**63
_INF: Final = float("inf")


def block_columns(obj: dict[str, Any]) -> list[list[Any]] | str:
    """The block's columns in COLUMNS' order, or what is wrong with its header or shape
    (the block is then rejected whole)."""
    run_id, node = obj.get("run_id"), obj.get("node")
    if (
        not isinstance(run_id, str)
        or not 0 < len(run_id) <= MAX_NAME
        or not isinstance(node, str)
        or len(node) > MAX_NAME
    ):
        return "step_timings/1: run_id and node must be strings (1-128 and 0-128 characters)"
    for key in obj:
        if key not in FIELDS:
            return f"step_timings/1: unknown fields {sorted(set(obj) - FIELDS)}"
    columns: list[list[Any]] = []
    for name in COLUMNS:
        column = obj.get(name)
        if type(column) is not list:
            return f"step_timings/1: every one of {list(COLUMNS)} must be a list"
        columns.append(column)
    n = len(columns[0])
    for column in columns:
        if len(column) != n:
            return "step_timings/1: the columns have different lengths"
    return columns


def common_rows(columns: list[list[Any]]) -> bool:
    """Every row is common: the right types, in range (ids non-empty strings of at most
    MAX_ID characters, ints as ints below INT_LIMIT, floats as finite non-negative
    floats). A block with any other row is read row by row through the model (an int
    among the floats is legal, and that path reads it)."""
    ids, attempts, ranks, steps = columns[0], columns[1], columns[2], columns[3]
    ts, compute, total = columns[4], columns[5], columns[6]
    no_step = NO_STEP  # (a Python module's constant: read once, not per row)
    for i in range(len(ids)):
        event_id = ids[i]
        if type(event_id) is not str or not event_id or len(event_id) > MAX_ID:
            return False
        attempt, rank, step = attempts[i], ranks[i], steps[i]
        if type(attempt) is not int or type(rank) is not int or type(step) is not int:
            return False
        if not (0 <= attempt < INT_LIMIT and 0 <= rank < INT_LIMIT and no_step <= step < INT_LIMIT):
            return False
        at, before, whole = ts[i], compute[i], total[i]
        if type(at) is not float or type(before) is not float or type(whole) is not float:
            return False
        if not (0.0 <= at < _INF and 0.0 <= before < _INF and 0.0 <= whole < _INF):
            return False
    return True
