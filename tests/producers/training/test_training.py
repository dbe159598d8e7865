"""The training-side API on real torch (CPU): step timing, invariants, DDP on 2 gloo ranks,
and one command through the real broker."""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard.kafka.topics import TopicNames
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.training.supervisor import (
    NonFiniteLoss,
    Supervisor,
    SupervisorConfig,
    UpdateVerdict,
    init_process_group,
)
from trainguard.schemas import (
    Ack,
    AckStatus,
    CheckpointNow,
    GpuHealth,
    Heartbeat,
    Reason,
    ReasonCode,
    RingCheck,
    SdcSelfCheck,
    StepStats,
    StepTiming,
    auth,
    decode,
    encode,
)
from trainguard.schemas.codec import ACKS

from ...readers import TopicReader


def make(tmp_path: Path, **kw: Any) -> tuple[Supervisor, MemorySink, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    sink = MemorySink()
    sup = Supervisor("run-t", sink=sink, model=model, run_dir=tmp_path, gpu_reader=None, **kw)
    return sup, sink, model


def test_step_timing_and_stats(tmp_path: Path) -> None:
    sup, sink, model = make(tmp_path)
    with sup.step(0) as s:
        loss = model(torch.ones(4, 8)).square().mean()
        loss.backward()
        s.compute_done()
        time.sleep(0.05)  # "the collective": after compute_done, in total_s only
        assert s.check(loss)
    (timing,) = sink.of(StepTiming)
    (stats,) = sink.of(StepStats)
    # the 50 ms "collective" is in total_s only (were it in compute_s too, the gap would be ~0);
    # no bound on compute_s itself: a cold first step on a loaded machine took 53 ms
    assert timing.total_s - timing.compute_s >= 0.045
    assert stats.finite and stats.loss == pytest.approx(loss.item()) and stats.grad_norm is not None
    assert sink.of(GpuHealth)[0].present is False  # no GPU here: absent, not faked
    sup.close()


def test_the_progress_file_holds_the_newest_completed_step_and_a_step_that_raised_is_not_one(
    tmp_path: Path,
) -> None:
    from trainguard.producers.launcher.records import read_progress

    progress = tmp_path / "attempt-0" / "rank-0.progress"
    sup, sink, model = make(tmp_path, progress_file=progress)
    assert read_progress(progress) is None  # no step completed yet
    for step in range(3):
        with sup.step(step) as s:
            loss = model(torch.ones(4, 8)).square().mean()
            loss.backward()
            s.check(loss)
        assert read_progress(progress) == step
    with pytest.raises(RuntimeError), sup.step(3):  # a peer died in the collective
        raise RuntimeError("Connection reset by peer")
    assert read_progress(progress) == 2
    assert [t.step for t in sink.of(StepTiming)] == [0, 1, 2]  # no StepTiming for step 3
    sup.close()


def test_heartbeats_carry_the_phase_the_loop_is_in(tmp_path: Path) -> None:
    sup, sink, model = make(tmp_path)
    seen: list[str] = []

    def beat() -> None:  # what the shipper's flush thread does every heartbeat interval
        sup.agent.heartbeat()
        seen.append(sink.of(Heartbeat)[-1].phase)

    for step, batch in sup.steps([torch.ones(4, 8)]):
        with sup.step(step, batch) as s:
            beat()
            loss = model(batch).square().mean()
            loss.backward()
            s.compute_done()
            beat()
            if s.check(loss):
                beat()
    beat()
    assert seen == ["forward", "allreduce", "optimizer", "data"]
    sup.close()


def test_the_launchers_skipped_batches_are_passed_over(tmp_path: Path) -> None:
    env = {"TRAINGUARD_RUN_ID": "run-t", "TRAINGUARD_SKIP_BATCHES": "11,13"}
    sup = Supervisor.from_env(env, sink=MemorySink(), run_dir=tmp_path, gpu_reader=None)
    assert sup.skip_batches == {11, 13}
    batches = [torch.full((1,), float(i)) for i in range(5)]
    seen = [(step, int(batch.item())) for step, batch in sup.steps(batches, start=10)]
    assert seen == [(10, 0), (12, 2), (14, 4)] and sup.counters.skipped_batches == 2
    sup.close()


def test_invariants(tmp_path: Path) -> None:
    sup, sink, model = make(tmp_path, config=SupervisorConfig(grad_norm_min_samples=20))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(n: int, scale: float = 1.0, nan: bool = False) -> bool:
        with sup.step(n) as s:
            x = torch.randn(4, 8)
            loss = model(x).square().mean() * scale
            if nan:
                loss = loss * float("nan")
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            applied = s.check(loss)
            if applied:
                opt.step()
            changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            assert changed == applied
            opt.zero_grad()
        return applied

    assert all(step(n) for n in range(30))  # normal steps are applied
    assert not step(30, nan=True)
    assert not step(31, scale=200.0)  # grad norm ~200x: a spike
    assert step(32)
    assert (sup.counters.non_finite, sup.counters.grad_spikes, sup.counters.applied) == (1, 1, 31)
    stats = {e.step: e for e in sink.of(StepStats)}
    assert not stats[30].finite and math.isnan(stats[30].loss)
    assert stats[31].finite and stats[31].grad_norm is not None
    assert len(sink.of(StepTiming)) == 33

    strict, sink2, model2 = make(tmp_path, config=SupervisorConfig(on_non_finite="raise"))
    with pytest.raises(NonFiniteLoss), strict.step(0) as s:
        s.check(torch.tensor(float("inf")))
    assert [e.finite for e in sink2.of(StepStats)] == [False]  # reported before the raise
    sup.close()
    strict.close()


def test_from_env_without_a_broker(tmp_path: Path) -> None:
    env = {"TRAINGUARD_RUN_ID": "run-env", "TRAINGUARD_ATTEMPT": "2", "TRAINGUARD_NODE": "n7",
           "RANK": "3", "WORLD_SIZE": "4", "TRAINGUARD_RUN_DIR": str(tmp_path)}  # fmt: skip
    sup = Supervisor.from_env(env, gpu_reader=None)
    assert (sup.run_id, sup.attempt, sup.node, sup.rank, sup.world_size) == ("run-env", 2, "n7", 3, 4)
    assert isinstance(sup.sink, MemorySink) and sup.actuator is None and sup.run_dir == tmp_path
    assert sup.config == SupervisorConfig()
    sup.close()
    with pytest.raises(KeyError):
        Supervisor.from_env({})


def test_the_environment_tunes_the_intervals_and_a_bad_value_is_named() -> None:
    env = {"TRAINGUARD_FLUSH_INTERVAL_S": "0.25", "TRAINGUARD_HEARTBEAT_INTERVAL_S": "1"}
    config = SupervisorConfig.from_env(env)
    assert (config.flush_interval_s, config.heartbeat_interval_s) == (0.25, 1.0)
    assert config.gpu_health_interval_s == SupervisorConfig().gpu_health_interval_s
    # The launcher's checkpoint interval (the last the run was sent) is in force at the start.
    assert SupervisorConfig.from_env({"TRAINGUARD_CHECKPOINT_INTERVAL_S": "120"}).checkpoint_interval_s == 120
    for bad in ("0", "-1", "nan", "fast"):
        with pytest.raises(ValueError, match=f"TRAINGUARD_FLUSH_INTERVAL_S={bad!r}: expected a positive"):
            SupervisorConfig.from_env({"TRAINGUARD_FLUSH_INTERVAL_S": bad})


def test_the_first_step_writes_the_restart_phases_the_launcher_reads(tmp_path: Path) -> None:
    phases_file = tmp_path / "attempt-1" / "rank-0.phases.json"
    env = {
        "TRAINGUARD_RUN_ID": "run-env",
        "TRAINGUARD_PHASES_FILE": str(phases_file),
        "TRAINGUARD_RUN_DIR": str(tmp_path),
    }

    class Loaded:  # a checkpoint manager that took 0.25 s to load
        last_load_s = 0.25

        def save(self, step: int) -> None: ...

    net = torch.nn.Linear(4, 1)
    sup = Supervisor.from_env(env, model=net, checkpoint=Loaded(), gpu_reader=None)
    before = time.time()
    for step in (7, 8):
        with sup.step(step) as s:
            net(torch.ones(2, 4)).sum().backward()
            s.compute_done()
            s.check(torch.tensor(1.0))
        if step == 7:
            first = json.loads(phases_file.read_text())
    sup.close()
    assert first["checkpoint_load_s"] == 0.25 and first["last_step"] == 7
    assert first["start_ts"] <= before <= first["first_step_ts"]  # process start, then the first step
    # Written once, after the first step only; the close adds its exit code (launcher/attempt.py).
    assert json.loads(phases_file.read_text()) == {**first, "closed": 0}


def test_the_process_group_init_time_reaches_the_phases_file(tmp_path: Path) -> None:
    # init_process_group (trainguard's wrapper) times the group's formation; the phases
    # file the launcher reads must carry that time, not the value at import.
    phases_file = tmp_path / "rank-0.phases.json"
    env = {
        "TRAINGUARD_RUN_ID": "run-pg",
        "TRAINGUARD_PHASES_FILE": str(phases_file),
        "TRAINGUARD_RUN_DIR": str(tmp_path),
    }
    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        net = torch.nn.Linear(4, 1)
        sup = Supervisor.from_env(env, model=net, gpu_reader=None)
        with sup.step(0) as s:
            net(torch.ones(2, 4)).sum().backward()
            s.compute_done()
            s.check(torch.tensor(1.0))
        sup.close()
    finally:
        dist.destroy_process_group()
    pg_init_s = json.loads(phases_file.read_text())["pg_init_s"]
    assert isinstance(pg_init_s, float) and 0 < pg_init_s < 60


def test_the_process_start_time_is_accurate_to_the_clock_tick() -> None:
    """The launcher subtracts its spawn time from it (the process_start phase): /proc/stat's
    whole-second boot time would put it up to a second off, before the spawn even."""
    code = "from trainguard.producers.training.supervisor import process_start_ts; print(process_start_ts())"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    started = float(out.stdout)
    assert before - 0.02 <= started <= before + 1.0  # a clock tick is 10 ms


# --------------------------------------------------------------------------- DDP, 2 gloo ranks

SLOW_S = 0.25


def _ddp_rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = MemorySink()
    saved: list[int] = []

    class Checkpoints:  # a checkpoint is collective: every rank must save the same step
        def save(self, step: int) -> None:
            saved.append(step)

    sup = Supervisor("run-ddp", rank=rank, world_size=2, sink=sink, model=model, gpu_reader=None,
                     checkpoint=Checkpoints())  # fmt: skip
    sup.replay_fn = lambda batch: net(batch).square().mean().backward()  # unwrapped: no collective
    sup.batch_fn = lambda r, s: torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * s + r))
    if rank == 0:  # as a RunSelfCheck for rank 0 would: one rank replays, the other does not
        sup.control.self_checks_due.append(3)
        # ring checks that reached rank 0 first: ring-old never reaches rank 1 (dropped)
        sup.control.ring_checks_due += [(0, "ring-old", 1), (1, "ring-x", 1)]
    else:  # a SkipUpdate(step 4) that reached rank 1 only, before its step 4
        sup.control.skip_steps.add(4)
    verdicts = []
    for step in range(6):
        with sup.step(step, torch.randn(16, 32)) as s:
            if rank == 1:
                time.sleep(SLOW_S)  # the straggler: slow inside its compute
            loss = model(s.batch).square().mean()
            if rank == 1 and step == 3:
                loss = loss * float("nan")  # rank 1's NaN reaches rank 0 through the all-reduce
            if rank == 1 and step == 3:  # ring-x reaches rank 1 at its step 3
                sup.control.ring_checks_due.append((1, "ring-x", 1))
            if rank == 0 and step == 2:  # a CheckpointNow that reached rank 0 first
                sup.control.checkpoint_requested = True
            loss.backward()  # returns after the all-reduce
            s.compute_done()
            if s.check(loss):
                opt.step()
            opt.zero_grad()
            verdicts.append(s.verdict)
    dist.barrier()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out.put(
        (
            rank,
            [(e.compute_s, e.total_s) for e in sink.of(StepTiming)],
            verdicts,
            [e.digest_first == e.digest_second for e in sink.of(SdcSelfCheck)],
            params.numpy().tobytes(),
            saved,
            [(e.step, e.check_id, e.own_value, e.peer_value) for e in sink.of(RingCheck)],
        )
    )
    sup.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ddp_compute_time_is_measured_before_the_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))  # spawned ranks import this
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 90
    while len(results) < 2:
        assert time.monotonic() < deadline, "ranks did not report"
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        try:
            rank, timings, verdicts, checks, params, saved, rings = out.get(timeout=0.5)
        except queue.Empty:
            continue
        results[rank] = (timings, verdicts, checks, params, saved, rings)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # Steps 0 and 1 hold DDP's own setup collectives (the 2nd forward rebuilds the buckets
    # with a broadcast, where the fast rank waits for the slow one): judged from step 2.
    fast, slow = results[0][0][2:], results[1][0][2:]
    for (c0, t0), (c1, t1) in zip(fast, slow, strict=True):
        # The straggler's compute holds its sleep (a lower bound whatever the load) and
        # stands out; the fast rank's may be stretched by preemption on a loaded 2-core box
        # (68 ms seen), far under the gap a compute timed after the all-reduce would close.
        assert c1 >= SLOW_S and c1 - c0 > 0.5 * SLOW_S
        # ...while its step takes as long as everyone's (a loaded box delays one rank's
        # wake-up from the all-reduce by tens of ms: far under a whole SLOW_S).
        assert abs(t1 - t0) < 0.5 * SLOW_S
        assert c0 < 0.5 * t0  # the fast rank spent most of its step waiting in the all-reduce
    # Step 3: non-finite on both (NaN grads after the all-reduce). Step 4: the skip only rank 1
    # was told of is agreed by both, so the replicas stay bitwise equal.
    assert [results[r][1][3] for r in (0, 1)] == [UpdateVerdict.NON_FINITE] * 2
    assert (results[0][1][4], results[1][1][4]) == (UpdateVerdict.PEER, UpdateVerdict.COMMANDED)
    assert all(
        v is UpdateVerdict.APPLY for r in (0, 1) for i, v in enumerate(results[r][1]) if i not in (3, 4)
    )
    assert results[0][3] == results[1][3]
    assert results[0][2] == [True] and results[1][2] == []  # rank 0 self-checked without a hang
    # Step 2: the checkpoint only rank 0 was asked for, on both; step 5: the cadence's first
    # (no interval in force: it measures the cost the interval is derived from), on both.
    assert results[0][4] == results[1][4] == [2, 5]
    # The ring check: run by both at step 4, the first step after both held it (step 3, where
    # rank 0 dropped the one rank 1 never got); each one's recomputation of the other's
    # microbatch is bitwise the other's own value.
    ((step0, id0, own0, peer0),) = results[0][5]
    ((step1, id1, own1, peer1),) = results[1][5]
    assert (step0, id0) == (step1, id1) == (4, "ring-x")
    assert (own0, own1) == (peer1, peer0) and own0 != own1


# --------------------------------------------------------------------------- real broker


@pytest.mark.broker
def test_checkpoint_now_through_the_broker(bootstrap: str, topics: TopicNames, tmp_path: Path) -> None:
    secret = b"k" * 32
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    prefix = topics.commands.removesuffix("trainguard.commands")
    saved: list[int] = []

    class Manager:
        def save(self, step: int) -> None:
            saved.append(step)

    model = torch.nn.Linear(4, 1)
    sup = Supervisor(run_id, rank=0, world_size=1, node="node-x", model=model, checkpoint=Manager(),
                     bootstrap=bootstrap, topic_prefix=prefix, secret=secret, run_dir=tmp_path,
                     gpu_reader=None)  # fmt: skip
    acks = TopicReader(bootstrap, topics.acks)
    try:
        assert sup.wait_ready(30)
        command = auth.sign(
            CheckpointNow(command_id="ck-1", run_id=run_id, attempt=0, ranks=[0], issued_ts=1.0,
                          reason=Reason(code=ReasonCode.OPERATOR, text="broker test")),
            auth.run_key(secret, run_id),
        )  # fmt: skip
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bootstrap})
        producer.produce(topics.commands, key=run_id.encode(), value=encode(command))
        assert producer.flush(30) == 0
        acks.until(lambda seen: len(seen) >= 1, 30)
        ack = decode(acks.seen[0].value, ACKS)
        assert isinstance(ack, Ack)
        assert (ack.command_id, ack.status, ack.rank, ack.node) == ("ck-1", AckStatus.EXECUTED, 0, "node-x")
        assert ack.detail.startswith("checkpoint at the next step boundary")
        with sup.step(5) as s:
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            s.check(loss)
        assert saved == [5]
    finally:
        acks.close()
        sup.close()
    assert sup.shipper is not None and sup.shipper.stats.delivered == sup.shipper.stats.submitted
