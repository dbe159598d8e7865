"""Replay and backtest speed on a recorded 1,024-rank run.

    .venv/bin/python bench/bench_replay.py [--seconds 60] [--speed 4] [--workdir .trainguard/bench-replay]

Records a run through the live pipeline (a local broker, the processor, the simulator's
healthy-1k scenario with a crash and a thermal straggler added, at `--speed` for
`--seconds` of wall clock) and archives the topics (sinks/archive.py), then, with the
pipeline idle: reads the recording back from the topics and from the archive (both must
give the same records), replays the archived one through the policy core under the
policy it ran with (and checks the decisions are identical), from the columns the archive
keeps of its common records and, for comparison, from every record's bytes (each three
times: the best and the median); backtests it under that policy and one other (its
policies spread over the CPUs, then in one process); then both
again from the archive file, its read included (what a user of `trainguard replay
--archive` waits for). Prints events/s and x real time (the recorded run's own duration
over each stage's wall time).
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from harness.devtools.stack import builtin_policy, local_stack
from trainguard.processors.core.policy import load_policy, parse_policy
from trainguard.producers.simulator.driver import run_simulation
from trainguard.producers.simulator.scenario import Scenario
from trainguard.replay.backtest import backtest
from trainguard.replay.log import read_archived_recording, read_recording
from trainguard.replay.parallel import usable_cpus
from trainguard.replay.replay import Replayed, compare, decisions_of, replay, replayed_decisions
from trainguard.sinks.archive import ArchiveWriter

SECRET = uuid.uuid4().hex.encode() * 2
#: Replays of the same recording timed (each stage's best and median are printed).
REPEATS = 3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--workdir", type=Path, default=Path(".trainguard/bench-replay"))
    parser.add_argument("--metrics-port", type=int, default=9468)
    args = parser.parse_args()
    base = Scenario.builtin("healthy-1k").model_dump(mode="json")
    base["faults"] = [
        {"kind": "crash", "rank": 300, "at_step": 60},
        {
            "kind": "slow",
            "rank": 700,
            "from_step": 20,
            "to_step": 100_000,
            "factor": 1.25,
            "cause": "thermal",
        },
    ]
    base["restart_delay_s"] = 30.0
    scenario = Scenario.parse(base, source="bench-replay-1k")
    policy_path = builtin_policy("demo")
    with local_stack(
        args.workdir, policy_path, args.metrics_port, {"TRAINGUARD_SECRET": SECRET.decode()}
    ) as stack:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        sim = run_simulation(
            scenario,
            stack.bootstrap,
            stack.names,
            SECRET,
            speed=args.speed,
            max_seconds=args.seconds,
            run_id=run_id,
        )
        time.sleep(5)  # let the processor publish its last decisions
        t0 = time.perf_counter()
        from_kafka = read_recording(stack.bootstrap, stack.names, run_id)
        read_s = time.perf_counter() - t0
        archive = args.workdir / f"archive-{run_id}"
        with ArchiveWriter(stack.bootstrap, stack.names, archive, group_id=f"archive-{run_id}") as writer:
            writer.run_until_caught_up(timeout_s=600)
    t0 = time.perf_counter()
    recording = read_archived_recording(archive, stack.names, run_id)
    archive_read_s = time.perf_counter() - t0
    assert recording.records == from_kafka.records, "the archive's log differs from the topic's"
    policy = load_policy(str(policy_path))
    # Each replay REPEATS times, a fresh core each time (a replay is a fraction of a second,
    # and one sample on a shared machine is mostly its noise): the best and the median.
    replays = [replay(recording, policy) for _ in range(REPEATS)]
    replayed = replays[0]
    comparison = compare(decisions_of(recording), replayed_decisions(replayed))
    # The same replay from every record's bytes (the archive's columns unused: what it was).
    from_bytes = [replay(recording, policy, columns=False) for _ in range(REPEATS)]
    for other_replay in replays[1:] + from_bytes:
        assert compare(replayed_decisions(other_replay), replayed_decisions(replayed)).identical
    replay_s, bytes_s = _best_and_median(replays), _best_and_median(from_bytes)
    stored = sum(s >= 0 for s in recording.stored.slot) if recording.stored is not None else 0
    other = parse_policy({**policy.model_dump(mode="json"), "straggler": {"consecutive_steps": 50}})
    both = [("demo", policy), ("straggler-50", other)]
    t0 = time.perf_counter()
    result = backtest(recording, both)
    backtest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backtest(recording, both, processes=1)
    one_process_s = time.perf_counter() - t0
    # What a user waits for: the archive read, then the replay or the backtest of what it read.
    t0 = time.perf_counter()
    replay(read_archived_recording(archive, stack.names, run_id), policy)
    replay_e2e_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    backtest(read_archived_recording(archive, stack.names, run_id), both)
    backtest_e2e_s = time.perf_counter() - t0
    run_s = sim.sim_s
    print(f"recorded: {sim.world_size} ranks, {sim.steps_completed} steps, {sim.attempts} attempts, "
          f"{run_s:.0f} s of run time, {replayed.events:,} events in {replayed.records:,} records; "
          f"decisions recorded {comparison.recorded}, identical: {comparison.identical}; "
          f"{stored:,} records kept as columns")  # fmt: skip
    print()
    print("| stage | wall s | events/s | x real time |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| read back from Kafka | {read_s:.2f} | {replayed.events / read_s:,.0f} | {run_s / read_s:,.0f} |"
    )
    print(f"| read back from the archive | {archive_read_s:.2f} | {replayed.events / archive_read_s:,.0f} | "
          f"{run_s / archive_read_s:,.0f} |")  # fmt: skip
    for stage, (best, median) in (
        ("replay (one policy)", replay_s),
        ("the same replay from the records' bytes (no columns)", bytes_s),
    ):
        print(f"| {stage}, best of {REPEATS} (median) | {best:.3f} ({median:.3f}) | "
              f"{replayed.events / best:,.0f} | {run_s / best:,.0f} ({run_s / median:,.0f}) |")  # fmt: skip
    print(f"| backtest (two policies, priced; one process a CPU, {usable_cpus()} here) | {backtest_s:.2f} | "
          f"{2 * replayed.events / backtest_s:,.0f} | {run_s / backtest_s:,.0f} |")  # fmt: skip
    print(f"| the same backtest in one process | {one_process_s:.2f} | "
          f"{2 * replayed.events / one_process_s:,.0f} | {run_s / one_process_s:,.0f} |")  # fmt: skip
    print(f"| from the archive file: read, then replay (one policy) | {replay_e2e_s:.2f} | "
          f"{replayed.events / replay_e2e_s:,.0f} | {run_s / replay_e2e_s:,.0f} |")  # fmt: skip
    print(f"| from the archive file: read, then the backtest (spread) | {backtest_e2e_s:.2f} | "
          f"{2 * replayed.events / backtest_e2e_s:,.0f} | {run_s / backtest_e2e_s:,.0f} |")  # fmt: skip
    print()
    print(f"backtest: straggler-50 differs in {len(result.runs[1].rows)} decisions, "
          f"modelled saving {result.runs[1].saving_s:+.1f} s of job time")  # fmt: skip


def _best_and_median(runs: list[Replayed]) -> tuple[float, float]:
    seconds = sorted(r.seconds for r in runs)
    return seconds[0], seconds[len(seconds) // 2]


if __name__ == "__main__":
    main()
