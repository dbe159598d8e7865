"""A hang at 2,048 ranks through the LIVE pipeline: where the seconds go after the timeout.

    .venv/bin/python bench/bench_hang_live.py                      # hang-2048 at real speed
    .venv/bin/python bench/bench_hang_live.py --speed 2 --scenario hang-2048

Starts a local stack (a fresh Kafka broker and one processor, `harness.devtools.stack.local_stack`,
policies/evaluate.yaml), runs the scenario through the simulator with its actuator (the
processor's commands are executed and acknowledged), and then reads the run's records back
with their Kafka timestamps. Every moment is put on one wall clock, in seconds after the
hang TIMEOUT (the last completed step + the watchdog's timeout; at speed s a simulated
instant t is start + (t - start) / s of wall clock):

  hang timeout       last progress + timeout_s (from HangDetected)
  hang detected      the heartbeat that exceeded it (HangDetected.ts)
  abort published    CreateTime of the Abort(stack_dump) record on the commands topic
  abort acked        the first and last Ack of that abort (Ack.ts, the simulator's clock)
  dumps submitted    the simulator handed the RankExit records (stack signatures) to its
                     shipper (first, last, how many)
  verdict            CreateTime of the hang's Interruption on the events topic, its culprit
                     and reason
  quarantines        QuarantineNode commands issued for the run (only the culprit's node is
                     allowed)

Targets (issue 14): abort acked <= 10 s after the timeout, culprit named from its stack
(reason code odd_stack), no innocent node quarantined. Exit status 1 when one is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from harness.devtools.stack import PROCESSOR_GROUP, builtin_policy, local_stack
from trainguard.kafka.lag import wait_caught_up
from trainguard.producers.simulator import Scenario
from trainguard.producers.simulator.driver import run_simulation
from trainguard.schemas import (
    Abort,
    Ack,
    Envelope,
    HangDetected,
    Interruption,
    InterruptionCause,
    QuarantineNode,
    RankExit,
    ReasonCode,
    decode,
)
from trainguard.schemas.auth import load_master_secret, write_secret_file
from trainguard.schemas.codec import ACKS, COMMANDS, DERIVED


@dataclass
class DumpWitness:
    """What the simulator handed its shipper: when the stack dumps (RankExit) left it."""

    first: float | None = None
    last: float | None = None
    count: int = 0
    exits: list[float] = field(default_factory=list)

    def __call__(self, events: list[Envelope]) -> None:
        now = time.time()
        n = sum(1 for e in events if isinstance(e, RankExit) and e.stack_signature)
        if n:
            self.first = now if self.first is None else self.first
            self.last = now
            self.count += n


def read_timestamped(bootstrap: str, topic: str) -> list[tuple[float, bytes]]:
    """Every record of `topic` up to its current end, with its Kafka timestamp (s)."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    out: list[tuple[float, bytes]] = []
    try:
        for p in sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high <= low:
                continue
            consumer.assign([TopicPartition(topic, p, low)])
            offset = low
            while offset < high:
                for msg in consumer.consume(5000, 1.0):
                    if msg.error() is None:
                        out.append((msg.timestamp()[1] / 1000.0, msg.value() or b""))
                        offset = msg.offset() + 1
    finally:
        consumer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="hang-2048")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TRAINGUARD_HOME", ".trainguard")) / "bench-hang"
    )
    parser.add_argument("--metrics-port", type=int, default=9477)
    parser.add_argument("--target-s", type=float, default=10.0, help="abort ack after the timeout")
    args = parser.parse_args()

    scenario = Scenario.library()[args.scenario]
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRAINGUARD_SECRET_FILE", str(write_secret_file(args.workdir / "secret")))
    secret = load_master_secret()
    run_id = f"bench-{scenario.name}-{uuid.uuid4().hex[:6]}"
    witness = DumpWitness()
    with local_stack(args.workdir.resolve(), builtin_policy("evaluate"), args.metrics_port) as stack:
        t0 = time.time()
        result = run_simulation(
            scenario, stack.bootstrap, stack.names, secret, speed=args.speed, run_id=run_id, start_ts=t0,
            on_submit=witness,
        )  # fmt: skip
        wait_caught_up(stack.bootstrap, PROCESSOR_GROUP, [stack.names.telemetry], timeout_s=120)
        time.sleep(1.0)
        derived = [
            (ts, decode(v, DERIVED)) for ts, v in read_timestamped(stack.bootstrap, stack.names.events)
        ]
        commands = [
            (ts, decode(v, COMMANDS)) for ts, v in read_timestamped(stack.bootstrap, stack.names.commands)
        ]
        acks = [decode(v, ACKS) for _, v in read_timestamped(stack.bootstrap, stack.names.acks)]

    def wall(sim_ts: float) -> float:
        return t0 + (sim_ts - t0) / args.speed

    hangs = [d for _, d in derived if isinstance(d, HangDetected) and d.run_id == run_id]
    if not hangs:
        print(f"no HangDetected for {run_id}; events {result.events_generated}", file=sys.stderr)
        return 1
    hang = hangs[0]
    timeout_at = wall(hang.ts - hang.stalled_s + hang.timeout_s)
    aborts = [(ts, c) for ts, c in commands if isinstance(c, Abort) and c.run_id == run_id and c.stack_dump]
    abort_ts, abort = aborts[0]
    mine = [a for a in acks if isinstance(a, Ack) and a.command_id == abort.command_id]
    verdicts = [
        (ts, d)
        for ts, d in derived
        if isinstance(d, Interruption) and d.run_id == run_id and d.cause == InterruptionCause.HANG
    ]
    quarantined = sorted(
        {c.node for _, c in commands if isinstance(c, QuarantineNode) and c.run_id == run_id}
    )

    def at(wall_ts: float | None) -> str:
        return "-" if wall_ts is None else f"{wall_ts - timeout_at:+.2f} s"

    truth = next(f for f in scenario.truth() if f.kind == "hang")
    print(f"# {scenario.name}: {scenario.world_size} ranks, speed {args.speed:g}, run {run_id}")
    print(f"events generated {result.events_generated:,} ({result.events_per_s:,.0f}/s), "
          f"max shipper lag {result.max_lag_s:.2f} s, attempts {result.attempts}")  # fmt: skip
    print(
        f"hang timeout       {at(timeout_at)}  (timeout {hang.timeout_s:.1f} s after step {hang.last_step})"
    )
    print(f"hang detected      {at(wall(hang.ts))}")
    print(f"abort published    {at(abort_ts)}")
    first_ack = min((a.ts for a in mine), default=None)
    last_ack = max((a.ts for a in mine), default=None)
    print(f"abort acked        {at(first_ack)} first, {at(last_ack)} last ({len(mine)} acks)")
    print(f"dumps submitted    {at(witness.first)} first, {at(witness.last)} last ({witness.count} exits)")
    ok = first_ack is not None and first_ack - timeout_at <= args.target_s
    if verdicts:
        v_ts, verdict = verdicts[0]
        named = verdict.rank == truth.rank and verdict.reason.code == ReasonCode.ODD_STACK
        print(f"verdict            {at(v_ts)}  culprit rank {verdict.rank} ({verdict.node}): "
              f"{verdict.reason.code}: {verdict.reason.text}")  # fmt: skip
        ok = ok and named
    else:
        print("verdict            none")
        ok = False
    innocent = [n for n in quarantined if n != truth.node]
    print(f"quarantined        {quarantined or 'none'}; innocent: {innocent or 'none'}")
    ok = ok and not innocent
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
