"""Builds telemetry events for the simulator at a few hundred nanoseconds each.

A 16,384-rank cluster at 2 s/step emits ~17,000 events/s, on a machine that also runs
a broker and a processor, so event construction must be cheap. pydantic's
``model_construct`` costs ~3.4 µs per event (more than validating, ~1.8 µs); filling
the model's slots directly costs ~0.7 µs. That skips validation, which is sound here
because every value comes from a scenario validated once at load time and from
arithmetic on it; ``validate=True`` routes every event through full pydantic
validation instead (the tests build with it, so a schema change cannot slip by).

pydantic serialises a constructed model in ``__dict__`` order, so the dict is built
in the schema's field order: envelope first, then the payload fields.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

from ...schemas import Envelope

E = TypeVar("E", bound=Envelope)

_ENVELOPE_FIELDS = tuple(Envelope.model_fields)
_set = object.__setattr__


class _Kind:
    __slots__ = ("cls", "payload", "defaults", "fields_set")

    def __init__(self, cls: type[Envelope]) -> None:
        self.cls = cls
        self.payload = tuple(name for name in cls.model_fields if name not in _ENVELOPE_FIELDS)
        self.defaults = {
            name: field.get_default(call_default_factory=True)
            for name, field in cls.model_fields.items()
            if not field.is_required()
        }
        self.fields_set = frozenset(cls.model_fields)


class EventFactory:
    """Envelope bookkeeping (run id, counter-based unique event ids) plus fast construction."""

    def __init__(self, run_id: str, id_prefix: str, validate: bool = False) -> None:
        self.run_id = run_id
        self.id_prefix = id_prefix
        self.validate = validate
        self._ids = itertools.count()
        self._kinds: dict[type[Envelope], _Kind] = {}

    def next_id(self) -> str:
        return f"{self.id_prefix}-{next(self._ids):x}"

    def make(
        self, cls: type[E], attempt: int, rank: int, node: str, step: int, ts: float, **payload: Any
    ) -> E:
        """One event; payload fields not given take the schema's defaults."""
        data: dict[str, Any] = {
            "event_id": f"{self.id_prefix}-{next(self._ids):x}",
            "run_id": self.run_id,
            "attempt": attempt,
            "rank": rank,
            "node": node,
            "step": step,
            "ts": ts,
        }
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = _Kind(cls)
        for name in kind.payload:
            data[name] = payload[name] if name in payload else kind.defaults[name]
        return self._construct(cls, data, kind.fields_set)

    def template(self, cls: type[Envelope]) -> dict[str, Any]:
        """Every field of `cls` in the schema's order, the payload's defaults filled in and
        the envelope's left None: copy it, fill it, and :meth:`build` it (a hot loop's
        events of one kind, without make's per-field lookups)."""
        defaults = self._kind(cls).defaults
        return {name: defaults.get(name) for name in cls.model_fields}

    def build(self, cls: type[E], data: dict[str, Any]) -> E:
        """An event from a dict of all its fields in the schema's order (validated with
        `validate`)."""
        return self._construct(cls, data, self._kind(cls).fields_set)

    def _construct(self, cls: type[E], data: dict[str, Any], fields_set: frozenset[str]) -> E:
        if self.validate:
            return cls.model_validate(data)
        obj = object.__new__(cls)
        _set(obj, "__dict__", data)
        _set(obj, "__pydantic_fields_set__", fields_set)
        _set(obj, "__pydantic_extra__", None)
        _set(obj, "__pydantic_private__", None)
        return obj

    def _kind(self, cls: type[Envelope]) -> _Kind:
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = _Kind(cls)
        return kind
