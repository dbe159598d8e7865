"""A backtest's policies spread over the machine's cores (issue 20).

Each policy's core folds the log independently of the others', so a backtest of several
policies splits them into shares, one per core: the first share is replayed here (with
the progress and the log's columns), every other in a forked child that replays its
share of the same recording (inherited from this process, not copied) and sends back
its Replayed results. A child decodes the log for itself: the decoded records are not
worth sending (pickling one costs about what decoding it does). Two policies on two
cores take the time of one policy's replay rather than that plus a second fold.

Fork keeps it cheap: a spawned child would import trainguard and receive the whole
recording. Where fork is not offered (not Linux), or with one core or one policy, the
shares are replayed here in one pass (replay.replay_all); the decisions are the same
either way (each policy's fold is the same code over the same records).
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from ..processors.core import CorePolicy
from ..schemas.codec import DecodedParts
from ..schemas.record_columns import StoredColumns
from .log import Recording
from .replay import REPLAY_SECRET, Replayed, replay_all


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not offered on every platform)
        return os.cpu_count() or 1


def replay_spread(
    recording: Recording,
    policies: Sequence[CorePolicy],
    progress: Callable[[str, int, int], None] | None = None,
    observe: Callable[[DecodedParts], None] | None = None,
    processes: int | None = None,
    observe_stored: Callable[[StoredColumns, int], None] | None = None,
) -> list[Replayed]:
    """replay_all's results, in `policies`' order, its policies spread over `processes`
    (default: the usable CPUs; never more than one process a policy). The observers see
    the log in this process."""
    count = min(len(policies), processes or usable_cpus())
    if count <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return replay_all(
            recording, policies, progress=progress, observe=observe, observe_stored=observe_stored
        )
    shares = [list(range(first, len(policies), count)) for first in range(count)]
    context = multiprocessing.get_context("fork")
    children: list[tuple[list[int], BaseProcess, Connection]] = []
    results: list[Replayed | None] = [None] * len(policies)
    try:
        for share in shares[1:]:
            receive, send = context.Pipe(duplex=False)
            child = context.Process(
                target=_replay_share, args=(recording, [policies[i] for i in share], send), daemon=True
            )
            child.start()
            send.close()  # (the child holds its own end: EOF here when it dies)
            children.append((share, child, receive))
        mine = replay_all(
            recording,
            [policies[i] for i in shares[0]],
            progress=progress,
            observe=observe,
            observe_stored=observe_stored,
        )
        for i, replayed in zip(shares[0], mine, strict=True):
            results[i] = replayed
        for share, process, receive in children:
            for i, replayed in zip(share, _answer(share, process, receive), strict=True):
                results[i] = replayed
    finally:  # (this process failed, or a child did: none is left running or blocked)
        for _, process, receive in children:
            receive.close()
            if process.is_alive():
                process.terminate()
            process.join()
    return [r for r in results if r is not None]


def _answer(share: list[int], child: BaseProcess, receive: Connection) -> list[Replayed]:
    """A child's results; its error, or its death before it answered, raised here."""
    try:
        outcome = receive.recv()
    except EOFError:
        child.join()
        outcome = f"the process exited with code {child.exitcode} before it answered"
    if isinstance(outcome, str):
        raise RuntimeError(f"replaying policies {share} in a child process failed: {outcome}")
    return list(outcome)


def _replay_share(recording: Recording, policies: list[CorePolicy], send: Connection) -> None:
    """A child's share: its Replayed results, or the error's traceback as text."""
    try:
        outcome: list[Replayed] | str = replay_all(recording, policies, REPLAY_SECRET)
    except BaseException:  # noqa: BLE001 - the parent raises it, with the child's traceback
        outcome = traceback.format_exc()
    send.send(outcome)
    send.close()
