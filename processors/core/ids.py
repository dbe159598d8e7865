"""Deterministic ids for the core's outputs.

An output's id is a function of what caused it, so re-processing the same input
after a crash (at-least-once delivery) re-creates the same ids and every consumer
can drop the repeat: the derived event by event_id, the command by command_id.
"""

from __future__ import annotations

import uuid

_NAMESPACE = uuid.UUID("5d0c2f7e-2f0c-4d7e-9a55-7472616e6775")


def derived_id(kind: str, *causes: str | int) -> str:
    return uuid.uuid5(_NAMESPACE, ":".join([kind, *map(str, causes)])).hex
