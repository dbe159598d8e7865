"""Did this rank die because a peer did? Its own error says so, and the launcher and the
processor need to know (issue 17): when a host is lost, every survivor's collective
fails at once (gloo: "Connection reset by peer"; NCCL: "remote process exited"), and
the first of those exits to reach the processor would otherwise be taken for the
culprit, quarantining an innocent host.

So an uncaught error is classified on its way out (:func:`peer_lost`) and noted in the
rank's phases file (:func:`~.rank_files.note_exit`); the launcher copies it into the
RankExit as ``peer_lost``, and the core waits for the culprit's own evidence
(processors/core/detectors/peer_loss.py). Pure: an exception in, a short reason or None out.

The patterns are the transport errors a survivor sees, not a rank's own faults: a CUDA
error, an OOM, a NaN or a bug in the training code never match, so they stay culprits.
A collective timeout matches too: the peer it waited for was alive but stuck (a hang
elsewhere), and the hang's culprit is named from the stacks, not from this rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

#: What a survivor's collective raises when a peer is gone or stuck (gloo's tcp transport,
#: NCCL's watchdog and comm abort, the c10d store). Lower-case substrings.
_PEER_ERRORS = re.compile(
    "|".join(
        re.escape(s)
        for s in (
            "connection reset by peer",
            "connection closed by peer",
            "broken pipe",
            "remote process exited",
            "nccl communicator was aborted",
            "communicator was aborted",
            "ncclremoteerror",
            "watchdog caught collective operation timeout",
            "timed out waiting",
            "connection refused",
        )
    )
)

#: torch.distributed's own types for a lost peer (by name: no torch import here).
_PEER_TYPES = frozenset({"DistNetworkError", "DistStoreError", "AttemptAborted"})


def chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, then its cause (else its context), and so on, each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def peer_lost(error: BaseException | None) -> str | None:
    """The first line of the peer-loss error in `error`'s chain (its cause and context
    included: a training loop may wrap the collective's error in its own), or None when
    nothing in it says a peer was lost."""
    for link in chain(error):
        text = str(link)
        if type(link).__name__ in _PEER_TYPES or _PEER_ERRORS.search(text.lower()):
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(link).__name__)
            return first[:300]
    return None
