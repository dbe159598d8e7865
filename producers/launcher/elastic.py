"""Elastic training, the launcher's side (issue 45; the rank's side is
producers/training/elastic.py, docs/elastic.md): the size of the next world.

``trainguard launch --nproc N --min-nproc M --restart in-process``. When a rank is lost and
fewer warm spares are ready than the world is short of, there are two ways on:

* **wait**: start new processes for the lost ranks and go on at N once they have imported
  everything (on one host the replacement is a new process; across hosts a spare host);
* **shrink**: go on at once with the survivors (and the ready spares), in their processes,
  in a world of at least M, the same global batch spread over fewer ranks; the processes
  that will take the missing ranks start meanwhile, and the world grows back to N at a
  checkpoint boundary once they are ready (:func:`should_grow`, hot.py's ``resize``).

Which one is the policy's: the processor's ``InterruptionDecided`` says it (its
``capacity``); a launcher that heard nothing from it (offline, or the processor down) shrinks
whenever it may, the choice that loses the least when the replacement's time is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LauncherConfig


@dataclass(frozen=True)
class Sizing:
    """The next attempt's world size, and why (the restart's record says it)."""

    size: int
    reason: str

    @property
    def text(self) -> str:
        return f"world {self.size}: {self.reason}"


def next_size(
    config: LauncherConfig,
    survivors: int,
    ready: int,
    capacity: str | None,
    unanswered: str = "no decision from the processor",
) -> Sizing:
    """After an in-process interruption: `survivors` rank processes kept, `ready` warm
    spares idling, `capacity` the processor's choice ("wait", "shrink"; None: no answer,
    and `unanswered` says why: a drain is planned, it gets no capacity decision)."""
    full = config.nproc
    have = survivors + ready
    if not config.elastic or have >= full:
        return Sizing(full, "every rank has a process" if have >= full else "elastic training is off")
    floor = config.min_nproc or full
    if have < floor:
        return Sizing(full, f"{have} ranks left, below the minimum of {floor}: waiting for new processes")
    if capacity == "wait":
        return Sizing(full, "the processor's policy waits for the replacement")
    why = "the processor's policy shrinks" if capacity == "shrink" else unanswered
    return Sizing(have, f"{why}: {have} of {full} ranks go on, {full - have} replaced when ready")


def should_grow(config: LauncherConfig, size: int, ready: int) -> bool:
    """One host: a smaller world grows back once the spares ready fill it to full size.
    (Across hosts a host waiting in the rendezvous grows it: attempt.py's watch.)"""
    if config.rendezvous is not None:
        return False
    return config.elastic and size < config.nproc and ready >= config.nproc - size
