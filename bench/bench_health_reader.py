"""What one GPU health report costs on the rank (issue 46), and what the sampler does to a
training step, in one run.

    .venv/bin/python bench/bench_health_reader.py [--calls 20000] [--steps 3000] [--rounds 6]
        [--interval 1.0] [--bootstrap HOST:PORT]

(a) One sample through the reader, per call:

* the injection hook without a device (TRAINGUARD_INJECT_HEALTH on a GPU-less rank: what
  a CPU test or a chaos drill pays);
* NvmlReader with every NVML call answered at once by a stand-in module (an 18-NVLink
  device, ~110 calls a sample): trainguard's Python around NVML only, a lower bound.
  NVML's own time is not in it;
* the real NvmlReader, only where NVML initialises (a GPU and its driver); elsewhere the
  row says it was not measured.

(b) The report on its way out: ``RankAgent.gpu_health`` (the GpuHealth built and validated,
enqueued into a real TelemetryShipper: what the sampler thread pays), and ``encode`` of the
event (what the shipper's flush thread pays per report). The shipper needs no broker to
enqueue: without --bootstrap it points at a closed port and its bounded queue holds the
events (the calls stay far below its bound). The report is a full v3 one: the stand-in
device's reading with injected counters on top.

(c) A small real CPU training step (MLP 64-256-256-1, batch 64, forward + backward + SGD,
one torch thread) with the sampler running at `--interval` (the real NvmlReader where NVML
initialises, else the injected reader; the agent, the shipper) against the same loop
without it; the two alternate in `--rounds` rounds of `--steps` steps (which goes first
alternates too), the shipper alive throughout. The ratios: of the medians of the rounds'
median step times, of the means, and the median of each round's own ratio (its two loops
ran back to back, under the same load from whatever else the machine runs). Without a
broker, librdkafka's reconnection attempts run in both loops alike (and log to stderr).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainguard.producers.chaos.health_inject import InjectedReader, parse
from trainguard.producers.rank.agent import RankAgent
from trainguard.producers.rank.shipper import ShipperConfig, TelemetryShipper
from trainguard.producers.training.gpu_health import GpuHealthSampler, NvmlReader, open_reader
from trainguard.schemas import GpuHealth, encode

UNREACHABLE = "127.0.0.1:9"  # the discard port: connection refused
INJECTION = parse('{"ranks": [0], "ecc_corrected_per_s": 40, "growth": 1.01, "xid_errors_per_s": 0.1}')


class InstantNvml:
    """Answers every NVML call NvmlReader makes at once, as an 18-NVLink device would
    (values fixed; the event set always empty). Not NVML: its cost is left out."""

    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC, NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 0, 1, 18, 1
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    _value = types.SimpleNamespace(
        fieldId=82, nvmlReturn=0, valueType=1, value=types.SimpleNamespace(uiVal=70)
    )

    class Timeout(Exception):
        pass

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return 61

    def nvmlDeviceGetFieldValues(self, h: Any, ids: list[int]) -> list[Any]:
        return [self._value]

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        return 1980 if clock == 1 else 2619

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock: int) -> int:
        return 1980

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return 512_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return 700_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return 0

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        return 0

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        return 2

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        return []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        return 0

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return 0

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: Any, kinds: int, events: object) -> None:
        return None

    def nvmlEventSetWait(self, events: object, timeout_ms: int) -> Any:
        raise self.Timeout("Timeout")


def per_call_us(fn: Callable[[], object], calls: int) -> list[float]:
    for _ in range(min(1000, calls)):  # warm-up
        fn()
    clock = time.perf_counter_ns
    out = [0.0] * calls
    for i in range(calls):
        start = clock()
        fn()
        out[i] = (clock() - start) / 1000
    return out


def row(what: str, durations: list[float], note: str = "") -> str:
    ordered = sorted(durations)
    p50, p99 = ordered[len(ordered) // 2], ordered[int(0.99 * len(ordered))]
    mean = statistics.fmean(durations)
    return f"| {what} | {len(durations):,} | {mean:.2f} | {p50:.2f} | {p99:.2f} | {note} |"


def step_loop(steps: int) -> Callable[[], list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randn(64, 1)

    def run() -> list[float]:
        times = [0.0] * steps
        for i in range(steps):
            t0 = time.perf_counter()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            times[i] = time.perf_counter() - t0
        return times

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=3000, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each loop, alternating")
    parser.add_argument("--interval", type=float, default=1.0, help="the sampler's interval in (c), seconds")
    parser.add_argument("--bootstrap", default=UNREACHABLE, help="the shipper's broker (default: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    topic = "bench.telemetry"
    if args.bootstrap != UNREACHABLE:
        from trainguard.kafka.topics import ensure_topics, topic_names

        ensure_topics(args.bootstrap, prefix="bench.")
        topic = topic_names("bench.").telemetry
    shipper = TelemetryShipper(ShipperConfig(args.bootstrap, topic), "bench-run", 1, name="bench")
    agent = RankAgent(shipper, "bench-run", attempt=0, rank=0, node="bench-node")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"shipper to {args.bootstrap}")  # fmt: skip
    print()
    print("| per report | calls | mean µs | p50 µs | p99 µs | note |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    alone = InjectedReader(INJECTION, None)
    print(row("(a) injected reader, no device", per_call_us(alone.sample, args.calls)), flush=True)
    stand_in = NvmlReader(InstantNvml(), "gpu0")
    print(row("(a) NvmlReader, NVML answered at once", per_call_us(stand_in.sample, args.calls),
              "Python around ~110 NVML calls; NVML's own time excluded"), flush=True)  # fmt: skip
    real = open_reader()
    if real is None:
        print(
            "| (a) NvmlReader, real NVML | – | – | – | – | not measured: NVML did not initialise (no GPU) |"
        )
    else:
        real_calls = min(args.calls, 200)  # a millisecond or so each call
        print(row("(a) NvmlReader, real NVML", per_call_us(real.sample, real_calls), "this host's GPU"))
    fields = InjectedReader(INJECTION, stand_in).sample()  # a full v3 report
    emit = per_call_us(lambda: agent.gpu_health(**fields), args.calls)
    print(row("(b) agent.gpu_health → shipper queue", emit, "build + validate + enqueue (sampler thread)"))
    event = GpuHealth(**agent._envelope(0), **fields)
    print(row("(b) encode", per_call_us(lambda: encode(event), args.calls),
              f"{len(encode(event))} bytes (shipper's flush thread)"), flush=True)  # fmt: skip

    def loop_reader() -> NvmlReader | InjectedReader:  # on a GPU the real one, else the hook
        return real if real is not None else InjectedReader(INJECTION, None)

    run = step_loop(args.steps)
    run()  # warm-up
    bare: list[list[float]] = []
    sampled: list[list[float]] = []
    samples = 0
    for i in range(args.rounds):
        if i % 2:  # alternate which loop goes first: no order effect in the ratio
            bare.append(run())
        sampler = GpuHealthSampler(agent.gpu_health, loop_reader(), args.interval).start()
        sampled.append(run())
        sampler.stop()
        samples += sampler.samples
        if not i % 2:
            bare.append(run())
    stats = shipper.close(timeout_s=0.5 if args.bootstrap == UNREACHABLE else 30)
    median = (
        statistics.median(statistics.median(r) for r in bare),
        statistics.median(statistics.median(r) for r in sampled),
    )
    mean = (
        statistics.fmean(statistics.fmean(r) for r in bare),
        statistics.fmean(statistics.fmean(r) for r in sampled),
    )
    print()
    print(f"(c) MLP 64-256-256-1, batch 64, 1 thread; {args.rounds} rounds x {args.steps} steps each way; "
          f"sampler every {args.interval:g} s ({samples} reports, {type(loop_reader()).__name__}); "
          f"shipper: {stats.submitted:,} submitted, "
          f"{stats.delivered:,} delivered, {stats.dropped:,} dropped",
          flush=True)  # fmt: skip
    print()
    print("| step time | without sampler | with sampler | with / without |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| median | {median[0] * 1e6:,.1f} µs | {median[1] * 1e6:,.1f} µs | {median[1] / median[0]:.4f} |")
    print(f"| mean | {mean[0] * 1e6:,.1f} µs | {mean[1] * 1e6:,.1f} µs | {mean[1] / mean[0]:.4f} |")
    # Each round's two loops ran back to back, under the same load from other processes.
    paired = [statistics.median(b) / statistics.median(a) for a, b in zip(bare, sampled, strict=True)]
    print(f"| median, round by round | | | {statistics.median(paired):.4f} "
          f"(rounds {min(paired):.3f} to {max(paired):.3f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
