"""The glue between raw Kafka values and the pure core, shared by every driver.

`CoreDriver.handle(value)` decodes one telemetry record, folds its events into the
core, signs the commands the core decided, and returns what to publish and what to
dead-letter. It does no I/O itself, so the faust app, the replay engine and the tests
run exactly the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schemas import Command, Derived, Rejection, decode_batch
from ..schemas.auth import run_key, sign
from .core import CorePolicy, CoreState, Output, step


@dataclass
class DriverResult:
    derived: list[Derived] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    events: int = 0
    duplicates: int = 0


@dataclass
class CoreDriver:
    policy: CorePolicy
    master_secret: bytes
    state: CoreState = field(default_factory=CoreState)
    _keys: dict[str, bytes] = field(default_factory=dict)

    def _registered_world_size(self, run_id: str) -> int | None:
        run = self.state.runs.get(run_id)
        return run.world_size if run is not None else None

    def key(self, run_id: str) -> bytes:
        if run_id not in self._keys:
            self._keys[run_id] = run_key(self.master_secret, run_id)
        return self._keys[run_id]

    def handle(self, value: bytes) -> DriverResult:
        decoded = decode_batch(value, registered=self._registered_world_size)
        result = DriverResult(rejections=list(decoded.rejections), events=len(decoded.events))
        hint = decoded.header.world_size if decoded.header is not None else None
        for event in decoded.events:
            before = self._duplicates(event.run_id)
            _, outputs = step(self.state, event, self.policy, world_size_hint=hint)
            result.duplicates += self._duplicates(event.run_id) - before
            self._collect(outputs, result)
        return result

    def _duplicates(self, run_id: str) -> int:
        run = self.state.runs.get(run_id)
        return run.duplicates if run is not None else 0

    def _collect(self, outputs: list[Output], result: DriverResult) -> None:
        for output in outputs:
            if isinstance(output, Command):
                result.commands.append(sign(output, self.key(output.run_id)))
            else:
                result.derived.append(output)
