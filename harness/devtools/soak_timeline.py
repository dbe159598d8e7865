"""Where an abort's seconds go under chaos (issue 49): for each abort of a soak run, the
wall time of every stage from its cause to its first ack, and what the processor workers
did to the run's partition meanwhile.

Stages (wall clock, all from this machine):

- fault: the crash, or the hang's timeout (the abort's `issued_ts`, its cause's event time);
- shipped: the Kafka timestamp of the telemetry record that carried the cause (the
  crash's rank exit, the heartbeat that showed the stall) — the shipper's share;
- decided: the Kafka timestamp of the abort on the commands topic — the worker's share,
  its recovery after a kill included (the worker stages below say how much);
- received: the actuator read it and handed it to the simulated cluster;
- executed: the simulated launcher tore the attempt down;
- acked: the first ack's time.

The worker stages come from the workers' own logs (they run at --loglevel info): each
SIGKILL, each revocation (a rebalance began), each group join and each recovery of the
run's partition (its end, and how long the fold took), relative to the fault.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from trainguard.schemas import Abort, Ack, Derived

#: faust's log line prefix: `[2026-12-06 19:55:12,440] [15145] [INFO] `.
_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[\d+\] \[\w+\] (.*)$")
_RECOVERED = re.compile(r"recovered \S+\[(\d+)\] at \d+: .* published, ([\d.]+) s")


@dataclass(frozen=True)
class WorkerEvent:
    ts: float
    worker: str
    what: str  # "kill", "revoke", "join", "recovered"
    partition: int = -1
    seconds: float = 0.0

    def describe(self, origin: float) -> str:
        at = f"{self.ts - origin:+.1f}"
        if self.what == "recovered":
            return f"{self.worker} recovered p{self.partition} {at} (fold {self.seconds:.1f} s)"
        return f"{self.worker} {self.what} {at}"


@dataclass
class AbortTimeline:
    run_id: str
    command_id: str
    cause: str  # the derived record the abort answers: interruption, hang_detected, ...
    fault: float
    shipped: float | None = None
    decided: float | None = None
    received: float | None = None
    executed: float | None = None
    acked: float | None = None
    #: What the workers did between the fault (less a little) and the decision.
    workers: list[str] = field(default_factory=list)
    #: For an abort that never reached the ranks: where it stopped (see :func:`stopped_at`).
    stopped: str = ""

    def stages(self) -> list[float | None]:
        """Seconds of each stage: ship, decide, deliver, execute, ack; then the total."""
        marks = [self.fault, self.shipped, self.decided, self.received, self.executed, self.acked]
        out: list[float | None] = []
        for a, b in zip(marks, marks[1:], strict=False):
            out.append(b - a if a is not None and b is not None else None)
        out.append(self.acked - self.fault if self.acked is not None else None)
        return out


def worker_events(logs: Path, kills: dict[str, list[float]]) -> list[WorkerEvent]:
    """The SIGKILLs (`kills`: wall times by slot name) and what the worker logs
    (`<slot>.<incarnation>.log` under `logs`) say about the group and recoveries."""
    events = [WorkerEvent(ts, name, "kill") for name, times in kills.items() for ts in times]
    for path in sorted(logs.glob("worker-*.log")):
        worker = path.name.rsplit(".", 2)[0]
        for line in path.read_text(errors="replace").splitlines():
            if (m := _LINE.match(line)) is None:
                continue
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            text = m.group(2)
            if text.startswith("Revoking previously assigned partitions") and "set()" not in text:
                events.append(WorkerEvent(ts, worker, "revoke"))
            elif text.startswith("generation ") and " kept " in text:
                events.append(WorkerEvent(ts, worker, "kept its partitions"))
            elif text.startswith("Joined group"):
                events.append(WorkerEvent(ts, worker, "join"))
            elif (r := _RECOVERED.search(text)) is not None:
                events.append(WorkerEvent(ts, worker, "recovered", int(r.group(1)), float(r.group(2))))
    return sorted(events, key=lambda e: e.ts)


def _consumer(bootstrap: str) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"trainguard-soak-timeline-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )


@dataclass(frozen=True)
class Placed:
    """A command's first record on the commands topic: its Kafka timestamp and place."""

    ts: float
    partition: int
    offset: int


def command_times(bootstrap: str, topic: str, ids: set[str]) -> dict[str, Placed]:
    """The first record of each command id in `ids` on `topic`."""
    found: dict[str, Placed] = {}
    if not ids:
        return found
    consumer = _consumer(bootstrap)
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions
        }
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        done = {p for p, end in ends.items() if end == 0}
        while len(done) < len(ends) and len(found) < len(ids):
            message = consumer.poll(5.0)
            if message is None:
                break
            if message.error() is not None:
                continue
            value = message.value() or b""
            for command_id in ids - found.keys():
                if command_id.encode() in value:
                    place = (message.partition() or 0, message.offset() or 0)
                    found[command_id] = Placed(message.timestamp()[1] / 1000, *place)
            if (message.offset() or 0) + 1 >= ends[message.partition() or 0]:
                done.add(message.partition() or 0)
    finally:
        consumer.close()
    return found


def committed(bootstrap: str, group: str, topic: str, partition: int) -> int | None:
    """The offset `group` committed on `topic[partition]` (None: none)."""
    consumer = _consumer(bootstrap)
    try:
        (tp,) = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return tp.offset if tp.error is None and tp.offset >= 0 else None
    finally:
        consumer.close()


def stopped_at(placed: Placed | None, read_up_to: int | None, ended: float | None) -> str:
    """Where an abort that never reached the simulated ranks stopped: not on the commands
    topic; on it but not read by the run's actuator (its group's committed offset short of
    the record), after the run had ended or while it ran; read by the actuator and not
    handed to the ranks (its gate let it through to no rank, or dropped it)."""
    if placed is None:
        return "never on the commands topic"
    if read_up_to is not None and read_up_to > placed.offset:
        return f"read by the actuator (p{placed.partition}@{placed.offset}), handed to no rank"
    where = f"on the commands topic (p{placed.partition}@{placed.offset}), not read by the actuator"
    if ended is None:
        return where
    if placed.ts >= ended:
        return f"{where}: the run had ended {placed.ts - ended:.1f} s before"
    return f"{where}: the run went on {ended - placed.ts:.1f} s"


def record_time(bootstrap: str, topic: str, partition: int, since: float, needle: bytes) -> float | None:
    """The Kafka timestamp of the first record of `topic[partition]` at or after `since`
    (less a margin) whose bytes hold `needle` (an event id); None if none in 2 minutes."""
    consumer = _consumer(bootstrap)
    try:
        (start,) = consumer.offsets_for_times(
            [TopicPartition(topic, partition, int((since - 5.0) * 1000))], timeout=10
        )
        if start.offset < 0:
            return None
        consumer.assign([start])
        while (message := consumer.poll(5.0)) is not None:
            if message.error() is not None:
                continue
            ts = message.timestamp()[1] / 1000
            if needle in (message.value() or b""):
                return ts
            if ts > since + 120.0:
                return None
        return None
    finally:
        consumer.close()


def abort_timelines(
    run_id: str,
    aborts: list[Abort],
    derived: list[Derived],
    acks: list[Ack],
    command_times_: dict[str, tuple[float, float | None]],
    start_ts: float,
    speed: float,
    bootstrap: str,
    topics: tuple[str, str],
    partition: int,
    workers: list[WorkerEvent],
    actuator_group: str = "",
    ended: float | None = None,
) -> list[AbortTimeline]:
    """One timeline per abort of the run (`topics`: telemetry and commands); an abort that
    never reached the ranks says where it stopped (`actuator_group`: the run's actuator's
    offsets; `ended`: when the simulated run stopped, wall time)."""
    telemetry, commands = topics
    causes = {d.event_id: d for d in derived}
    first_ack: dict[str, float] = {}
    for ack in acks:
        first_ack[ack.command_id] = min(ack.ts, first_ack.get(ack.command_id, ack.ts))
    decided = command_times(bootstrap, commands, {a.command_id for a in aborts})
    out = []
    for abort in aborts:
        fault = start_ts + (abort.issued_ts - start_ts) / speed
        cause = causes.get(abort.caused_by[0]) if abort.caused_by else None
        line = AbortTimeline(run_id, abort.command_id, cause.KIND if cause is not None else "?", fault)
        if cause is not None and cause.caused_by:
            line.shipped = record_time(bootstrap, telemetry, partition, fault, cause.caused_by[-1].encode())
        placed = decided.get(abort.command_id)
        line.decided = placed.ts if placed is not None else None
        line.received, line.executed = command_times_.get(abort.command_id, (None, None))
        if line.received is None:
            read = committed(bootstrap, actuator_group, commands, placed.partition) if placed else None
            line.stopped = stopped_at(placed, read, ended)
        line.acked = first_ack.get(abort.command_id)
        until = line.decided if line.decided is not None else fault + 60.0
        line.workers = [
            e.describe(fault)
            for e in workers
            if fault - 20.0 <= e.ts <= until and (e.what != "recovered" or e.partition == partition)
        ]
        out.append(line)
    return out
